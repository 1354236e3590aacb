-- Admission: check and debit every bucket a request touches, atomically.
--
-- Buckets (docs/architecture.md, "Admission: the buckets"), per dimension d in {tok, req}:
--   P.d        the pool, refilling at headroom x provider limit
--   <w>.Q.d    workload w's protected (unlent) reservation
--   <w>.E.d    workload w's ceiling
-- and, where the pool has split limits, P.in / P.out (pool only).
-- S_d = sum of every workload's Q.d level. Keeping P.d >= S_d guarantees each
-- workload its unlent reservation: a request paid from Q always fits in P, and
-- a loan (not paid from Q) is admitted only if it leaves P.d - k >= S_d.
--
-- KEYS: 1 cfg hash, 2 workload-id set, 3 bucket hash, 4 pool leases zset,
--       5 workload leases zset, 6 this request's lease hash, 7 counters hash,
--       8 capacity hash (adaptive factor of the pool, shed scale per workload,
--         the prober's down mark: down_until_ms, probe_next_ms; probe.lua;
--         and the provider's stated limits: prov_*, provider_limits.lua)
--       9 protected-sum hash, 10 protected fill zset (protected_sum.lua),
--       11 the request body's held mark (keys.held_body: set while a request
--          with this body is held, for the lease's ttl)
-- Cost: O(log n) in the pool's workloads (every read names its fields; the
-- protected sum S is an aggregate), except the wait hint of a refused loan
-- (a walk over the fill times until the loan fits) and a rebuild of S after a
-- config push or a shed change (O(n), once).
-- ARGV: 1 workload id, 2 request id, 3 input tokens, 4 output tokens,
--       5 lease ttl (ms), 6 '1' when KEYS[11] names the body's mark,
--       7 the time over which the rate of fresh arrivals is averaged (ms)
-- Held: an admitted request is held (not put on its lane until the provider
-- has room for it above what new work needs: gateway/core/protection/held.py) while the
-- pool's circuit is not closed (capacity 'hold', gateway/core/protection/circuit.lua), and when its
-- body was held before: a client's retry of a held request, which must not
-- take the room of the work that arrives after the outage.
-- Spend caps are not checked here: a tenant's month-to-date spans its pools
-- and lives under the tenant's hash tag (spend_hold.lua runs first).
-- Returns {1, borrowed, e_tok, e_req, e_tok_full_ms, e_req_full_ms, now_ms, held} admitted
--         {2, borrowed, ...}                                                already admitted
--         {0, reason, wait_ms, e_tok, e_req, e_tok_full_ms, e_req_full_ms} rejected
--         {-1, why}                                                   not configured
-- A pool marked down by its prober admits nothing: reason 'pool_unavailable',
-- wait until its next probe (a request too large to ever fit still gets
-- 'request_too_large'). The mark ends by itself (down_until_ms): fail open.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
-- As it is written back (tostring keeps 14 digits: 0.1 ms), so a level
-- read later refills from exactly the moment this script computed it at.
now = tonumber(tostring(now))
local INF = math.huge

local wid = ARGV[1]
local k_in = tonumber(ARGV[3])
local k_out = tonumber(ARGV[4])
local lease_ttl = tonumber(ARGV[5])

local function hmget(key, fields)
  local vals = redis.call('HMGET', key, unpack(fields))
  local out = {}
  for i, f in ipairs(fields) do out[f] = tonumber(vals[i]) end
  return out
end

local E_TOK, E_REQ, Q_TOK, Q_REQ = wid .. '.E.tok', wid .. '.E.req', wid .. '.Q.tok', wid .. '.Q.req'
local BUCKETS = {E_TOK, E_REQ, Q_TOK, Q_REQ, 'P.tok', 'P.req', 'P.in', 'P.out'}
local cfg_fields = {'P.conc', wid .. '.conc', wid .. '.prio'}
local st_fields = {}
for _, b in ipairs(BUCKETS) do
  cfg_fields[#cfg_fields + 1] = b .. '.rate'; cfg_fields[#cfg_fields + 1] = b .. '.cap'
  st_fields[#st_fields + 1] = b .. '.l'; st_fields[#st_fields + 1] = b .. '.t'
end

local cfg = hmget(KEYS[1], cfg_fields)
if cfg['P.tok.rate'] == nil then return {-1, 'unconfigured'} end
if cfg[E_TOK .. '.rate'] == nil then return {-1, 'no_reservation'} end

local lease_existing = redis.call('HMGET', KEYS[6], 'borrowed', 'admitted_ms', 'held')
if lease_existing[1] then
  return {2, tonumber(lease_existing[1]), '0', '0', '0', '0', lease_existing[2], lease_existing[3] or '0'}
end

local st = hmget(KEYS[3], st_fields)
local capacity = hmget(KEYS[8], {'factor', wid .. '.shed', 'down_until_ms', 'probe_next_ms', 'blocked_until_ms',
  'prov_factor', 'prov_until_ms', 'prov_reserve', 'prov_rem_tok', 'prov_rem_req', 'prov_limit_tok', 'prov_limit_req',
  'prov_reset_tok_ms', 'prov_reset_req_ms', 'hold', 'fresh_r', 'fresh_rt', 'fresh_t'})

-- Capacity that moves: the pool's buckets run at the adaptive factor of their
-- configured rate, and when that no longer covers every reservation the
-- sheddable workloads' protected buckets shrink first (capacity.lua).
-- The pool's factor is the provider's own stated limit over the configured
-- one while it states one (provider_limits.lua), else capacity.lua's.
local pool_factor = capacity['factor'] or 1
if capacity['prov_factor'] and now < (capacity['prov_until_ms'] or 0) then pool_factor = capacity['prov_factor'] end
local function scale(name)
  if string.sub(name, 1, 2) == 'P.' then return pool_factor end
  local wid_part, kind = string.match(name, '^([^.]+)%.(%a)%.')
  if kind == 'Q' then return capacity[wid_part .. '.shed'] or 1 end
  return 1
end
-- Each bucket's scaled rate and capacity, worked out once per call (the
-- levels, the waits and the debit ask for the same few buckets again).
local rates, caps = {}, {}
local function rate_of(name)
  local r = rates[name]
  if r == nil then r = (cfg[name .. '.rate'] or 0) * scale(name); rates[name] = r end
  return r
end
local function cap_of(name)
  local c = caps[name]
  if c == nil then c = (cfg[name .. '.cap'] or 0) * scale(name); caps[name] = c end
  return c
end

-- Level of a bucket now: last level plus refill since, capped. A bucket never
-- seen starts full.
local function level(name)
  local cap = cap_of(name)
  local l = st[name .. '.l']
  if l == nil then return cap end
  local v = l + (now - st[name .. '.t']) * rate_of(name)
  if v > cap then v = cap end
  return v
end

-- A request bigger than a bucket shrunk by adaptive capacity (or shedding)
-- fits again once capacity recovers: a short hint, not 'never'.
local CAPACITY_RECOVERY_HINT_MS = 1000

local function wait_for(name, lvl, k)
  if k > cap_of(name) then
    if k > (cfg[name .. '.cap'] or 0) then return INF end
    return CAPACITY_RECOVERY_HINT_MS
  end
  if lvl >= k then return 0 end
  local rate = rate_of(name)
  if rate <= 0 then return INF end
  return (k - lvl) / rate
end

local function time_to_full(name, lvl)
  local rate, cap = rate_of(name), cap_of(name)
  if lvl >= cap then return 0 end
  if rate <= 0 then return INF end
  return (cap - lvl) / rate
end

local agg, agg_changed = ps_load(KEYS[9], KEYS[10], KEYS[1], KEYS[8], now)
if agg == nil then
  agg = ps_rebuild(KEYS[9], KEYS[10], KEYS[1], KEYS[2], KEYS[3], KEYS[8], now)
  agg_changed = true
end

-- Earliest time at which P - S >= k (a loan fits), walking the piecewise
-- linear P(t) - S(t) through the moments buckets fill up: P's own, and the
-- protected buckets' in the fill zset's order. The walk stops after FILL_WALK
-- of them (O(log n) in all): past that, it answers an upper bound, never an
-- earlier time than the loan fits. Until P is full, the buckets still to fill
-- only make P - S grow faster, so the current slope gives one; failing that,
-- once P and every protected bucket are full, P - S is the full-capacity gap,
-- which fits k (checked first).
local FILL_WALK = 64
local function wait_for_free(d, p, k)
  local pname = 'P.' .. d
  if k > cap_of(pname) - agg[d .. '.cap'] then
    if k > (cfg[pname .. '.cap'] or 0) - agg[d .. '.ucap'] then return INF end
    return CAPACITY_RECOVERY_HINT_MS
  end
  local f = p - ps_value(agg, d)
  if f >= k then return 0 end
  local slope = -agg[d .. '.r']
  local tp = time_to_full(pname, p)
  local p_pending = tp > 0 and tp < INF
  if p_pending then slope = slope + rate_of(pname) end
  local t0 = 0
  local function step(at, dslope)
    if slope > 0 and f + slope * (at - t0) >= k then return t0 + (k - f) / slope end
    f = f + slope * (at - t0)
    t0 = at
    slope = slope + dslope
    return nil
  end
  local batch = redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, FILL_WALK)
  -- This dimension's filling buckets, in fill order, and their scaled rates
  -- read in two HMGETs (not two calls per bucket: at 1,000 workloads the walk's
  -- 128 reads were most of a refused loan's time in Redis, bench/RESULTS.md
  -- section 10).
  -- A member is "<wid>.Q.<d>" (ps_add), d three letters: plain string.sub
  -- finds its dimension and workload, no pattern per member.
  local fills, rate_fields, shed_fields = {}, {}, {}
  for i = 1, #batch, 2 do
    if batch[i + 1] == 'inf' then break end
    local name = batch[i]
    if string.sub(name, -3) == d then
      fills[#fills + 1] = tonumber(batch[i + 1]) - now
      rate_fields[#rate_fields + 1] = name .. '.rate'
      shed_fields[#shed_fields + 1] = string.sub(name, 1, -7) .. '.shed'
    end
  end
  if #fills > 0 then
    local rates = redis.call('HMGET', KEYS[1], unpack(rate_fields))
    local sheds = redis.call('HMGET', KEYS[8], unpack(shed_fields))
    for j, at in ipairs(fills) do
      if p_pending and tp <= at then
        local r = step(tp, -rate_of(pname)); if r then return r end
        p_pending = false
      end
      local rate = (tonumber(rates[j]) or 0) * (tonumber(sheds[j]) or 1)
      local r = step(at, rate); if r then return r end
    end
  end
  if #batch == 2 * FILL_WALK then
    if p_pending and slope > 0 and t0 + (k - f) / slope <= tp then return t0 + (k - f) / slope end
    local last = redis.call('ZREVRANGEBYSCORE', KEYS[10], '(+inf', '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local t_last = 0
    if #last > 0 then t_last = tonumber(last[2]) - now end
    if p_pending then return math.max(tp, t_last, t0) end
    return math.max(t_last, t0)
  end
  if p_pending then
    local r = step(tp, -rate_of(pname)); if r then return r end
  end
  if slope > 0 then return t0 + (k - f) / slope end
  if f >= k then return t0 end
  return INF
end

local levels = {}
local plan = {}          -- d -> true when paid from Q
local reason = nil
local wait = 0
local borrowed = 0

local function fail(r, w)
  if reason == nil or w > wait then reason = r; wait = w end
end

for _, d in ipairs({'tok', 'req'}) do
  local k = (d == 'tok') and (k_in + k_out) or 1
  local ename, qname, pname = wid .. '.E.' .. d, wid .. '.Q.' .. d, 'P.' .. d
  local e, q, p = level(ename), level(qname), level(pname)
  levels[ename], levels[qname], levels[pname] = e, q, p
  local e_wait = wait_for(ename, e, k)
  if e_wait > 0 then fail('workload_' .. (d == 'tok' and 'tpm' or 'rpm'), e_wait) end
  if q >= k then
    plan[d] = true
  else
    plan[d] = false
    borrowed = 1
    local s = ps_value(agg, d)
    if p - k < s then
      local w = math.min(wait_for(qname, q, k), wait_for_free(d, p, k))
      fail('pool_' .. (d == 'tok' and 'tpm' or 'rpm'), math.max(w, e_wait))
    end
  end
end

for _, d in ipairs({'in', 'out'}) do
  local pname = 'P.' .. d
  if cfg[pname .. '.rate'] ~= nil then
    local k = (d == 'in') and k_in or k_out
    local p = level(pname)
    levels[pname] = p
    local w = wait_for(pname, p, k)
    if w > 0 then fail(d == 'in' and 'pool_input_tpm' or 'pool_output_tpm', w) end
  end
end

-- What the provider said remains (provider_limits.lua), less what workers
-- sent since (provider_take.lua takes it when a call goes out), refilling at
-- its stated per-minute limit once its reset has passed: a call it would
-- refuse is refused here instead, with the provider's reset as the wait.
-- Loans and sheddable classes leave the last prov_reserve of the provider's
-- limit to protected work (I2 holds inside the provider's window too).
-- Held work (see the header) goes to the provider only when it has room
-- (gateway/core/protection/held_release.lua): its room is not asked here.
local retried_memo
local function retried()
  if retried_memo == nil then retried_memo = ARGV[6] == '1' and redis.call('EXISTS', KEYS[11]) == 1 end
  return retried_memo
end
local provider_room = {}
local provider_sheddable = borrowed == 1 or (cfg[wid .. '.prio'] or 0) > 0
for _, d in ipairs({'tok', 'req'}) do
  local room = capacity['prov_rem_' .. d]
  if room ~= nil then
    local k = (d == 'tok') and (k_in + k_out) or 1
    if provider_sheddable then k = k + (capacity['prov_reserve'] or 0) * (capacity['prov_limit_' .. d] or 0) end
    local reset_at = capacity['prov_reset_' .. d .. '_ms'] or 0
    local limit = capacity['prov_limit_' .. d] or 0
    if now > reset_at and limit > 0 then room = math.min(limit, room + (now - reset_at) * limit / 60000) end
    provider_room[d] = room
    if room < k and (limit == 0 or k <= limit) and not (capacity['hold'] or retried()) then
      local w = reset_at - now
      if w <= 0 then w = (limit > 0) and (k - room) * 60000 / limit or 1000 end
      fail('provider_' .. (d == 'tok' and 'tpm' or 'rpm'), w)
    end
  end
end

local e_tok, e_req = levels[wid .. '.E.tok'], levels[wid .. '.E.req']
local e_tok_full = time_to_full(wid .. '.E.tok', e_tok)
local e_req_full = time_to_full(wid .. '.E.req', e_req)
if e_tok_full == INF then e_tok_full = -1 end
if e_req_full == INF then e_req_full = -1 end

-- Reachability (probe.lua): a pool that does not answer takes no work; its
-- callers hear so at once instead of waiting on calls that cannot succeed.
if now < (capacity['down_until_ms'] or 0) and wait ~= INF then
  reason = 'pool_unavailable'
  wait = math.max(1, (capacity['probe_next_ms'] or now) - now)
end

if reason == nil then
  -- Upstream Retry-After is a floor: until it passes, loans and sheddable
  -- classes (batch, scheduled) wait; protected interactive work still flows.
  local blocked = capacity['blocked_until_ms'] or 0
  if now < blocked and (borrowed == 1 or (cfg[wid .. '.prio'] or 0) > 0) then
    fail('pool_backoff', blocked - now)
  end
end

if reason == nil then
  -- In-flight limits: a lease per admitted request until it settles or expires.
  local conc = cfg['P.conc']
  if conc and conc > 0 and redis.call('ZCOUNT', KEYS[4], now, '+inf') >= conc then
    fail('pool_saturated', 1000)
  end
  local wconc = cfg[wid .. '.conc']
  if reason == nil and wconc and wconc > 0 and redis.call('ZCOUNT', KEYS[5], now, '+inf') >= wconc then
    fail('workload_concurrency', 1000)
  end
end

if reason ~= nil then
  if agg_changed then ps_save(KEYS[9], agg) end
  if wait == INF then reason = 'request_too_large'; wait = -1 end
  return {0, reason, tostring(math.ceil(wait)), tostring(math.floor(e_tok)), tostring(math.floor(e_req)),
          tostring(math.ceil(e_tok_full)), tostring(math.ceil(e_req_full)), tostring(now)}
end

-- Debit.
local writes = {}
local function debit(name, k)
  local v = levels[name] - k
  writes[#writes + 1] = name .. '.l'; writes[#writes + 1] = tostring(v)
  writes[#writes + 1] = name .. '.t'; writes[#writes + 1] = tostring(now)
  levels[name] = v
end
local k_tok = k_in + k_out
debit(wid .. '.E.tok', k_tok); debit('P.tok', k_tok)
debit(wid .. '.E.req', 1); debit('P.req', 1)
local function debit_protected(name, k)
  local old = levels[name]
  debit(name, k)
  ps_move(agg, KEYS[10], name, old, levels[name], rate_of(name), cap_of(name), now)
  agg_changed = true
end
if plan['tok'] then debit_protected(Q_TOK, k_tok) end
if plan['req'] then debit_protected(Q_REQ, 1) end
if agg_changed then ps_save(KEYS[9], agg) end
if levels['P.in'] ~= nil then debit('P.in', k_in) end
if levels['P.out'] ~= nil then debit('P.out', k_out) end
redis.call('HSET', KEYS[3], unpack(writes))

local held = '0'
if retried() or capacity['hold'] then held = '1' end
if held == '1' and ARGV[6] == '1' then redis.call('SET', KEYS[11], '1', 'PX', math.ceil(lease_ttl)) end
-- The rate of fresh arrivals (not a held body's retry), requests and tokens
-- per ms, averaged over ARGV[7] ms (exponentially): the new work that held
-- work leaves room for when it is released (gateway/core/protection/held_release.lua).
if not retried() then
  local tau = tonumber(ARGV[7])
  local decay = math.exp(-math.max(0, now - (capacity['fresh_t'] or now)) / tau)
  redis.call('HSET', KEYS[8], 'fresh_r', tostring((capacity['fresh_r'] or 0) * decay + 1 / tau),
             'fresh_rt', tostring((capacity['fresh_rt'] or 0) * decay + (k_in + k_out) / tau), 'fresh_t', tostring(now))
end

local expires = now + lease_ttl
redis.call('HSET', KEYS[6], 'wid', wid, 'k_in', k_in, 'k_out', k_out,
           'q_tok', plan['tok'] and 1 or 0, 'q_req', plan['req'] and 1 or 0,
           'borrowed', borrowed, 'admitted_ms', tostring(now), 'held', held)
redis.call('PEXPIRE', KEYS[6], math.ceil(lease_ttl * 4))
redis.call('ZADD', KEYS[4], expires, ARGV[2])
redis.call('ZADD', KEYS[5], expires, ARGV[2])
redis.call('HINCRBY', KEYS[7], wid .. '.debited_tok', k_tok)
redis.call('HINCRBY', KEYS[7], 'P.debited_tok', k_tok)
redis.call('HINCRBY', KEYS[7], wid .. '.admitted_req', 1)

local function full_ms(name)
  local ms = time_to_full(name, levels[name])
  if ms == INF then return '-1' end
  return tostring(math.ceil(ms))
end
return {1, borrowed, tostring(math.floor(levels[wid .. '.E.tok'])), tostring(math.floor(levels[wid .. '.E.req'])),
        full_ms(wid .. '.E.tok'), full_ms(wid .. '.E.req'), tostring(now), held}
