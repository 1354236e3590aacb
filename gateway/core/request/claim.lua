-- Who owns a queued request's outcome, decided on Redis's clock, one step at
-- a time, by whoever asks: the worker that dequeued a delivery ('worker'),
-- the web process waiting for the outcome ('watch'), the reaper of lost
-- workers ('reap'). Exactly one asker wins each move.
--
-- Owner states (KEYS[1]):
--   (none)                   queued; delivery 0 not started
--   worker:<g>               delivery g started the call; alive while the
--                            heartbeat (KEYS[2], '<g>|<holder>') is
--   queued:<g>:<start_by>    delivery g re-enqueued after delivery g-1's worker
--                            was lost; it must start by start_by (ms)
--   expired                  a worker found the queue deadline passed (it refunds)
--   gaveup                   the web side stopped waiting first (it refunds)
--   lost:<g>                 a lost worker's call that no delivery could take
--                            over in time: charged on its estimate
-- A late worker of an older delivery finds a newer generation and drops its
-- task; every finishing step is idempotent besides, so nothing is settled or
-- published twice.
--
-- KEYS: 1 owner, 2 heartbeat, 3 the pool's stored answer, 4 published marker,
--       5 (optional) the request's record: its deadline_ms and
--       retry_deadline_ms replace ARGV[2] and ARGV[3] (all carry the
--       request's hash tag)
-- ARGV: 1 role ('worker' | 'watch' | 'reap'), 2 queue deadline (ms),
--       3 retry deadline (ms: no delivery calls the pool after it),
--       4 owner ttl (ms), 5 the delivery's generation (worker), 6 heartbeat
--       ttl (ms), 7 heartbeat holder (the asking process, as 'kind@host:pid'),
--       8 redelivery wait (ms)
-- Returns {verdict, generation, changed, now_ms, answered}; changed = 1 when
-- this call moved the state: the caller then owns what the verdict asks for;
-- answered = 1 when the pool's answer (KEYS[3]) was stored at that moment
-- (the worker reads it only then: no GET on a first delivery).
--   worker: 'worker' (call the pool), 'redelivered' (a later delivery: use
--           the stored answer or call), 'expired' (refund, record),
--           'lost' (settle as worker_lost), 'gaveup' | 'running' |
--           'superseded' (drop the task)
--   watch/reap: 'published' (pop the result; the reaper: nothing to do,
--           unless the worker was lost before its ledger row: 'finish'),
--           'queued' | 'running' (wait),
--           'gaveup' (watch only: refund, record), 'requeue' (enqueue
--           delivery g), 'finish' (finish with the stored answer),
--           'lost' (settle as worker_lost), 'expired'
if redis.replicate_commands then pcall(redis.replicate_commands) end

local role = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local queue_deadline, retry_deadline = tonumber(ARGV[2]), tonumber(ARGV[3])
if KEYS[5] then
  -- A worker's claim sent with its read of the record (records.py
  -- record_claim_calls): the deadlines are the record's own.
  local d = redis.call('HMGET', KEYS[5], 'deadline_ms', 'retry_deadline_ms')
  queue_deadline = tonumber(d[1]) or 0
  retry_deadline = tonumber(d[2]) or 0
  if retry_deadline == 0 then retry_deadline = queue_deadline end
end
local holder = ARGV[7]

local owner = redis.call('GET', KEYS[1])
local state, g, start_by = nil, 0, 0
if owner then
  local s, gen, by = string.match(owner, '^(%a+):?(%d*):?(%d*)$')
  state, g, start_by = s, tonumber(gen) or 0, tonumber(by) or 0
end
local answered = redis.call('EXISTS', KEYS[3]) == 1

local function reply(verdict, generation, changed)
  return {verdict, generation, changed, string.format('%d', now), answered and 1 or 0}
end
local function set(value) redis.call('SET', KEYS[1], value, 'PX', ARGV[4]) end
local function start(generation, verdict)
  set('worker:' .. generation)
  redis.call('SET', KEYS[2], generation .. '|' .. holder, 'PX', ARGV[6])
  return reply(verdict, generation, 1)
end
local function lose(generation)
  set('lost:' .. generation)
  return reply('lost', generation, 1)
end
-- The heartbeat's generation and holder, when one is alive.
local beat_gen, beat_holder = string.match(redis.call('GET', KEYS[2]) or '', '^(%d+)|(.*)$')
local function alive(generation) return beat_gen == tostring(generation) end

if role == 'worker' then
  local mine = tonumber(ARGV[5])
  if not owner then
    if mine ~= 0 then return reply('superseded', 0, 0) end  -- its state expired long ago
    if now > queue_deadline then
      set('expired')
      return reply('expired', 0, 1)
    end
    return start(0, 'worker')
  end
  if state == 'queued' or state == 'worker' then
    if mine ~= g then return reply('superseded', g, 0) end
    if state == 'queued' then
      if now > start_by and not answered then return lose(g) end
      return start(g, 'redelivered')
    end
    if alive(g) then
      if beat_holder ~= holder then return reply('running', g, 0) end
      -- This process's own earlier attempt, failed and retried (the caller
      -- checked that it is not running it now): carry on.
      return start(g, 'redelivered')
    end
    -- The broker handed this very delivery out again (or Celery retries
    -- it): its worker is gone. It stays delivery g, so that the message's
    -- later retries, which say g, still own it.
    if answered or now <= retry_deadline then return start(g, 'redelivered') end
    return lose(g)
  end
  return reply(state, g, 0)  -- expired, gaveup, lost: its settler acts
end

-- watch, reap
if redis.call('EXISTS', KEYS[4]) == 1 then
  -- A delivery publishes its own answer before it writes the ledger row
  -- (gateway/worker/execution.py _answer_keep_settled). The caller has it;
  -- the reaper finishes one whose worker was lost in between, on that
  -- stored answer (every finishing step is idempotent: the row, once).
  if role == 'watch' or state ~= 'worker' or alive(g) or not answered then
    return reply('published', g, 0)
  end
  return start(g, 'finish')
end
if not owner then
  if role == 'watch' and now > queue_deadline then
    set('gaveup')
    return reply('gaveup', 0, 1)
  end
  return reply('queued', 0, 0)
end
if state == 'queued' then
  if now <= start_by then return reply('queued', g, 0) end
  if answered then return start(g, 'finish') end
  return lose(g)
end
if state == 'worker' then
  if alive(g) then return reply('running', g, 0) end
  -- Its worker is lost. The pool's answer is stored: finish with it. Else
  -- run it again while a new call may start; else the caller gets a 503.
  if answered then return start(g + 1, 'finish') end
  if now <= retry_deadline then
    local by = math.min(retry_deadline, now + tonumber(ARGV[8]))
    set('queued:' .. (g + 1) .. ':' .. string.format('%d', by))
    return reply('requeue', g + 1, 1)
  end
  return lose(g)
end
return reply(state, g, 0)
