-- Count one rejection in its minute and keep it as a detailed sample while
-- fewer than the limit were kept this minute for its workload and reason.
--
-- KEYS: 1 the minute's counts hash (fields "<wid>|<reason>" and "_n", the
--         minute's total, which the flush uses to see late arrivals)
--       2 the minute's samples list
--       3 the pool's sorted set of minutes not yet flushed (score = member =
--         minute epoch seconds)
-- ARGV: 1 field "<wid>|<reason>", 2 minute epoch seconds, 3 samples kept per
--       minute per field, 4 ttl seconds, 5 the sample (JSON)
-- Returns the field's count in this minute.
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HINCRBY', KEYS[1], '_n', 1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
-- A late arrival for a minute already flushed puts it back on the list, so the
-- next flush rewrites that minute's full count (the hash still holds it).
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[4])
if n <= tonumber(ARGV[3]) then
  redis.call('RPUSH', KEYS[2], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return n
