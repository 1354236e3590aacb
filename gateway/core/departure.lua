-- A request's departure, counted once (gateway/core/metrics.py): off its
-- lane's in-flight set and, only when it was still there (a redelivered
-- task finishing again counts nothing), into the lane's 10 s slot counters.
-- One round trip instead of a ZREM and then a pipeline.
--
-- KEYS: 1 lane in-flight zset, 2 lane metrics hash
-- ARGV: 1 request id, 2 slot (epoch s), 3 time in system (ms), 4 upstream 429s,
--       5 output tokens relayed to the caller
-- Returns 1 when counted, 0 when an earlier finish did.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], 'd:' .. ARGV[2], 1)
redis.call('HINCRBY', KEYS[2], 'w:' .. ARGV[2], ARGV[3])
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', KEYS[2], 'u429:' .. ARGV[2], ARGV[4]) end
if tonumber(ARGV[5] or '0') > 0 then redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[2], ARGV[5]) end
return 1
