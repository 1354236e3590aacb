-- A request's record, its arrival's metrics and its lane message, written in
-- the round trip of its admission: the last step of the composed admission
-- (gateway/core/admission.py admission_plan, budgets/admission/redis_client.py
-- for composing), run only when the admission (PREVIOUS[ARGV[1]],
-- budgets/admission/admit.lua's answer) admitted the request on its own
-- reservation (not borrowed: a loan takes another lane) and did not hold it,
-- and the spend hold (PREVIOUS[ARGV[2]], budgets/admission/spend_hold.lua; 0:
-- none) took its estimate. Otherwise it writes nothing and the caller
-- enqueues as before (gateway/core/enqueue.py record_enqueue_async). Run on
-- its own (PREVIOUS nil: Redis Cluster) it writes nothing either.
--
-- The same writes as enqueue.py's _record_commands, in the same order, with
-- the admission's clock: admitted_ms as the admission said it, the deadlines as
-- offsets from it.
--
-- KEYS: 1 the request's record, 2 the lane's metrics hash, 3 the lane's
--       in-flight set, 4 the lane's queue
-- ARGV: 1 the admission's step, 2 the spend hold's step (0: none),
--       3 the record's time to live (ms), 4 deadline offset (ms), 5 retry
--       deadline offset (ms), 6 lease (ms), 7 the metrics slot's field,
--       8 request id, 9 the lane message, 10.. the record's other fields
--       (name, value pairs)
-- Returns {1, admitted_ms, deadline_ms, retry_deadline_ms} (as written) or {0}.
-- On its own PREVIOUS is an undefined global, which Redis refuses to read.
local composed, previous = pcall(function() return PREVIOUS end)
if not composed or type(previous) ~= 'table' then return {0} end
local admitted = previous[tonumber(ARGV[1])]
if type(admitted) ~= 'table' or tonumber(admitted[1]) ~= 1 or tonumber(admitted[2]) ~= 0
    or tostring(admitted[8]) == '1' then
  return {0}
end
local hold_step = tonumber(ARGV[2])
if hold_step > 0 then
  local held = previous[hold_step]
  if type(held) ~= 'table' or (tonumber(held[1]) ~= 1 and tonumber(held[1]) ~= 2) then return {0} end
end

local at = tonumber(admitted[7])
local function ms(x) return string.format('%.17g', x) end
local deadline, retry_deadline = ms(at + tonumber(ARGV[4])), ms(at + tonumber(ARGV[5]))
local fields = {'borrowed', '0', 'held', '0', 'admitted_ms', admitted[7], 'deadline_ms', deadline,
                'retry_deadline_ms', retry_deadline}
for i = 10, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HINCRBY', KEYS[2], ARGV[7], 1)
redis.call('ZADD', KEYS[3], ms(at + tonumber(ARGV[6])), ARGV[8])
redis.call('LPUSH', KEYS[4], ARGV[9])
return {1, admitted[7], deadline, retry_deadline}
