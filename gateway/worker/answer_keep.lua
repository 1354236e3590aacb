-- Store the pool's answer to a request (gateway/worker/execution.py
-- _answer_keep, _answer_keep_settled): once, unless it replaces the answer a
-- stream's first chunk stored. A script, not a plain SET, so it can go in the
-- same round trip as what the answer tells the lane limits and the circuit,
-- and the settlement on it (a RoundTrip).
--
-- KEYS: 1 the request's stored answer
-- ARGV: 1 the answer (JSON), 2 ttl (ms), 3 '1': only if none is stored yet
-- Returns {1} when this answer is the one stored, {0} when another was first
-- (a table: the settlement's steps after it are guarded on its first element).
if ARGV[3] == '1' then
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1} end
  return {0}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1}
