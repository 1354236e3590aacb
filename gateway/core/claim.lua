-- Who owns a queued request's outcome, decided once, on Redis's clock.
-- The web side calls with role 'gaveup' when it stops waiting; the worker
-- calls with role 'worker' at dequeue. Exactly one of them wins.
--
-- KEYS: 1 owner key
-- ARGV: 1 role ('worker' | 'gaveup'), 2 queue deadline (ms since epoch),
--       3 ttl (ms)
-- Returns the owner after the call: 'worker' (worker may call the pool),
-- 'redelivered' (a worker had started it before: its worker died),
-- 'expired' (the worker found the deadline passed and owns the refund),
-- 'gaveup' (the web side gave up and owns the refund).
if redis.replicate_commands then pcall(redis.replicate_commands) end
local owner = redis.call('GET', KEYS[1])
if owner == 'worker' and ARGV[1] == 'worker' then return 'redelivered' end
if owner then return owner end
local role = ARGV[1]
if role == 'worker' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  if now > tonumber(ARGV[2]) then role = 'expired' end
end
redis.call('SET', KEYS[1], role, 'PX', ARGV[3])
return role
