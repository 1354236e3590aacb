-- Headroom of a pool now, for routing among replicas (slices of equal rank:
-- gateway/core/request/routing.py): how much of the pool is free, as the
-- smallest of its free fractions, in thousandths. Reads only; admission
-- (admit.lua) still decides, atomically, whether a request fits.
--
-- KEYS: 1 cfg hash, 2 bucket hash, 3 pool leases zset, 4 capacity hash
--       (budgets/admission/keys.py: pool_config, pool_buckets, pool_leases,
--       pool_capacity; all tagged {pool:<id>})
-- ARGV: none
-- Returns the headroom in thousandths, 0..1000, as an integer:
--   min(pool token bucket level / its capacity (at the adaptive factor),
--       1 - requests in flight / the in-flight limit,
--       what the provider said remains / its stated limit)
--   0 when the pool is marked down by its prober, its circuit is not closed
--   (capacity 'hold') or it has no config (unconfigured: admission rebuilds it).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local cfg = redis.call('HMGET', KEYS[1], 'P.tok.rate', 'P.tok.cap', 'P.conc')
local rate, cap, conc = tonumber(cfg[1]), tonumber(cfg[2]), tonumber(cfg[3])
if rate == nil or cap == nil or cap <= 0 then return 0 end

local c = redis.call('HMGET', KEYS[4], 'factor', 'down_until_ms', 'hold', 'prov_factor', 'prov_until_ms',
                     'prov_rem_tok', 'prov_limit_tok')
if now < (tonumber(c[2]) or 0) or c[3] then return 0 end
local factor = tonumber(c[1]) or 1
if c[4] and now < (tonumber(c[5]) or 0) then factor = tonumber(c[4]) end
rate, cap = rate * factor, cap * factor
if cap <= 0 then return 0 end

local st = redis.call('HMGET', KEYS[2], 'P.tok.l', 'P.tok.t')
local level = cap
if st[1] then
  level = math.min(cap, tonumber(st[1]) + (now - tonumber(st[2])) * rate)
end
local free = level / cap

if conc and conc > 0 then
  local inflight = redis.call('ZCOUNT', KEYS[3], now, '+inf')
  free = math.min(free, 1 - inflight / conc)
end

local remaining, limit = tonumber(c[6]), tonumber(c[7])
if remaining and limit and limit > 0 then free = math.min(free, remaining / limit) end

if free < 0 then free = 0 end
return math.floor(free * 1000)
