-- Library (prepended to admit.lua and settle.lua by LuaScript): the pool's
-- protected sum S_d = sum over workloads w of level(w.Q.d), d in {tok, req},
-- kept as an incremental aggregate so admission is O(log n) in the number of
-- workloads instead of a loop over every protected bucket.
--
-- A protected bucket is either full (it contributes its capacity, constant)
-- or filling (it contributes l + (t - t0) * rate, linear in time). So
--   S_d(t) = s_d + r_d * (t - ts_d) + c_d
-- with s_d the filling buckets' levels at ts_d, r_d their rates, c_d the full
-- buckets' capacities. The fill zset holds every filling bucket (member: the
-- bucket's name "<wid>.Q.<d>", score: the ms at which it is full; +inf when
-- its rate is 0); advancing to now moves the buckets whose time has come
-- from "filling" to "full", in order of that time.
--
-- KEYS named by the caller: the sum hash (fields ok, <d>.s, <d>.r, <d>.c,
-- <d>.ts, <d>.cap = sum of (scaled) capacities, <d>.ucap = unscaled), the
-- fill zset, and the pool's cfg / buckets / capacity hashes and workload set.
-- Rates and capacities are scaled by the workload's shed factor (capacity
-- hash "<wid>.shed"): capacity.lua deletes the sum hash whenever a shed
-- factor changes, pool_config.py whenever the config is pushed, and the next
-- admission rebuilds it (ps_rebuild, O(n) once). A missing sum hash makes
-- settlement leave the aggregate alone (the rebuild reads the levels).
local PS_DIMS = {'tok', 'req'}

local function ps_dim(name) return string.match(name, '%.(%a+)$') end

-- Scaled rate and capacity of one protected bucket.
local function ps_bucket(k_cfg, k_capacity, name)
  local v = redis.call('HMGET', k_cfg, name .. '.rate', name .. '.cap')
  local wid_part = string.match(name, '^([^.]+)%.')
  local shed = tonumber(redis.call('HGET', k_capacity, wid_part .. '.shed')) or 1
  return (tonumber(v[1]) or 0) * shed, (tonumber(v[2]) or 0) * shed
end

-- The aggregate brought to `now` (nil when it must be rebuilt), and whether
-- that moved buckets to "full" (then the caller must ps_save it).
local function ps_load(k_sum, k_fill, k_cfg, k_capacity, now)
  local flat = redis.call('HGETALL', k_sum)
  if #flat == 0 then return nil end
  local a = {}
  for i = 1, #flat, 2 do a[flat[i]] = tonumber(flat[i + 1]) end
  local due = redis.call('ZRANGEBYSCORE', k_fill, '-inf', now, 'WITHSCORES')
  for i = 1, #due, 2 do
    local name, at = due[i], tonumber(due[i + 1])
    local d = ps_dim(name)
    local rate, cap = ps_bucket(k_cfg, k_capacity, name)
    a[d .. '.s'] = a[d .. '.s'] + a[d .. '.r'] * (at - a[d .. '.ts']) - cap
    a[d .. '.ts'] = at
    a[d .. '.r'] = a[d .. '.r'] - rate
    a[d .. '.c'] = a[d .. '.c'] + cap
  end
  if #due > 0 then redis.call('ZREMRANGEBYSCORE', k_fill, '-inf', now) end
  for _, d in ipairs(PS_DIMS) do
    a[d .. '.s'] = a[d .. '.s'] + a[d .. '.r'] * (now - a[d .. '.ts'])
    a[d .. '.ts'] = now
  end
  return a, #due > 0
end

-- S_d at the time the aggregate was loaded.
local function ps_value(a, d) return a[d .. '.s'] + a[d .. '.c'] end

local function ps_add(a, k_fill, name, lvl, rate, cap, now)
  local d = ps_dim(name)
  if lvl >= cap then
    a[d .. '.c'] = a[d .. '.c'] + cap
  else
    a[d .. '.s'] = a[d .. '.s'] + lvl
    a[d .. '.r'] = a[d .. '.r'] + rate
    local at = '+inf'
    if rate > 0 then at = string.format('%.17g', now + (cap - lvl) / rate) end
    redis.call('ZADD', k_fill, at, name)
  end
end

-- One protected bucket's level was rewritten at `now` (old -> new).
local function ps_move(a, k_fill, name, old_level, new_level, rate, cap, now)
  local d = ps_dim(name)
  if redis.call('ZSCORE', k_fill, name) then
    a[d .. '.s'] = a[d .. '.s'] - old_level
    a[d .. '.r'] = a[d .. '.r'] - rate
    redis.call('ZREM', k_fill, name)
  else
    a[d .. '.c'] = a[d .. '.c'] - cap
  end
  ps_add(a, k_fill, name, new_level, rate, cap, now)
end

local function ps_save(k_sum, a)
  local flat = {}
  for f, v in pairs(a) do flat[#flat + 1] = f; flat[#flat + 1] = string.format('%.17g', v) end
  redis.call('HSET', k_sum, unpack(flat))
end

-- O(n): the aggregate from every protected bucket's level now.
local function ps_rebuild(k_sum, k_fill, k_cfg, k_wids, k_buckets, k_capacity, now)
  redis.call('DEL', k_sum, k_fill)
  local a = {ok = 1}
  for _, d in ipairs(PS_DIMS) do
    a[d .. '.s'], a[d .. '.r'], a[d .. '.c'], a[d .. '.ts'] = 0, 0, 0, now
    a[d .. '.cap'], a[d .. '.ucap'] = 0, 0
  end
  for _, w in ipairs(redis.call('SMEMBERS', k_wids)) do
    for _, d in ipairs(PS_DIMS) do
      local name = w .. '.Q.' .. d
      local ucap = tonumber(redis.call('HGET', k_cfg, name .. '.cap'))
      if ucap ~= nil then
        local rate, cap = ps_bucket(k_cfg, k_capacity, name)
        local st = redis.call('HMGET', k_buckets, name .. '.l', name .. '.t')
        local lvl = cap
        if st[1] then
          lvl = tonumber(st[1]) + (now - tonumber(st[2])) * rate
          if lvl > cap then lvl = cap end
        end
        ps_add(a, k_fill, name, lvl, rate, cap, now)
        a[d .. '.cap'] = a[d .. '.cap'] + cap
        a[d .. '.ucap'] = a[d .. '.ucap'] + ucap
      end
    end
  end
  return a
end

