-- Spend reconciliation of one tenant: its hard caps := the database's, and its
-- month-to-date of one month := the ledger's cost of the month + every hold of
-- the month the ledger does not hold yet (requests in flight at their
-- estimate; settled ones at their actual cost until their ledger row is
-- confirmed), in one step against concurrent holds and settlements. Holds
-- the ledger confirms and holds past their expiry (a gateway that died between
-- the spend hold and the pool's admission, a lease reaped without a record)
-- are dropped here: that is how a leaked estimate is repaired.
--
-- The caller (budgets/ledger/spend.py, spend_tenants_sync) read the ledger's
-- sums and which hold ids have a ledger row from one database snapshot taken
-- before it listed the holds; a hold created since cannot be in that snapshot
-- (a request's ledger row is written after its spend settlement), so every
-- hold not confirmed is counted.
--
-- KEYS: 1 caps hash, 2 month-to-date hash of the month, 3 holds hash
--       (tenant_spend_caps, tenant_spend_month, tenant_spend_holds: all {tenant:<id>})
-- ARGV: 1 tenant id, 2 month (YYYY-MM), 3 c = number of caps, 4 n = number of ledger
--       fields, then c pairs (field, cap in micro-units), then n pairs (field, the
--       ledger's cost in micro-units), then the request ids with a ledger row (any month)
--       Fields: "T<tenant id>" (the tenant), "<workload id>" and "O<workload id>" (its
--       spend on overflow slices); a hold's first part lists its workload fields.
-- Returns {month-to-date fields written, holds counted, holds dropped}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local tenant_field = 'T' .. ARGV[1]
local month = ARGV[2]
local c, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local caps = {'pushed', '1'}
for i = 5, 4 + 2 * c do caps[#caps + 1] = ARGV[i] end
local totals = {[tenant_field] = 0}
local first_ledger = 5 + 2 * c
for i = first_ledger, first_ledger + 2 * n - 1, 2 do totals[ARGV[i]] = tonumber(ARGV[i + 1]) end
local in_ledger = {}
for i = first_ledger + 2 * n, #ARGV do in_ledger[ARGV[i]] = true end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(caps))

local holds = redis.call('HGETALL', KEYS[3])
local dropped = {}
local counted = 0
for i = 1, #holds, 2 do
  local rid = holds[i]
  local wid, amount, hold_month, expires = string.match(holds[i + 1], '^([^|]+)|(-?%d+)|([^|]+)|(%d+)|%a$')
  if in_ledger[rid] or wid == nil or tonumber(expires) < now then
    dropped[#dropped + 1] = rid
  elseif hold_month == month then
    totals[tenant_field] = totals[tenant_field] + tonumber(amount)
    for field in string.gmatch(wid, '[^,]+') do totals[field] = (totals[field] or 0) + tonumber(amount) end
    counted = counted + 1
  end
end
for i = 1, #dropped, 1000 do
  redis.call('HDEL', KEYS[3], unpack(dropped, i, math.min(i + 999, #dropped)))
end

local writes = {}
for field, micro in pairs(totals) do
  writes[#writes + 1] = field
  writes[#writes + 1] = string.format('%d', micro)
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(writes))
redis.call('PEXPIRE', KEYS[2], 70 * 86400 * 1000)
return {#writes / 2, counted, #dropped}
