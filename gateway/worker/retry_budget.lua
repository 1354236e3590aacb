-- Retry budgets that cannot amplify an outage.
--   pool: a token bucket of retries, earning `ratio` of a token per first
--         attempt and capped at `burst`; a retry spends one token, so retries
--         stay under ~ratio of requests however long the outage lasts.
--   session: at most `session_budget` retries per client session (X-Session-Id)
--         within `session_ttl`, so a multi-step agent chain cannot multiply.
--   move: a fail-over to another pool of the route (gateway/worker/failover.py)
--         adds no call to the failing pool, so it needs no pool token (it
--         takes one when there is one, and is counted as 'moved'); it counts
--         against the session's budget like any retry. A request moves at
--         most once, and admission skips a pool whose circuit is open.
-- KEYS: 1 pool retry hash, 2 session counter (KEYS[1] again when no session:
--       no empty key names, every key in the pool's hash slot)
-- ARGV: 1 op ('earn' | 'spend' | 'move'), 2 ratio, 3 burst, 4 session budget,
--       5 session ttl (ms)
-- Returns 'ok', or why a retry is refused: 'pool_retry_budget' | 'session_retry_budget'
local op = ARGV[1]
local ratio, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
if op == 'earn' then
  local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens')) or 0
  tokens = math.min(burst, tokens + ratio)
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens))
  redis.call('HINCRBY', KEYS[1], 'first_attempts', 1)
  return 'ok'
end
local has_session = KEYS[2] ~= KEYS[1]
if has_session then
  local used = tonumber(redis.call('GET', KEYS[2])) or 0
  if used >= tonumber(ARGV[4]) then
    redis.call('HINCRBY', KEYS[1], 'refused_session', 1)
    return 'session_retry_budget'
  end
end
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens')) or 0
if op == 'move' then
  redis.call('HSET', KEYS[1], 'tokens', tostring(math.max(0, tokens - 1)))
  redis.call('HINCRBY', KEYS[1], 'moved', 1)
elseif tokens < 1 then
  redis.call('HINCRBY', KEYS[1], 'refused_pool', 1)
  return 'pool_retry_budget'
else
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1))
  redis.call('HINCRBY', KEYS[1], 'retries', 1)
end
if has_session then
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return 'ok'
