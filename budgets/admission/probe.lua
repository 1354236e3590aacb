-- Record one probe of a pool (gateway/worker/prober.py) and decide whether
-- the pool admits work. A pool that failed ARGV[5] probes in a row is marked
-- down in its capacity hash, the one admit.lua reads anyway (no extra round
-- trip on the request path): it admits nothing until a probe succeeds. The
-- mark carries its own end (down_until_ms, refreshed by every failed probe),
-- so a prober that stops cannot keep a pool shut: admission fails open.
--
-- KEYS: 1 probe hash (last probe: at_ms, ok, detail, latency_ms, failures),
--       2 capacity hash (down_until_ms, probe_next_ms)
-- ARGV: 1 ok (1 answered, 0 did not), 2 detail (text), 3 latency (ms),
--       4 probe interval (ms), 5 failures in a row that mark the pool down,
--       6 how long a down mark lasts without a new failed probe (ms)
-- Returns {failures in a row, down_until_ms (0: up), now_ms}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ok = ARGV[1] == '1'

local failures = 0
if not ok then failures = redis.call('HINCRBY', KEYS[1], 'failures', 1) end
redis.call('HSET', KEYS[1], 'at_ms', tostring(now), 'ok', ok and 1 or 0, 'detail', ARGV[2],
           'latency_ms', ARGV[3], 'failures', failures)

if ok then
  redis.call('HDEL', KEYS[2], 'down_until_ms', 'probe_next_ms')
  return {0, '0', tostring(now)}
end
if failures >= tonumber(ARGV[5]) then
  local down_until = now + tonumber(ARGV[6])
  redis.call('HSET', KEYS[2], 'down_until_ms', tostring(down_until),
             'probe_next_ms', tostring(now + tonumber(ARGV[4])))
  return {failures, tostring(down_until), tostring(now)}
end
return {failures, '0', tostring(now)}
