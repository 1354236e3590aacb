-- A pool's circuit breaker, fed by the workers' own calls:
-- closed -> open -> half-open -> closed.
--
--   closed: every call goes. ARGV[4] failures in a row (5xx, no answer)
--           open it.
--   open: no call goes until open_until_ms (the caller waits, bounded by its
--         own deadline, gateway/worker/lane_slot.py); then it is half-open.
--   half-open: exactly one call at a time goes, as the trial (its lease ends
--         after ARGV[6] ms, so a trial whose worker died does not block the
--         pool); the trial's success closes the circuit at once, so the
--         whole backlog goes as soon as the provider accepts again (no
--         additive climb from a floor); its failure opens it again, for
--         twice as long as the last time, ARGV[7] at most (ARGV[7] no more
--         than ARGV[5]: always the same): through a long outage the trials,
--         each a failed call, may thin out; the first close resets it.
--
-- KEYS: 1 circuit hash (state, failures, open_until_ms, trial_until_ms,
--       trial_holder, opened, last_change_ms, why), 2 the pool's capacity
--       hash: its 'hold' field is set while the circuit is not closed, so
--       admission (budgets/admission/admit.lua) holds new work outside the
--       lanes (gateway/core/protection/held.py) instead of queueing it in front of the
--       work that arrives after the provider is back
-- ARGV: 1 event ('gate' | 'ok' | 'fail'), 2 holder (request id),
--       3 what happened (text, 'fail'), 4 failures in a row that open it,
--       5 how long it stays open before a trial (ms), 6 a trial's lease (ms),
--       7 the longest it stays open after failed trials (ms)
-- Returns {'go' | 'wait', wait ms (text), state after}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local event, holder = ARGV[1], ARGV[2]
local threshold, open_ms, trial_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local c = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do c[flat[i]] = flat[i + 1] end
local state = c['state'] or 'closed'
local open_until = tonumber(c['open_until_ms']) or 0
local trial_until = tonumber(c['trial_until_ms']) or 0

local function open(why, reopens)
  local for_ms = math.min(open_ms * 2 ^ reopens, math.max(open_ms, tonumber(ARGV[7]) or open_ms))
  redis.call('HSET', KEYS[1], 'state', 'open', 'open_until_ms', tostring(now + for_ms), 'trial_until_ms', '0',
             'trial_holder', '', 'last_change_ms', tostring(now), 'why', why, 'reopens', tostring(reopens))
  redis.call('HINCRBY', KEYS[1], 'opened', 1)
  redis.call('HSET', KEYS[2], 'hold', '1')
  return 'open'
end

if event == 'gate' then
  if state == 'closed' then return {'go', '0', state} end
  if now < open_until then return {'wait', tostring(open_until - now), 'open'} end
  -- Half-open: one trial at a time.
  if c['trial_holder'] == holder or now >= trial_until then
    redis.call('HSET', KEYS[1], 'state', 'half-open', 'trial_holder', holder,
               'trial_until_ms', tostring(now + trial_ms))
    return {'go', '0', 'half-open'}
  end
  return {'wait', tostring(math.min(trial_until - now, open_ms)), 'half-open'}
elseif event == 'ok' then
  if state ~= 'closed' then
    redis.call('HSET', KEYS[1], 'state', 'closed', 'trial_holder', '', 'trial_until_ms', '0',
               'last_change_ms', tostring(now), 'why', 'the pool answered again', 'reopens', '0')
    redis.call('HDEL', KEYS[2], 'hold')
  end
  redis.call('HSET', KEYS[1], 'failures', '0')
  return {'go', '0', 'closed'}
elseif event == 'fail' then
  local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  if state == 'half-open' and c['trial_holder'] == holder then
    return {'go', '0', open('the trial call failed: ' .. ARGV[3], (tonumber(c['reopens']) or 0) + 1)}
  end
  if state == 'closed' and failures >= threshold then
    return {'go', '0', open(failures .. ' calls in a row failed, the last: ' .. ARGV[3], 0)}
  end
  return {'go', '0', state}
end
return {'go', '0', state}
