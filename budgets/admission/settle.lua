-- Settlement: correct the buckets a request's admission debited by the
-- difference between its estimate and its actual usage, release its lease.
-- Idempotent: the lease hash is the proof that nothing was settled yet, and it
-- is deleted in the same atomic step.
--
-- KEYS: 1 cfg hash, 2 bucket hash, 3 pool leases zset, 4 workload leases zset
--       (of the lease's workload), 5 lease hash, 6 counters hash, 7 capacity hash,
--       8 protected-sum hash, 9 protected fill zset (protected_sum.lua: a
--         protected bucket's correction moves the pool's S with it)
-- ARGV: 1 request id, 2 actual input tokens, 3 actual output tokens,
--       4 1 when the pool was never called (the request slot is refunded too)
-- (Spend is settled on the tenant's keys by spend_settle.lua.)
-- Returns {1, wid, k_in, k_out, borrowed} when it settled, {0} when there was
-- nothing (left) to settle.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local lease_flat = redis.call('HGETALL', KEYS[5])
if #lease_flat == 0 then return {0} end
local lease = {}
for i = 1, #lease_flat, 2 do lease[lease_flat[i]] = lease_flat[i + 1] end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
-- As it is written back (tostring keeps 14 digits: 0.1 ms), so a level
-- read later refills from exactly the moment this script computed it at.
now = tonumber(tostring(now))

local wid = lease['wid']
local k_in, k_out = tonumber(lease['k_in']), tonumber(lease['k_out'])
local a_in, a_out = tonumber(ARGV[2]), tonumber(ARGV[3])
local refund_request = ARGV[4] == '1'

-- The buckets this settlement corrects, in order, each with its delta.
local delta_tok = (k_in + k_out) - (a_in + a_out)
local names, deltas = {}, {}
local function add(name, delta) names[#names + 1] = name; deltas[#deltas + 1] = delta end
add(wid .. '.E.tok', delta_tok)
add('P.tok', delta_tok)
if lease['q_tok'] == '1' then add(wid .. '.Q.tok', delta_tok) end
if refund_request then
  add(wid .. '.E.req', 1)
  add('P.req', 1)
  if lease['q_req'] == '1' then add(wid .. '.Q.req', 1) end
end
add('P.in', k_in - a_in)
add('P.out', k_out - a_out)

-- Every bucket's rate and capacity, its level and the capacity factors it
-- scales by, in three reads (one HGET each was four calls a bucket).
local cfg_fields, level_fields = {}, {}
for i, name in ipairs(names) do
  cfg_fields[2 * i - 1] = name .. '.rate'; cfg_fields[2 * i] = name .. '.cap'
  level_fields[2 * i - 1] = name .. '.l'; level_fields[2 * i] = name .. '.t'
end
local cfg = redis.call('HMGET', KEYS[1], unpack(cfg_fields))
local levels = redis.call('HMGET', KEYS[2], unpack(level_fields))
local factors = redis.call('HMGET', KEYS[7], 'factor', wid .. '.shed')
local pool_factor, shed_factor = tonumber(factors[1]) or 1, tonumber(factors[2]) or 1
local function scale(name)
  if string.sub(name, 1, 2) == 'P.' then return pool_factor end
  if string.find(name, '.Q.', 1, true) then return shed_factor end
  return 1
end

-- The protected sum follows any protected bucket this settlement corrects;
-- when it is missing, the next admission rebuilds it from the levels.
local agg = nil
if lease['q_tok'] == '1' or (refund_request and lease['q_req'] == '1') then
  agg = ps_load(KEYS[8], KEYS[9], KEYS[1], KEYS[7], now)
end

local writes = {}
for i, name in ipairs(names) do
  local rate, cap = tonumber(cfg[2 * i - 1]), tonumber(cfg[2 * i])
  if rate ~= nil and cap ~= nil then  -- nil: the bucket was removed since admission
    local factor = scale(name)
    rate, cap = rate * factor, cap * factor
    local l = tonumber(levels[2 * i - 1])
    if l == nil then l = cap else
      l = l + (now - tonumber(levels[2 * i])) * rate
      if l > cap then l = cap end
    end
    -- A refund never fills a bucket past its capacity; a charge (actual above
    -- the estimate) may take it below zero: that debt is real usage.
    local old = l
    l = l + deltas[i]
    if l > cap then l = cap end
    if agg ~= nil and string.find(name, '.Q.', 1, true) then ps_move(agg, KEYS[9], name, old, l, rate, cap, now) end
    writes[#writes + 1] = name .. '.l'; writes[#writes + 1] = tostring(l)
    writes[#writes + 1] = name .. '.t'; writes[#writes + 1] = tostring(now)
  end
end
if #writes > 0 then redis.call('HSET', KEYS[2], unpack(writes)) end
if agg ~= nil then ps_save(KEYS[8], agg) end

redis.call('DEL', KEYS[5])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
-- Integers as text: Lua would print a negated zero as '-0', which HINCRBY refuses.
local function int(x) return string.format('%d', x) end
redis.call('HINCRBY', KEYS[6], wid .. '.debited_tok', int(0 - delta_tok))
redis.call('HINCRBY', KEYS[6], 'P.debited_tok', int(0 - delta_tok))
redis.call('HINCRBY', KEYS[6], wid .. '.used_tok', int(a_in + a_out))
if refund_request then redis.call('HINCRBY', KEYS[6], wid .. '.admitted_req', -1) end
return {1, wid, k_in, k_out, tonumber(lease['borrowed'])}
