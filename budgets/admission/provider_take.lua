-- A worker about to call the pool takes its call's share of what the
-- provider said remains (provider_limits.lua), or learns how long to wait.
-- The room is the one admit.lua checks: what the provider's last answer said
-- remains, less what workers took since, refilling at the provider's stated
-- per-minute limit once its reset has passed. Taken here, at the moment of
-- sending, and not at admission: a request admitted earlier may have waited
-- in its lane, and waiters released together at a reset would otherwise all
-- go at once into a window with room for one.
--
-- KEYS: 1 capacity hash
-- ARGV: 1 tokens of the call (its estimate), 2 sheddable (1: a loan or a
--       batch/scheduled call, which leaves the last prov_reserve of the
--       provider's limit to protected work, as in admit.lua)
-- Every call that goes counts in prov_sent / prov_sent_tok (calls and tokens
-- sent so far, whether or not the provider states anything): its answer's
-- headers describe the provider's window as the call arrived, so
-- provider_limits.lua orders statements by this count and takes off what
-- was sent after the call (a call's answer may come seconds after it went).
-- Returns text: 'go <sent> <sent_tok> <now_ms>' taken (or the provider
-- states nothing), the counts after this call's own; otherwise the wait in
-- ms until the room is there (the reset, or the refill)
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local k_tok = tonumber(ARGV[1])

local f = redis.call('HMGET', KEYS[1], 'prov_rem_tok', 'prov_reset_tok_ms', 'prov_limit_tok',
                     'prov_rem_req', 'prov_reset_req_ms', 'prov_limit_req', 'prov_reserve')
local reserve = (ARGV[2] == '1') and (tonumber(f[7]) or 0) or 0
local dims = {{'tok', f[1], f[2], f[3], k_tok}, {'req', f[4], f[5], f[6], 1}}
local wait = 0
for _, d in ipairs(dims) do
  local room, reset_at, limit, k = tonumber(d[2]), tonumber(d[3]) or 0, tonumber(d[4]) or 0, d[5]
  k = k + reserve * limit
  if room ~= nil then
    if now > reset_at and limit > 0 then room = math.min(limit, room + (now - reset_at) * limit / 60000) end
    if room < k and (limit == 0 or k <= limit) then
      local w = reset_at - now
      if w <= 0 then w = (limit > 0) and (k - room) * 60000 / limit or 1000 end
      if w > wait then wait = w end
    end
  end
end
if wait > 0 then return tostring(wait) end
if f[1] then redis.call('HINCRBYFLOAT', KEYS[1], 'prov_rem_tok', -k_tok) end
if f[4] then redis.call('HINCRBYFLOAT', KEYS[1], 'prov_rem_req', -1) end
local sent = redis.call('HINCRBY', KEYS[1], 'prov_sent', 1)
local sent_tok = redis.call('HINCRBY', KEYS[1], 'prov_sent_tok', k_tok)
return 'go ' .. sent .. ' ' .. sent_tok .. ' ' .. string.format('%.3f', now)
