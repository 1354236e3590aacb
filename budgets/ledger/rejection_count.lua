-- Count a minute's rejections of one pool, one or many at a time (a web
-- process sends what it noted in one tick), and keep the first few of each
-- workload and reason as detailed samples.
--
-- KEYS: 1 the minute's counts hash (fields "<wid>|<tid>|<reason>" and "_n",
--         the minute's total, which the flush uses to see late arrivals)
--       2 the minute's samples list
--       3 the pool's sorted set of minutes not yet flushed (score = member =
--         minute epoch seconds)
-- ARGV: 1 minute epoch seconds, 2 samples kept per minute per field,
--       3 ttl seconds, then for each field: the field, its count, how many
--       samples follow (m), m samples (JSON), in the order they happened
-- Returns the minute's total ("_n") after this call.
local limit = tonumber(ARGV[2])
local added = 0
local sampled = false
local i = 4
while i <= #ARGV do
  local count = tonumber(ARGV[i + 1])
  local offered = tonumber(ARGV[i + 2])
  local n = redis.call('HINCRBY', KEYS[1], ARGV[i], count)
  added = added + count
  -- The field's rejections before this call took the first sample places;
  -- these samples fill what is left of them, oldest first.
  local room = math.min(offered, limit - (n - count))
  for j = 1, room do
    redis.call('RPUSH', KEYS[2], ARGV[i + 2 + j])
    sampled = true
  end
  i = i + 3 + offered
end
local total = redis.call('HINCRBY', KEYS[1], '_n', added)
redis.call('EXPIRE', KEYS[1], ARGV[3])
-- A late arrival for a minute already flushed puts it back on the list, so the
-- next flush rewrites that minute's full count (the hash still holds it).
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[1])
redis.call('EXPIRE', KEYS[3], ARGV[3])
if sampled then
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return total
