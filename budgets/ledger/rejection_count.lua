-- Count a minute's rejections of one pool, one or many at a time (a web
-- process sends what it noted in one tick), keep the first few of each
-- workload and reason as detailed samples, and file every refusal that has a
-- request id under that id, so a caller's report finds it for 24 hours.
--
-- KEYS: 1 the minute's counts hash (fields "<wid>|<tid>|<reason>" and "_n",
--         the minute's total, which the flush uses to see late arrivals)
--       2 the minute's samples list
--       3 the pool's sorted set of minutes not yet flushed (score = member =
--         minute epoch seconds)
--       4 the hour's refusals by request id (hash: request id -> JSON)
-- ARGV: 1 minute epoch seconds, 2 samples kept per minute per field,
--       3 ttl seconds of the minute's keys, 4 epoch seconds at which the
--       hour's hash expires (its hour's start + 25 h), 5 the most refusals the
--       hour's hash holds, then for each field: the field, its count, how
--       many refusals follow (m), m pairs (request id or "", JSON), in the
--       order they happened
-- Returns the minute's total ("_n") after this call.
--
-- The count is exact whatever happens; the samples are the first few; the
-- by-id hash is capped (ARGV 5) so a storm of refusals cannot fill Redis's
-- memory: a refusal past the cap is counted but not findable by its id.
local limit = tonumber(ARGV[2])
local by_id_cap = tonumber(ARGV[5])
local added = 0
local sampled = false
local filed = false
local i = 6
while i <= #ARGV do
  local count = tonumber(ARGV[i + 1])
  local offered = tonumber(ARGV[i + 2])
  local n = redis.call('HINCRBY', KEYS[1], ARGV[i], count)
  added = added + count
  -- The field's rejections before this call took the first sample places;
  -- these samples fill what is left of them, oldest first.
  local room = math.min(offered, limit - (n - count))
  for j = 1, offered do
    local request_id = ARGV[i + 1 + 2 * j]
    local details = ARGV[i + 2 + 2 * j]
    if j <= room then
      redis.call('RPUSH', KEYS[2], details)
      sampled = true
    end
    if request_id ~= '' and redis.call('HLEN', KEYS[4]) < by_id_cap then
      redis.call('HSET', KEYS[4], request_id, details)
      filed = true
    end
  end
  i = i + 3 + 2 * offered
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
if filed then
  redis.call('EXPIREAT', KEYS[4], ARGV[4])
end
return total
