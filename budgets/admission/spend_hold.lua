-- Spend hold: check a request's estimated cost against its tenant's and its
-- workload's hard monthly caps (and, for a request on an overflow slice, the
-- workload's overflow cap), and add it to their month-to-date, atomically.
-- Runs before the pool's admission (admit.lua), on the tenant's keys only (a
-- tenant spends on several pools; Redis Cluster forbids one script on both);
-- when the pool then refuses, spend_settle.lua forgets the hold.
--
-- Invariant: month-to-date + this request's estimate <= cap for every capped
-- field, checked and added in one step, so N concurrent requests of one
-- tenant, on any pools, never pass the cap together.
--
-- KEYS: 1 caps hash, 2 month-to-date hash of the month, 3 holds hash
--       (budgets/admission/keys.py: tenant_spend_caps, tenant_spend_month,
--       tenant_spend_holds; all tagged {tenant:<id>})
-- ARGV: 1 tenant id, 2 workload id, 3 request id, 4 estimated cost (micro-units, > 0),
--       5 month (YYYY-MM, the month of KEYS[2]), 6 hold ttl (ms: the lease's and a margin),
--       7 end of the month (ms), 8 '1' when the request is admitted on an overflow slice
--       (routing across pools: its cost also counts against field O<workload id>)
-- Fields of KEYS[1] and KEYS[2]: "T<tenant id>", "<workload id>", "O<workload id>".
-- A hold is kept as "<fields>|<amount>|<month>|<expires ms>|<e or s>", <fields> the
-- workload's fields it counts in, comma-separated ("12" or "12,O12");
-- spend_settle.lua and spend_reconcile.lua read the same.
-- Returns {1, now_ms}                    held
--         {2, now_ms}                    already held (a replay of the same request id; with
--                                        ARGV[8] '1', a hold without the overflow field gets it,
--                                        within the overflow cap, or the refusal below)
--         {0, 'spend_budget', wait_ms}   refused: a cap would be passed
--         {0, 'overflow_spend_budget', wait_ms}  refused: the overflow cap would be
--         {-1, 'unconfigured'}           caps or month-to-date missing (new month, Redis
--                                        flushed): the caller restores them and calls again
if redis.replicate_commands then pcall(redis.replicate_commands) end

if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then
  return {-1, 'unconfigured'}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local rid = ARGV[3]
local held = redis.call('HGET', KEYS[3], rid)
if held then
  -- A replay. Or the same request now admitted on an overflow slice (routing
  -- moved it past a failing pool, or a worker failed it over): its held
  -- estimate then also counts against the overflow cap, checked here.
  local overflow_field = 'O' .. ARGV[2]
  local fields_part, held_amount, held_month, expires, state = string.match(held, '^([^|]+)|(-?%d+)|([^|]+)|(%d+)|(%a)$')
  if ARGV[8] == '1' and state == 'e' and held_month == ARGV[5]
      and not string.find(',' .. fields_part .. ',', ',' .. overflow_field .. ',', 1, true) then
    local amount = tonumber(held_amount)
    local cap = tonumber(redis.call('HGET', KEYS[1], overflow_field))
    if cap ~= nil and (tonumber(redis.call('HGET', KEYS[2], overflow_field)) or 0) + amount > cap then
      return {0, 'overflow_spend_budget', tostring(math.max(1, tonumber(ARGV[7]) - now))}
    end
    redis.call('HINCRBY', KEYS[2], overflow_field, held_amount)
    redis.call('HSET', KEYS[3], rid, fields_part .. ',' .. overflow_field .. '|' .. held_amount .. '|' .. held_month
               .. '|' .. expires .. '|e')
  end
  return {2, tostring(now)}
end

local cost = tonumber(ARGV[4])
local fields = {'T' .. ARGV[1], ARGV[2]}
if ARGV[8] == '1' then fields[3] = 'O' .. ARGV[2] end
for _, field in ipairs(fields) do
  local cap = tonumber(redis.call('HGET', KEYS[1], field))
  if cap ~= nil then
    local spent = tonumber(redis.call('HGET', KEYS[2], field)) or 0
    if spent + cost > cap then
      local reason = string.sub(field, 1, 1) == 'O' and 'overflow_spend_budget' or 'spend_budget'
      return {0, reason, tostring(math.max(1, tonumber(ARGV[7]) - now))}
    end
  end
end

-- Integers as text: HINCRBY refuses Lua's float formatting.
local amount = string.format('%d', cost)
for _, field in ipairs(fields) do redis.call('HINCRBY', KEYS[2], field, amount) end
redis.call('HSET', KEYS[3], rid,
           table.concat(fields, ',', 2) .. '|' .. amount .. '|' .. ARGV[5] .. '|' .. string.format('%d', now + tonumber(ARGV[6])) .. '|e')
-- A month's hash outlives its month long enough for late settlements and pages.
redis.call('PEXPIRE', KEYS[2], 70 * 86400 * 1000)
redis.call('PEXPIRE', KEYS[3], 70 * 86400 * 1000)
return {1, tostring(now)}
