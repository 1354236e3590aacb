-- Held work (gateway/core/protection/held.py): release what the provider has room for.
--
-- Requests admitted while the pool's circuit was not closed, and clients'
-- retries of them (budgets/admission/admit.lua), wait here instead of on their lane, and go
-- earliest queue deadline first: the provider's spare room saves most
-- callers when it goes to the attempt that would be lost next (a later one
-- can still wait; its client may not retry again). Measured against
-- latest-first in bench scenario 4 (one run each): 0.43x direct's failed
-- operations against 0.61x, both recovering with the provider.
-- Once the circuit is closed they go out only into what the provider's
-- window holds beyond the work that keeps arriving. Released all at once,
-- they would fill the window the moment the provider is back (its window is
-- empty after an outage, so its stated room is all of it), and the work
-- arriving after the outage would meet a full window for a minute.
-- Each release takes its call's room here, as budgets/admission/provider_take.lua does when
-- a call goes out, so releases in one step never count the same room twice;
-- the worker sends it with this take's mark and takes nothing again.
-- While the circuit is open, one held request is released (untaken) as the
-- circuit's half-open trial when the circuit is due one, since held work is
-- in no worker to ask for it.
--
-- KEYS: 1 held zset (member 'request_id|lane|tokens', score its queue
--       deadline, ms), 2 capacity hash, 3 circuit hash (gateway/core/protection/circuit.lua)
-- ARGV: 1 most to release, 2 how long a released trial stands before
--       another may be released (ms), 3 the time over which budgets/admission/admit.lua
--       averages the fresh arrivals' rate, and the held pace's depth (ms)
-- Returns {left, member, mark, member, mark, ...}: how many are still held,
-- then each released member with its mark 'sent sent_tok now_ms' ('' for a
-- trial, which takes its room itself). Entries past their deadline are
-- dropped: their caller was answered queue_timeout and refunded
-- (gateway/web/dispatch.py) or, for a job, its worker finds it expired.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {0}

local c = redis.call('HMGET', KEYS[3], 'state', 'open_until_ms', 'trial_until_ms', 'held_trial_until_ms')
if (c[1] or 'closed') ~= 'closed' then
  local due = math.max(tonumber(c[2]) or 0, tonumber(c[3]) or 0, tonumber(c[4]) or 0)
  if now >= due then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0)
    if #first > 0 then
      redis.call('ZREM', KEYS[1], first[1])
      redis.call('HSET', KEYS[3], 'held_trial_until_ms', tostring(now + tonumber(ARGV[2])))
      out[#out + 1] = first[1]; out[#out + 1] = ''
    end
  end
  out[1] = redis.call('ZCARD', KEYS[1])
  return out
end

local f = redis.call('HMGET', KEYS[2], 'prov_rem_tok', 'prov_reset_tok_ms', 'prov_limit_tok',
                     'prov_rem_req', 'prov_reset_req_ms', 'prov_limit_req',
                     'fresh_t', 'fresh_rt', 'fresh_r', 'held_tok_l', 'held_req_l', 'held_t',
                     'prov_sent', 'prov_sent_tok')
local held_t = tonumber(f[12]) or now
local tau = tonumber(ARGV[3])
local fresh_decay = math.exp(-math.max(0, now - (tonumber(f[7]) or now)) / tau)

-- One dimension (tokens, requests): the provider's room now (as
-- budgets/admission/provider_take.lua reckons it), what of it stays for fresh work, and the
-- held pace. The room alone is not enough: at the provider's return its
-- window is empty, and what is released now stays in it for a minute while
-- new work keeps arriving. So held work also takes a bucket refilling at the
-- provider's limit less the rate of fresh arrivals (budgets/admission/admit.lua averages it
-- over ARGV[3] ms), holding ARGV[3] ms of that; and it leaves in the room
-- what fresh work needs over the next ARGV[3] ms, for its bursts.
local function dim(rem, reset_at, limit, fresh_rate, level)
  local room = tonumber(rem)
  if room == nil then return nil end
  reset_at, limit = tonumber(reset_at) or 0, tonumber(limit) or 0
  if now > reset_at and limit > 0 then room = math.min(limit, room + (now - reset_at) * limit / 60000) end
  local arriving = (tonumber(fresh_rate) or 0) * fresh_decay
  local d = {room = room, keep = arriving * tau}
  if limit > 0 then
    d.rate = limit / 60000 - arriving
    -- Under a hundredth of the limit spare is none (not a call now and then).
    if d.rate < limit / 6000000 then d.rate = 0 end
    d.cap = d.rate * tau
    local l = tonumber(level)
    if l == nil then l = d.cap else l = math.min(d.cap, l + (now - held_t) * d.rate) end
    d.level = l
  end
  return d
end
local tok = dim(f[1], f[2], f[3], f[8], f[10])
local req = dim(f[4], f[5], f[6], f[9], f[11])
local function fits(d, k)
  if d == nil then return true end
  if d.room - k < d.keep then return false end
  -- A call larger than the whole pace bucket goes once the bucket is full.
  return d.level == nil or d.level >= math.min(k, d.cap) and d.cap > 0
end
local function take(d, k)
  if d == nil then return end
  d.room = d.room - k
  if d.level ~= nil then d.level = d.level - k end
end

local sent, sent_tok = tonumber(f[13]) or 0, tonumber(f[14]) or 0
local taken, taken_tok = 0, 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  local k = tonumber(string.match(member, '|(%d+)$')) or 0
  if not (fits(req, 1) and fits(tok, k)) then break end
  take(req, 1); take(tok, k)
  taken, taken_tok = taken + 1, taken_tok + k
  redis.call('ZREM', KEYS[1], member)
  out[#out + 1] = member
  out[#out + 1] = (sent + taken) .. ' ' .. (sent_tok + taken_tok) .. ' ' .. string.format('%.3f', now)
end
local writes = {'held_t', tostring(now)}
if tok and tok.level then writes[#writes + 1] = 'held_tok_l'; writes[#writes + 1] = tostring(tok.level) end
if req and req.level then writes[#writes + 1] = 'held_req_l'; writes[#writes + 1] = tostring(req.level) end
if tok or req then redis.call('HSET', KEYS[2], unpack(writes)) end
if taken > 0 then
  if f[1] then redis.call('HINCRBYFLOAT', KEYS[2], 'prov_rem_tok', -taken_tok) end
  if f[4] then redis.call('HINCRBYFLOAT', KEYS[2], 'prov_rem_req', -taken) end
  redis.call('HINCRBY', KEYS[2], 'prov_sent', taken)
  redis.call('HINCRBY', KEYS[2], 'prov_sent_tok', taken_tok)
end
out[1] = redis.call('ZCARD', KEYS[1])
return out
