-- Take one of a lane's pool-call slots on a pool: a counting semaphore whose
-- size is the lane's adaptive concurrency limit (lane_limit.lua moves it).
-- Every slot is a lease: a worker that dies mid-call never releases its
-- slot, so a slot whose lease ended is taken back here, before counting.
--
-- Long calls' starts are also spaced. A long prompt's prefill stalls every
-- decode step of the pool's batch while it runs (vLLM's default scheduler),
-- so a short call that overlaps two prefills pays both; the short tail is
-- made of those. Long calls started close together finish close together,
-- and their successors start close together again: the clustering persists.
-- So a long call starts no sooner than ``gap`` after the pool's last long
-- start (any limited lane):
--   gap = min(a short call's typical duration,
--             this lane's typical long call / (2 x its slots))
-- The first term puts at most about one long prefill in any short call's
-- life; the second keeps the spacing at half the interval at which the
-- lane's slots turn over, so it staggers starts without starving the
-- slots. Both durations are EWMAs lane_limit.lua keeps (``short_ms``,
-- ``<lane>.call_ms``); while either is unknown (no short traffic to
-- protect, no long call finished yet) there is no gap.
--
-- Waiters are served in the order they first asked. A call that finds no
-- free slot (or the spacing not yet passed) joins the lane's waiters, scored
-- by its first ask; a freed slot goes to the waiters at the head, however
-- the polls of the others fall, so no long call waits behind ones that came
-- after it (with polls alone, the unlucky few made the long p99). A waiter
-- that stops asking (it called without a slot at its deadline, or its worker
-- died) is dropped when its expected next ask is ARGV[5] ms late.
--
-- KEYS: 1 slots zset (request id -> lease end, ms), 2 lane-limits hash,
--       3 waiters zset (request id -> first ask, ms), 4 waiters' expiry zset
--       (request id -> when it counts as gone, ms)
-- ARGV: 1 holder (request id), 2 lease (ms), 3 lane, 4 initial limit (a
--       lane whose limit was never set starts here), 5 a waiter's grace (ms)
-- Returns {1 taken | 0 full or spaced, slots held now (this one included
--          when taken), the limit in force, now_ms, ms until the spacing
--          lets a long call start (0: it does now)}
-- A holder that already holds a slot (a retried attempt, a redelivery) gets
-- it back with a fresh lease: one request never holds two.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local st = redis.call('HMGET', KEYS[2], ARGV[3] .. '.limit', 'short_ms', ARGV[3] .. '.call_ms', 'long_start_ms')
local limit = tonumber(st[1]) or tonumber(ARGV[4])
local whole = math.max(1, math.floor(limit))
local until_ms = now + tonumber(ARGV[2])

if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
  return {1, redis.call('ZCARD', KEYS[1]), tostring(limit), tostring(now), '0'}
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #gone > 0 then
  redis.call('ZREM', KEYS[3], unpack(gone))
  redis.call('ZREM', KEYS[4], unpack(gone))
end
local grace = tonumber(ARGV[5])
local function wait_in_line(held, wait)
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])
  redis.call('ZADD', KEYS[4], now + wait + grace, ARGV[1])
  local ttl = math.ceil(tonumber(ARGV[2])) + 60000
  redis.call('PEXPIRE', KEYS[3], ttl)
  redis.call('PEXPIRE', KEYS[4], ttl)
  return {0, held, tostring(limit), tostring(now), tostring(wait)}
end

local held = redis.call('ZCARD', KEYS[1])
if held >= whole then return wait_in_line(held, 0) end
local ahead = redis.call('ZRANK', KEYS[3], ARGV[1]) or redis.call('ZCARD', KEYS[3])
if ahead >= whole - held then return wait_in_line(held, 0) end

local short_ms, call_ms = tonumber(st[2]), tonumber(st[3])
local last_start = tonumber(st[4]) or 0
if short_ms and call_ms then
  local gap = math.min(short_ms, call_ms / (2 * whole))
  local wait = last_start + gap - now
  if wait > 0 then return wait_in_line(held, wait) end
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 60000)
redis.call('HSET', KEYS[2], 'long_start_ms', tostring(now))
return {1, held + 1, tostring(limit), tostring(now), '0'}
