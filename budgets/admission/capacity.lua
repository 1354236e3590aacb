-- Capacity that moves: the pool's effective admission rate follows what the
-- upstream tells us. Multiplicative decrease on a throttle signal (an
-- upstream 429, or latency growing well past its baseline), additive
-- recovery while calls succeed. When the effective rate no longer covers
-- every reservation, protected buckets are scaled down in shedding order:
-- scheduled first, then batch, interactive last.
--
-- KEYS: 1 cfg hash, 2 workload-id set, 3 capacity hash, 4 protected-sum hash,
--       5 protected fill zset (a shed change rescales protected buckets: the
--         sum is deleted and the next admission rebuilds it, protected_sum.lua)
-- ARGV: 1 event ('throttle' | 'ok' | 'recompute'), 2 upstream latency per
--       token (ms, 'ok' only), 3 retry-after from upstream (ms, 'throttle'),
--       4 decrease factor, 5 recovery per second, 6 minimum factor,
--       7 cooldown (ms), 8 latency ratio that counts as a throttle,
--       9 how long (ms) the level of the last throttle is remembered,
--       10 latency per token (ms) below which latency growth is ignored
--
-- Recovery is fast up to 90% of the factor at which the pool last pushed
-- back, then ten times slower (a gentle probe), so a pool whose capacity
-- dropped is not hammered back into 429s every few seconds; that memory
-- fades after ARGV[9] without a throttle (the pool recovered).
-- Returns {factor as text, changed 0/1}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local event = ARGV[1]
local beta, alpha, floor = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cooldown, latency_ratio = tonumber(ARGV[7]), tonumber(ARGV[8])

local cap = {}
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do cap[flat[i]] = tonumber(flat[i + 1]) end
local factor = cap['factor'] or 1
local last_decrease = cap['last_decrease_ms'] or 0
local last_increase = cap['last_increase_ms'] or 0
local hint = cap['hint'] or 1
local hint_memory = tonumber(ARGV[9]) or 60000
local changed = false

local function decrease()
  -- One decrease per cooldown: a burst of 429s is one signal, not fifty.
  if now - last_decrease >= cooldown then
    hint = factor
    factor = math.max(floor, factor * beta)
    last_decrease = now
    changed = true
  end
end

if event == 'throttle' then
  -- 429s that arrive while the pool's last Retry-After still runs mostly
  -- answer requests sent before we slowed down (a provider's sliding window
  -- drains slowly): within that window the factor may fall at most two
  -- halvings below where this episode of throttling began; once the
  -- Retry-After has passed, a 429 is news again.
  local episode_start = cap['episode_start'] or factor
  if now - last_decrease >= hint_memory then episode_start = factor end
  redis.call('HSET', KEYS[3], 'episode_start', tostring(episode_start))
  if now >= (cap['blocked_until_ms'] or 0) or factor * beta >= episode_start * beta * beta - 1e-9 then
    decrease()
  end
  local retry_after = tonumber(ARGV[3]) or 0
  if retry_after > 0 then
    local until_ms = now + retry_after
    if until_ms > (cap['blocked_until_ms'] or 0) then
      redis.call('HSET', KEYS[3], 'blocked_until_ms', tostring(until_ms))
    end
  end
  redis.call('HINCRBY', KEYS[3], 'throttles', 1)
elseif event == 'ok' then
  local per_token = tonumber(ARGV[2]) or 0
  if per_token > 0 then
    local fast = cap['lat_fast'] or per_token
    local slow = cap['lat_slow'] or per_token
    local samples = (cap['lat_samples'] or 0) + 1
    fast = fast + 0.2 * (per_token - fast)
    slow = slow + 0.01 * (per_token - slow)
    redis.call('HSET', KEYS[3], 'lat_fast', tostring(fast), 'lat_slow', tostring(slow), 'lat_samples', samples)
    -- Below a floor per token, latency is our own queueing and noise, not
    -- a saturated engine (decode steps take tens of ms).
    if samples > 50 and fast > latency_ratio * slow and fast > (tonumber(ARGV[10]) or 5) then decrease() end
  end
  if now - last_decrease >= hint_memory then hint = 1 end
  if not changed and factor < 1 and now - last_decrease >= cooldown then
    local since = math.max(last_increase, last_decrease)
    local rate = alpha
    if factor >= 0.9 * hint then rate = alpha / 10 end
    local grown = rate * (now - since) / 1000
    if grown > 0 then
      factor = math.min(1, factor + grown)
      last_increase = now
      changed = true
    end
  end
elseif event == 'recompute' then
  changed = true
end

if changed then
  redis.call('HSET', KEYS[3], 'factor', tostring(factor), 'last_decrease_ms', tostring(last_decrease),
             'last_increase_ms', tostring(last_increase), 'hint', tostring(hint))
  -- Shed in order: the effective pool rate covers interactive reservations
  -- first, then batch, then scheduled.
  local pool_rate = tonumber(redis.call('HGET', KEYS[1], 'P.tok.rate'))
  if pool_rate ~= nil then
    -- While the provider states its limits (provider_limits.lua), its
    -- limit over the configured one is the pool's factor (as in admit.lua).
    local pool_factor = factor
    if cap['prov_factor'] and now < (cap['prov_until_ms'] or 0) then pool_factor = cap['prov_factor'] end
    local remaining = pool_rate * pool_factor
    local wids = redis.call('SMEMBERS', KEYS[2])
    local by_prio = {}
    for _, w in ipairs(wids) do
      local prio = tonumber(redis.call('HGET', KEYS[1], w .. '.prio')) or 0
      local q = tonumber(redis.call('HGET', KEYS[1], w .. '.Q.tok.rate')) or 0
      by_prio[#by_prio + 1] = {prio, q, w}
    end
    table.sort(by_prio, function(a, b) return a[1] < b[1] end)
    local writes = {}
    local shed_moved = false
    for _, item in ipairs(by_prio) do
      local shed = 1
      if item[2] > 0 then
        shed = math.max(0, math.min(1, remaining / item[2]))
        remaining = math.max(0, remaining - item[2])
      end
      writes[#writes + 1] = item[3] .. '.shed'
      writes[#writes + 1] = tostring(shed)
      if (cap[item[3] .. '.shed'] or 1) ~= tonumber(tostring(shed)) then shed_moved = true end
    end
    if #writes > 0 then redis.call('HSET', KEYS[3], unpack(writes)) end
    if shed_moved then redis.call('DEL', KEYS[4], KEYS[5]) end
  end
end
return {tostring(factor), changed and 1 or 0}
