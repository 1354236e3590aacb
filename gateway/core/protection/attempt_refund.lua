-- Give back an attempt taken by attempt_take.lua (the sign-in or key was
-- good). Never creates a counter and never goes below zero, so a refund
-- after the window expired is a no-op.
--
-- KEYS: 1 counter
-- ARGV: none
-- Returns the count after the refund.
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count <= 0 then return 0 end
return redis.call('DECR', KEYS[1])
