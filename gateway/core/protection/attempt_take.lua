-- Take one attempt from a fixed-window failure budget (sign-ins per user or
-- per address, unknown API keys per address), or say how long until the
-- window ends. Taken before the password or key is checked, so concurrent
-- guesses cannot all pass a read-then-count check: with a limit of N, at
-- most N attempts are ever in flight or failed in one window. A success
-- gives its attempt back (attempt_refund.lua).
--
-- KEYS: 1 counter (a string; expires with its window)
-- ARGV: 1 limit (attempts per window; 0 turns the throttle off), 2 window (ms)
-- Returns {1, 0} when taken; {0, ms until the window ends} when the budget
-- is spent.
local limit = tonumber(ARGV[1])
if limit <= 0 then return {1, 0} end
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count >= limit then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl < 0 then
    -- A counter without an expiry would block forever: give it its window.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    ttl = tonumber(ARGV[2])
  end
  return {0, ttl}
end
redis.call('INCR', KEYS[1])
if redis.call('PTTL', KEYS[1]) < 0 then
  -- The window starts with its first attempt.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {1, 0}
