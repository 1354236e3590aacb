"""The pool's protected sum S (protected_sum.lua) kept incrementally by
admit.lua / settle.lua equals S computed the slow way, bucket by bucket, after
random admissions, settlements (refunds and charges), refused loans, buckets
filling up, shed changes and config pushes."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from budgets.admission import keys
from budgets.admission.buckets import ADMIT, admit, settle
from budgets.admission.capacity import capacity_signal
from budgets.admission.pool_config import pool_config_push
from budgets.errors import Rejected

pytestmark = pytest.mark.django_db(transaction=True)

# Both values at one instant of Redis's clock: the aggregate as admit.lua
# reads it (the library's own functions), and an independent loop over every
# protected bucket with the same level formula admit.lua uses for its own.
CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local a, changed = ps_load(KEYS[1], KEYS[2], KEYS[3], KEYS[6], now)
if a == nil then return {} end
if changed then ps_save(KEYS[1], a) end  -- it moved filled buckets out of the zset
local out = {tostring(ps_value(a, 'tok')), tostring(ps_value(a, 'req'))}
for _, d in ipairs({'tok', 'req'}) do
  local s = 0
  for _, w in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    local name = w .. '.Q.' .. d
    local rate = tonumber(redis.call('HGET', KEYS[3], name .. '.rate'))
    if rate ~= nil then
      local shed = tonumber(redis.call('HGET', KEYS[6], w .. '.shed')) or 1
      local cap = tonumber(redis.call('HGET', KEYS[3], name .. '.cap')) * shed
      rate = rate * shed
      local l = tonumber(redis.call('HGET', KEYS[5], name .. '.l'))
      local lvl = cap
      if l ~= nil then
        lvl = l + (now - tonumber(redis.call('HGET', KEYS[5], name .. '.t'))) * rate
        if lvl > cap then lvl = cap end
      end
      s = s + lvl
    end
  end
  out[#out + 1] = tostring(s)
end
out[#out + 1] = tostring(redis.call('ZCARD', KEYS[2]))
return out
"""


def _library_source() -> str:
    # ADMIT's source starts with the library; keep only the library part.
    return ADMIT.source.split("-- Admission: check and debit", 1)[0]


def test_incremental_protected_sum_equals_the_brute_force_sum_after_random_operations(make_caller, redis_client):
    # given a pool whose buckets hold one second of refill (they fill up during
    # the test) and five workloads, strict, lending and borrowing, whose
    # reservations fill the pool (a throttle sheds some of them)
    pool = make_caller.pool(provider_tpm=600_000, provider_rpm=6_000, headroom=0.8, burst_seconds=1.0)
    small = {"prompt_tokens_cap": 100, "max_tokens_cap": 100}  # each request fits a 1 s ceiling
    callers = [
        make_caller(pool=pool, reserved_tpm=120_000, ceiling_tpm=200_000, lend_fraction=0.0, rpm=1_200, **small),
        make_caller(pool=pool, reserved_tpm=120_000, ceiling_tpm=240_000, lend_fraction=0.5, rpm=1_200,
                    workload_class="batch", **small),
        make_caller(pool=pool, reserved_tpm=60_000, ceiling_tpm=480_000, lend_fraction=0.0, rpm=1_200,
                    workload_class="scheduled", **small),
        make_caller(pool=pool, reserved_tpm=90_000, ceiling_tpm=90_000, lend_fraction=0.25, rpm=600, **small),
        make_caller(pool=pool, reserved_tpm=60_000, ceiling_tpm=300_000, lend_fraction=1.0, rpm=600,
                    workload_class="batch", **small),
    ]
    check = redis_client.register_script(_library_source() + CHECK)
    check_keys = [keys.pool_protected_sum(pool.id), keys.pool_protected_fill(pool.id), keys.pool_config(pool.id),
                  keys.pool_workloads(pool.id), keys.pool_buckets(pool.id), keys.pool_capacity(pool.id)]
    rng = random.Random(9)
    open_leases: list[tuple[object, str, int]] = []
    compared = 0
    filling_seen = 0
    outcomes = {"admitted": 0, "refused": 0, "settled": 0, "rebuilds": 0}

    # when 600 random operations run
    for step in range(600):
        op = rng.random()
        if op < 0.55:
            caller = rng.choice(callers)
            request_id = uuid.uuid4().hex
            tokens = rng.choice([1, 50, 400, 1_500, 4_000])
            try:
                admit(pool_id=pool.id, workload_id=caller.workload.id, request_id=request_id,
                      input_tokens=tokens // 2, output_tokens=tokens - tokens // 2, lease_ttl_ms=600_000)
                open_leases.append((caller, request_id, tokens))
                outcomes["admitted"] += 1
            except Rejected:
                outcomes["refused"] += 1
        elif op < 0.85 and open_leases:
            caller, request_id, tokens = open_leases.pop(rng.randrange(len(open_leases)))
            called = rng.random() < 0.8
            actual = rng.choice([0, tokens // 3, tokens, tokens * 2]) if called else 0
            settle(pool_id=pool.id, workload_id=caller.workload.id, request_id=request_id,
                   actual_input_tokens=actual // 2, actual_output_tokens=actual - actual // 2, pool_called=called)
            outcomes["settled"] += 1
        elif op < 0.90:
            capacity_signal(pool_id=pool.id, event=rng.choice(["throttle", "ok", "recompute"]))
            outcomes["rebuilds"] += redis_client.exists(keys.pool_protected_sum(pool.id)) == 0
        elif op < 0.92:
            pool_config_push(pool=pool)
        else:
            time.sleep(rng.choice([0.05, 0.2, 0.6]))  # let buckets refill, some to full
        reply = check(keys=check_keys, args=[])
        if reply:
            incremental_tok, incremental_req, brute_tok, brute_req, filling = (float(x) for x in reply)
            # then the aggregate and the loop agree to float rounding: a fill
            # time is an absolute ms near 1.8e12, where a double resolves
            # 2.4e-4 ms, i.e. ~5e-4 token at these rates per bucket that fills
            assert incremental_tok == pytest.approx(brute_tok, abs=0.01), step
            assert incremental_req == pytest.approx(brute_req, abs=0.0001), step
            compared += 1
            filling_seen += filling > 0

    # and the run covered what it claims: comparisons, filling buckets,
    # admissions and refusals, settlements and rebuilds
    assert compared > 400
    assert filling_seen > 100
    assert min(outcomes.values()) > 0, outcomes


def _ask(caller, tokens: int):
    """A loan or a paid request of ``tokens`` output tokens: its admission, or its refusal."""
    try:
        return admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=uuid.uuid4().hex,
                     input_tokens=0, output_tokens=tokens, lease_ttl_ms=600_000)
    except Rejected as rejected:
        return rejected


def test_a_refused_loan_past_the_fill_walk_is_told_a_wait_after_which_it_fits(make_caller):
    # given 70 strict workloads (more protected buckets than admit.lua walks)
    # each part-spent so that every one fills at its own time, and a borrower
    # that drained the free capacity
    pool = make_caller.pool(provider_tpm=8_400_000, provider_rpm=100_000, headroom=0.5, burst_seconds=1.0)
    small = {"prompt_tokens_cap": 100, "max_tokens_cap": 100, "rpm": 600}
    strict = [make_caller(pool=pool, reserved_tpm=57_000, lend_fraction=0.0, **small) for _ in range(70)]
    borrower = make_caller(pool=pool, reserved_tpm=60_000, ceiling_tpm=2_400_000, lend_fraction=1.0,
                           prompt_tokens_cap=1_000, max_tokens_cap=1_000, rpm=6_000)

    for i, caller in enumerate(strict):
        assert not isinstance(_ask(caller, 100 + 5 * i), Rejected)
    while not isinstance(_ask(borrower, 2_000), Rejected):
        pass
    # when a loan of 2,000 tokens is refused for the pool
    refused = _ask(borrower, 2_000)
    assert isinstance(refused, Rejected) and refused.reason == "pool_tpm", refused
    # then waiting what it was told is enough (an upper bound past the walk)
    assert 0 < refused.retry_after_ms <= 1_000
    time.sleep(refused.retry_after_ms / 1000)
    assert not isinstance(_ask(borrower, 2_000), Rejected)


def _loan_fits_in_ms(redis_client, pool_id: int, k: float, now_ms: float) -> float:
    """Brute force: the first moment (ms after ``now_ms``, 0.1 ms steps) at
    which P.tok - S.tok >= k, from every bucket's stored level, rate and
    capacity (shed factors applied), each level refilled on its own."""
    cfg = {f: float(v) for f, v in redis_client.hgetall(keys.pool_config(pool_id)).items()
           if f.endswith((".rate", ".cap"))}
    state = {f: float(v) for f, v in redis_client.hgetall(keys.pool_buckets(pool_id)).items()}
    capacity = redis_client.hgetall(keys.pool_capacity(pool_id))

    def bucket(name: str, scale: float):
        rate, cap = cfg[f"{name}.rate"] * scale, cfg[f"{name}.cap"] * scale
        level = state.get(f"{name}.l")
        if level is None:
            return cap, 0.0, cap
        return min(cap, level + (now_ms - state[f"{name}.t"]) * rate), rate, cap

    p = bucket("P.tok", float(capacity.get("factor", 1)))
    protected = [bucket(f"{w}.Q.tok", float(capacity.get(f"{w}.shed", 1)))
                 for w in redis_client.smembers(keys.pool_workloads(pool_id))]

    def at(t, b):
        level, rate, cap = b
        return min(cap, level + t * rate)

    t = 0.0
    while at(t, p) - sum(at(t, q) for q in protected) < k:
        t += 0.1
        assert t < 10_000, "the loan never fits"
    return t


def test_a_refused_loan_inside_the_fill_walk_is_told_the_wait_at_which_it_fits(make_caller, redis_client):
    # given a pool refilling 2,000 tokens/s (1 s of burst), five strict
    # workloads part-spent so that each protected bucket fills at its own time
    # (two of them shed to half their rate and capacity), and borrowers that
    # drained the free capacity: P - S starts near 0 and grows piecewise
    # linearly as P refills and the protected buckets fill, reaching 1,000
    # tokens after about 0.7 s, inside the walk and before P is full
    pool = make_caller.pool(provider_tpm=240_000, provider_rpm=100_000, headroom=0.5, burst_seconds=1.0)
    small = {"prompt_tokens_cap": 50, "max_tokens_cap": 150}
    strict = [make_caller(pool=pool, reserved_tpm=12_000, lend_fraction=0.0, rpm=600, **small) for _ in range(5)]
    borrowers = [make_caller(pool=pool, reserved_tpm=1_000, ceiling_tpm=120_000, lend_fraction=1.0, rpm=6_000,
                             prompt_tokens_cap=500, max_tokens_cap=1_000) for _ in range(4)]
    for caller in strict[:2]:
        redis_client.hset(keys.pool_capacity(pool.id), f"{caller.workload.id}.shed", 0.5)
    redis_client.delete(keys.pool_protected_sum(pool.id))  # as capacity.lua does when a shed factor changes

    def redis_ms() -> float:
        seconds, micros = redis_client.time()
        return seconds * 1000 + micros / 1000

    for caller, spent in zip(strict, [20, 90, 60, 140, 180]):
        assert not isinstance(_ask(caller, spent), Rejected)
    drainers = iter(borrowers[:3] * 40)
    for size in (400, 100, 20):
        while not isinstance(_ask(next(drainers), size), Rejected):
            pass
    # when a fresh borrower's loan of 1,000 tokens is refused for the pool
    before = redis_ms()
    refused = _ask(borrowers[3], 1_000)
    after = redis_ms()
    assert isinstance(refused, Rejected) and refused.reason == "pool_tpm", refused
    # then the wait it is told is when P - S reaches 1,000, as the bucket-by-bucket
    # brute force finds it (the script ran between the two clock reads)
    fits_ms = _loan_fits_in_ms(redis_client, pool.id, 1_000, before)
    assert 300 < fits_ms < 900, fits_ms  # the case this test is about: inside the walk, before P is full
    assert fits_ms - (after - before) - 1 <= refused.retry_after_ms <= fits_ms + 1, (refused.retry_after_ms, fits_ms)
    # and it is enough: waiting it, the loan fits
    time.sleep(refused.retry_after_ms / 1000)
    assert not isinstance(_ask(borrowers[3], 1_000), Rejected)
