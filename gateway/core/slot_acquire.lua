-- Take one of a lane's pool-call slots on a pool: a counting semaphore whose
-- size is the lane's adaptive concurrency limit (lane_limit.lua moves it).
-- Every slot is a lease: a worker that dies mid-call never releases its
-- slot, so a slot whose lease ended is taken back here, before counting.
--
-- KEYS: 1 slots zset (request id -> lease end, ms), 2 lane-limits hash
-- ARGV: 1 holder (request id), 2 lease (ms), 3 lane, 4 initial limit (a
--       lane whose limit was never set starts here)
-- Returns {1 taken | 0 full, slots held now (this one included when taken),
--          the limit in force, now_ms}
-- A holder that already holds a slot (a retried attempt, a redelivery) gets
-- it back with a fresh lease: one request never holds two.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(redis.call('HGET', KEYS[2], ARGV[3] .. '.limit')) or tonumber(ARGV[4])
local whole = math.max(1, math.floor(limit))
local until_ms = now + tonumber(ARGV[2])

if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
  return {1, redis.call('ZCARD', KEYS[1]), tostring(limit), tostring(now)}
end
local held = redis.call('ZCARD', KEYS[1])
if held >= whole then return {0, held, tostring(limit), tostring(now)} end
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 60000)
return {1, held + 1, tostring(limit), tostring(now)}
