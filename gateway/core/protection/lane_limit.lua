-- The adaptive concurrency limit of a pool's long lanes (interactive-long,
-- batch): AIMD, as Netflix's concurrency-limits AIMDLimit and TCP Reno, with
-- the level of the last congestion remembered (as CUBIC's W_max).
--
-- Why AIMD and not Vegas or gradient: those compare the limited requests'
-- own round-trip time with their minimum, but a long request's time is
-- mostly its own decoding (it grows with max_tokens, not with queueing), and
-- without streaming the gateway never sees its time to first token. What
-- long requests do to the pool shows in the SHORT requests' latency per
-- token against its idle baseline, a binary "congested or not" signal that
-- AIMD is built for, and AIMD converges from any starting limit.
--
-- Signal: latency per output token of short (interactive) calls. ``base`` is
-- its idle baseline: the lowest seen, drifting up by ARGV[12] per sample so a
-- pool that got slower for good is relearned; ``fast`` an EWMA (weight
-- ARGV[13]) of fresh samples. Congested when fast > ARGV[8] x base.
--   * a short sample of a call admitted before the last decrease describes
--     the limit before it: it moves the baseline but never decreases again;
--   * congestion (after ARGV[11] samples) or an upstream 429: every limited
--     lane's limit becomes min(limit - 1, limit x ARGV[9]), never below
--     ARGV[6]; one decrease per ARGV[10] ms; the number of slots the limit
--     allowed before it (its whole part) is remembered (``hint``) for
--     ARGV[14] ms after the last decrease, the highest such level while the
--     memory lasts;
--   * a long lane's successful call that finds the lane's slots all in use
--     (and no congestion): that lane's limit grows by 1/limit (one slot per
--     limit's worth of calls), up to ARGV[7], and, while a congestion level
--     is remembered, only up to just below it (the level that hurt is not
--     probed again until the memory fades).
--
-- Durations (ARGV[15], the call's time in the pool, ms): each successful
-- short call moves ``short_ms`` and each successful long call its lane's
-- ``<lane>.call_ms``, EWMAs with weight DURATION_WEIGHT. slot_acquire.lua
-- spaces long calls' starts by them (its header says why).
--
-- KEYS: 1 lane-limits hash
-- ARGV: 1 event ('short' | 'long' | 'throttle'), 2 latency per token (ms,
--       'short') or lane ('long'), 3 the call's admission time (ms, Redis
--       clock, 'short') or slots in use when it ended (this one included,
--       'long'), 4 limited lanes (comma-separated), 5 initial limit, 6 min,
--       7 max, 8 congestion ratio, 9 decrease factor, 10 decrease cooldown
--       (ms), 11 samples before the baseline counts, 12 baseline drift per
--       sample, 13 EWMA weight, 14 congestion memory (ms), 15 the call's
--       duration (ms, 'short' and 'long'; 0 or absent: not known)
-- Returns {'decreased' | 'increased' | 'held', limit of each limited lane
--          (as text, in ARGV[4]'s order)...}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local event = ARGV[1]
local lanes = {}
for lane in string.gmatch(ARGV[4], '[^,]+') do lanes[#lanes + 1] = lane end
local initial, min_limit, max_limit = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local ratio, beta, cooldown = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local warmup, drift, weight, memory = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local duration = tonumber(ARGV[15] or '') or 0
-- A typical duration, not the latest one: one slow call moves it a tenth.
local DURATION_WEIGHT = 0.1

local st = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do st[flat[i]] = flat[i + 1] end
local function num(name, default) return tonumber(st[name]) or default end

local base, fast, samples = num('base', nil), num('fast', nil), num('samples', 0)
local last_decrease = num('last_decrease_ms', 0)
local writes = {}
local verdict = 'held'

local function track_duration(name)
  if duration <= 0 then return end
  local old = num(name, nil)
  local new = old == nil and duration or old + DURATION_WEIGHT * (duration - old)
  writes[#writes + 1] = name; writes[#writes + 1] = tostring(new)
end

local function congested()
  return samples >= warmup and base ~= nil and fast ~= nil and fast > ratio * base
end

local function decrease(why)
  if now - last_decrease < cooldown then return end
  local remembered = now - last_decrease < memory
  for _, lane in ipairs(lanes) do
    local limit = num(lane .. '.limit', initial)
    local lowered = math.max(min_limit, math.min(limit - 1, math.floor(limit * beta)))
    -- The level that hurt is the number of slots the limit allowed (its
    -- whole part: slot_acquire.lua grants floor(limit)), not the fraction
    -- it had grown to: a limit of 4.25 that congests the pool is 4 slots,
    -- and regrowing to 4.249 would run 4 slots again. While a higher level
    -- is still remembered it stays the ceiling, so a decrease below it
    -- (noise, or the tail of the congestion just acted on) does not ratchet
    -- the ceiling down one level per decrease.
    local level = math.max(1, math.floor(limit))
    local hint = remembered and num(lane .. '.hint', nil) or nil
    if hint == nil or level > hint then hint = level end
    writes[#writes + 1] = lane .. '.limit'; writes[#writes + 1] = tostring(lowered)
    writes[#writes + 1] = lane .. '.hint'; writes[#writes + 1] = tostring(hint)
    st[lane .. '.limit'] = tostring(lowered)
  end
  writes[#writes + 1] = 'last_decrease_ms'; writes[#writes + 1] = tostring(now)
  writes[#writes + 1] = 'last_decrease_why'; writes[#writes + 1] = why
  redis.call('HINCRBY', KEYS[1], 'decreases', 1)
  verdict = 'decreased'
end

if event == 'short' then
  local x = tonumber(ARGV[2])
  local admitted = tonumber(ARGV[3]) or now
  if x ~= nil and x > 0 then
    samples = samples + 1
    if base == nil or x < base * (1 + drift) then base = x else base = base * (1 + drift) end
    local fresh = admitted >= last_decrease
    if fresh then
      if fast == nil then fast = x else fast = fast + weight * (x - fast) end
    end
    writes[#writes + 1] = 'base'; writes[#writes + 1] = tostring(base)
    writes[#writes + 1] = 'samples'; writes[#writes + 1] = tostring(samples)
    track_duration('short_ms')
    if fresh and congested() then
      decrease('short latency ' .. string.format('%.2f', fast / base) .. 'x its idle baseline')
    end
    if verdict == 'decreased' then
      -- The congestion just acted on is not counted twice: the EWMA
      -- restarts from the next fresh sample.
      redis.call('HDEL', KEYS[1], 'fast')
    elseif fast ~= nil then
      writes[#writes + 1] = 'fast'; writes[#writes + 1] = tostring(fast)
    end
  end
elseif event == 'throttle' then
  decrease('the pool answered 429')
elseif event == 'long' then
  local lane = ARGV[2]
  local limit = num(lane .. '.limit', initial)
  local in_use = tonumber(ARGV[3]) or 0
  track_duration(lane .. '.call_ms')
  if in_use >= math.floor(limit) and not congested() then
    local ceiling = max_limit
    local hint = num(lane .. '.hint', nil)
    if hint ~= nil and now - last_decrease < memory then ceiling = math.min(ceiling, hint - 0.001) end
    local grown = math.min(ceiling, limit + 1 / math.max(1, limit))
    if grown > limit then
      writes[#writes + 1] = lane .. '.limit'; writes[#writes + 1] = tostring(grown)
      st[lane .. '.limit'] = tostring(grown)
      verdict = 'increased'
    end
  end
end

if #writes > 0 then redis.call('HSET', KEYS[1], unpack(writes)) end
local out = {verdict}
for _, lane in ipairs(lanes) do out[#out + 1] = tostring(num(lane .. '.limit', initial)) end
return out
