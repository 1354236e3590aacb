-- Spend settlement: correct a request's held estimate to its actual cost, once.
-- Idempotent on the request id: the hold's state turns from 'e' (estimate) to
-- 's' (settled) in the same step, and a settled or missing hold changes
-- nothing. The settled hold stays (with its actual cost) until reconciliation
-- finds the request's ledger row, so a reconcile that read the ledger just
-- before that row landed still counts it (budgets/ledger/spend.py).
--
-- KEYS: 1 holds hash, 2 month-to-date hash of the hold's month (both {tenant:<id>})
-- ARGV: 1 tenant id, 2 request id, 3 actual cost (micro-units),
--       4 '1' to forget the hold instead (the pool refused the request: it never
--       existed, nothing will be written to the ledger), 5 month (YYYY-MM) of KEYS[2],
--       6 how long a settled hold is kept (ms) when no reconciliation confirms it
-- A hold's first part names the workload's fields it counts in (spend_hold.lua).
-- Returns {1, estimated micro} settled (or forgotten) now, {0} nothing (left) to settle.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local raw = redis.call('HGET', KEYS[1], ARGV[2])
if not raw then return {0} end
local wid, amount, month, _, state = string.match(raw, '^([^|]+)|(-?%d+)|([^|]+)|(%d+)|(%a)$')
if state ~= 'e' then return {0} end
if month ~= ARGV[5] then return redis.error_reply('spend hold of ' .. month .. ' settled against ' .. ARGV[5]) end

local estimated = tonumber(amount)
local fields = {'T' .. ARGV[1]}
for field in string.gmatch(wid, '[^,]+') do fields[#fields + 1] = field end
if ARGV[4] == '1' then
  for _, field in ipairs(fields) do redis.call('HINCRBY', KEYS[2], field, string.format('%d', 0 - estimated)) end
  redis.call('HDEL', KEYS[1], ARGV[2])
  return {1, estimated}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local actual = tonumber(ARGV[3])
local correction = string.format('%d', actual - estimated)
for _, field in ipairs(fields) do redis.call('HINCRBY', KEYS[2], field, correction) end
redis.call('HSET', KEYS[1], ARGV[2], wid .. '|' .. string.format('%d', actual) .. '|' .. month .. '|'
           .. string.format('%d', now + tonumber(ARGV[6])) .. '|s')
return {1, estimated}
