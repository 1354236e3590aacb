-- Leaky bucket for scheduled workloads: jobs leave at the workload's
-- reserved rate, one after another, never in a burst. Each job's release is
-- the later of now and the previous release plus that job's drain time.
-- KEYS: 1 pacer hash of the pool
-- ARGV: 1 workload id, 2 job cost (tokens), 3 rate (tokens per ms)
-- Returns the release time (ms since epoch, Redis clock) as text.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local next_free = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or now
local release = math.max(now, next_free)
redis.call('HSET', KEYS[1], ARGV[1], tostring(release + tonumber(ARGV[2]) / tonumber(ARGV[3])))
return tostring(release)
