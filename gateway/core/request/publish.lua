-- Hand a request's outcome to the waiting web process, once: a replayed
-- settlement (redelivered task) must not push a second copy.
-- KEYS: 1 result list, 2 published marker
-- ARGV: 1 outcome json, 2 ttl (ms)
-- Returns 1 when pushed now, 0 when it had been pushed before.
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then
  redis.call('RPUSH', KEYS[1], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
