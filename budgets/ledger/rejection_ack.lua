-- After a flush wrote a minute to the database, take the minute off the
-- pending list, unless a rejection arrived meanwhile (its total moved): then
-- the minute stays pending and the next flush writes the new total.
--
-- KEYS: 1 the minute's counts hash, 2 the pool's pending-minutes sorted set
-- ARGV: 1 minute epoch seconds, 2 the total ("_n") the flush wrote
-- Returns 1 when the minute left the pending list, 0 when it stays.
local n = redis.call('HGET', KEYS[1], '_n') or '0'
if n == ARGV[2] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
