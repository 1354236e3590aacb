-- A request's record, read as the first step of a worker's delivery (in the
-- same script as its claim: gateway/core/request/records.py record_claim_calls).
-- KEYS: 1 the record hash
-- Returns {1, field, value, ...}, or {0} when there is no record (expired,
-- or deleted by the reaper): the claim after it is then skipped.
local flat = redis.call('HGETALL', KEYS[1])
if #flat == 0 then return {0} end
table.insert(flat, 1, 1)
return flat
