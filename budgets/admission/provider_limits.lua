-- What the provider says about its own limits, from the x-ratelimit-*
-- headers of one of its answers (budgets/admission/provider_limits.py parses
-- them), kept in the pool's capacity hash, which admit.lua reads anyway.
--
-- Fields written (prov_*): limit_req/limit_tok (the provider's limits now),
-- rem_req/rem_tok (what remained when it answered; admit.lua subtracts what
-- it admits after), reset_req_ms/reset_tok_ms (absolute, Redis clock: when
-- the provider has room again), at_ms, and prov_factor with prov_until_ms:
-- the provider's current limit over the one the pool was configured with
-- (cfg P.provider_tpm / P.provider_rpm; the smaller of the two, at most 1).
-- Until prov_until_ms the pool's admission rate follows prov_factor instead
-- of the factor capacity.lua infers from 429s and latency: a provider that
-- states its limits is believed. The mark lapses by itself when answers stop
-- carrying headers.
--
-- KEYS: 1 capacity hash, 2 cfg hash
-- ARGV: 1 limit requests, 2 limit tokens, 3 remaining requests,
--       4 remaining tokens, 5 reset requests (ms from now), 6 reset tokens
--       (ms from now): '' where the answer did not say; 7 how long the
--       factor holds without a new answer (ms), 8 the share of the
--       provider's limit that loans and sheddable work leave to protected
--       work (prov_reserve; admit.lua, provider_take.lua); 9-11 the call's
--       mark from provider_take.lua (calls and tokens sent up to and with
--       it, and when it went, Redis clock; '' unknown: it went untaken)
-- A provider states its window as the call arrived, and the answer comes
-- when the call is done, seconds later for a long one: meanwhile later
-- calls went, and their answers may already be kept. So a statement whose
-- call went before the one of the statement kept is older news and changes
-- nothing (a long call started before a brownout would otherwise bring the
-- old limit back), and what remains is the stated room less what was sent
-- after the call; its resets count from when the call went.
-- Returns {factor changed by more than 1% (1/0), prov_factor as text ('' none), now_ms}
if redis.replicate_commands then pcall(redis.replicate_commands) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local limit_req, limit_tok = tonumber(ARGV[1]), tonumber(ARGV[2])
local rem_req, rem_tok = tonumber(ARGV[3]), tonumber(ARGV[4])
local reset_req, reset_tok = tonumber(ARGV[5]), tonumber(ARGV[6])
local mark, mark_tok, stated_at = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local writes = {'prov_at_ms', tostring(now), 'prov_reserve', ARGV[8]}
local function put(field, value) writes[#writes + 1] = field; writes[#writes + 1] = tostring(value) end

local at = now
if mark and mark_tok and stated_at then
  local seen = redis.call('HMGET', KEYS[1], 'prov_obs', 'prov_sent', 'prov_sent_tok')
  local sent, sent_tok = tonumber(seen[2]) or 0, tonumber(seen[3]) or 0
  if mark <= sent then  -- (a mark above the count: the hash was reset since the call went)
    if mark < (tonumber(seen[1]) or 0) then return {0, '', tostring(now)} end
    if rem_req then rem_req = rem_req - (sent - mark) end
    if rem_tok then rem_tok = rem_tok - math.max(0, sent_tok - mark_tok) end
    at = math.min(now, stated_at)
    put('prov_obs', mark)
  end
end

if limit_req then put('prov_limit_req', limit_req) end
if limit_tok then put('prov_limit_tok', limit_tok) end
if rem_req then put('prov_rem_req', rem_req); put('prov_reset_req_ms', at + (reset_req or 0)) end
if rem_tok then put('prov_rem_tok', rem_tok); put('prov_reset_tok_ms', at + (reset_tok or 0)) end

local factor = nil
local tpm = tonumber(redis.call('HGET', KEYS[2], 'P.provider_tpm'))
local rpm = tonumber(redis.call('HGET', KEYS[2], 'P.provider_rpm'))
if limit_tok and tpm and tpm > 0 then factor = math.min(1, limit_tok / tpm) end
if limit_req and rpm and rpm > 0 then factor = math.min(factor or 1, limit_req / rpm) end

local changed = 0
if factor then
  factor = math.max(0.001, factor)
  local before = tonumber(redis.call('HGET', KEYS[1], 'prov_factor'))
  local until_before = tonumber(redis.call('HGET', KEYS[1], 'prov_until_ms')) or 0
  if before == nil or now >= until_before or math.abs(before - factor) > 0.01 * before then changed = 1 end
  put('prov_factor', factor)
  put('prov_until_ms', now + tonumber(ARGV[7]))
end
redis.call('HSET', KEYS[1], unpack(writes))
return {changed, factor and tostring(factor) or '', tostring(now)}
