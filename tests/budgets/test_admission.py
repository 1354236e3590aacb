"""Admission against a real Redis: the Lua script's arithmetic, atomicity
(threads and processes), truthful Retry-After and settlement (I1, I5, I6)."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid

import pytest

from budgets.admission import keys
from budgets.admission.buckets import admit, settle
from budgets.errors import Rejected

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_cluster]

LEASE_MS = 600_000


def rid() -> str:
    return uuid.uuid4().hex


def try_admit(caller, *, tokens: int, input_tokens: int = 0):
    try:
        return admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=rid(),
                     input_tokens=input_tokens, output_tokens=tokens, lease_ttl_ms=LEASE_MS)
    except Rejected as rejected:
        return rejected


def slow_pool(make_caller, **kwargs):
    # burst_seconds=60 with headroom 0.5 keeps I1 (0.5 x 2 = 1) and makes each
    # bucket hold a full minute of refill: refill during a test is negligible.
    return make_caller.pool(headroom=0.5, burst_seconds=60.0, **kwargs)


def test_admits_until_the_ceiling_then_rejects_with_reason_and_headers_data(make_caller):
    # given a workload whose ceiling bucket holds 15 s x 24,000 TPM = 6,000 tokens
    caller = make_caller(reserved_tpm=24_000, ceiling_tpm=24_000, rpm=1_000)
    # when it asks for 1,000 tokens at a time
    outcomes = [try_admit(caller, tokens=1_000) for _ in range(7)]
    # then exactly six fit and the seventh names its reason and a wait
    assert [not isinstance(o, Rejected) for o in outcomes] == [True] * 6 + [False]
    rejected = outcomes[-1]
    assert rejected.reason == "workload_tpm"
    assert rejected.status == 429
    # 1,000 tokens at 400 tokens/s, minus what refilled meanwhile: under 2.5 s
    assert 0 < rejected.retry_after_ms <= 2_500
    assert rejected.rate_limits.remaining_tokens < 1_000


def test_retry_after_is_truthful(make_caller):
    caller = make_caller(reserved_tpm=60_000, ceiling_tpm=60_000, rpm=1_000)  # cap 15,000, 1 token/ms
    assert not isinstance(try_admit(caller, tokens=15_000), Rejected)
    rejected = try_admit(caller, tokens=1_500)
    assert isinstance(rejected, Rejected)
    # when the caller waits exactly what it was told
    time.sleep(rejected.retry_after_ms / 1000)
    # then the same request is admitted
    assert not isinstance(try_admit(caller, tokens=1_500), Rejected)


def test_rpm_bucket_admits_exactly_its_capacity_to_100_threads(make_caller):
    # given a workload allowed 5 requests (a full minute of 5 RPM, 60 s burst)
    pool = slow_pool(make_caller)
    caller = make_caller(pool=pool, reserved_tpm=100_000, rpm=5)
    results: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(100)

    def call() -> None:
        start.wait()
        outcome = try_admit(caller, tokens=10)
        with lock:
            results.append(not isinstance(outcome, Rejected))

    threads = [threading.Thread(target=call) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # then exactly five are admitted, and the rest were refused for RPM
    assert results.count(True) == 5
    assert results.count(False) == 95


def test_i6_four_processes_by_eight_threads_admit_what_one_would(make_caller):
    # given a ceiling of 10,000 tokens (60 s burst; refill 167 tokens/s)
    pool = slow_pool(make_caller)
    caller = make_caller(pool=pool, reserved_tpm=10_000, ceiling_tpm=10_000, rpm=5_000)
    ctx = multiprocessing.get_context("spawn")
    from tests.hammer import admit_many

    barrier_at = time.time() + 4.0  # spawned interpreters need a moment to import Django
    started = time.time()
    with ctx.Pool(4) as processes:
        per_process = processes.map(admit_many, [(pool.id, [caller.workload.id], 100, 8, 25, barrier_at)] * 4)
    elapsed = time.time() - max(started, barrier_at)
    results = [r for chunk in per_process for r in chunk]
    admitted_tokens = sum(tokens for _, tokens, ok in results if ok)
    # then the admitted total is the capacity plus what refilled meanwhile,
    # never more (overshoot 0: each admission is one atomic step)
    refill = 10_000 / 60.0 * elapsed
    assert len(results) == 4 * 8 * 25
    assert admitted_tokens >= 10_000
    assert admitted_tokens <= 10_000 + refill + 100
    counters = caller_counters(caller)
    assert counters[f"{caller.workload.id}.debited_tok"] == admitted_tokens


def caller_counters(caller) -> dict[str, int]:
    from budgets.redis.clients import get_redis

    raw = get_redis().hgetall(keys.pool_counters(caller.pool.id))
    return {k: int(v) for k, v in raw.items()}


def test_i1_pool_never_admits_above_its_budget_across_workloads(make_caller):
    # given a pool of 40,000 TPM (headroom 0.5, 60 s burst -> 20,000 tokens per
    # minute-bucket) and three workloads whose ceilings together exceed it
    pool = slow_pool(make_caller, provider_tpm=40_000, provider_rpm=100_000)
    callers = [make_caller(pool=pool, reserved_tpm=5_000, ceiling_tpm=20_000, rpm=10_000) for _ in range(3)]
    ctx = multiprocessing.get_context("spawn")
    from tests.hammer import admit_many

    barrier_at = time.time() + 4.0
    with ctx.Pool(4) as processes:
        chunks = processes.map(admit_many, [(pool.id, [c.workload.id for c in callers], 250, 8, 20, barrier_at)] * 4)
    elapsed = time.time() - barrier_at
    admitted = sum(t for chunk in chunks for _, t, ok in chunk if ok)
    # then the pool's admitted tokens stay within its bucket plus refill
    assert admitted <= 20_000 + 20_000 / 60.0 * elapsed + 250
    # and its capacity was used, not wasted
    assert admitted >= 20_000 - 250


def test_settlement_refunds_the_difference_once(make_caller):
    caller = make_caller(reserved_tpm=60_000, ceiling_tpm=60_000)
    request_id = rid()
    admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=request_id,
          input_tokens=300, output_tokens=700, lease_ttl_ms=LEASE_MS)
    assert caller_counters(caller)[f"{caller.workload.id}.debited_tok"] == 1_000
    # when the pool reports 300 in and 120 out, settled twice
    first = settle(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=request_id,
                   actual_input_tokens=300, actual_output_tokens=120)
    second = settle(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=request_id,
                    actual_input_tokens=300, actual_output_tokens=120)
    # then the buckets carry exactly the actual usage, and the replay did nothing
    assert first.settled is True and second.settled is False
    counters = caller_counters(caller)
    assert counters[f"{caller.workload.id}.debited_tok"] == 420
    assert counters[f"{caller.workload.id}.used_tok"] == 420
    from budgets.redis.clients import get_redis

    assert get_redis().zcard(keys.pool_leases(caller.pool.id)) == 0


def test_full_refund_restores_the_request_slot(make_caller):
    pool = slow_pool(make_caller)
    caller = make_caller(pool=pool, reserved_tpm=10_000, rpm=1)
    request_id = rid()
    admit(pool_id=pool.id, workload_id=caller.workload.id, request_id=request_id, input_tokens=10,
          output_tokens=10, lease_ttl_ms=LEASE_MS)
    assert try_admit(caller, tokens=10).reason == "workload_rpm"
    settle(pool_id=pool.id, workload_id=caller.workload.id, request_id=request_id, actual_input_tokens=0,
           actual_output_tokens=0, pool_called=False)
    assert not isinstance(try_admit(caller, tokens=10), Rejected)


def test_a_request_larger_than_any_bucket_is_413_not_a_false_retry_after(make_caller):
    caller = make_caller(reserved_tpm=8_000, ceiling_tpm=8_000, prompt_tokens_cap=100, max_tokens_cap=100)
    outcome = try_admit(caller, tokens=2_001)  # ceiling bucket holds 2,000
    assert isinstance(outcome, Rejected)
    assert outcome.reason == "request_too_large"
    assert outcome.status == 413
    assert outcome.retry_after_ms is None


def test_pool_rpm_and_split_input_output_limits(make_caller):
    pool = slow_pool(make_caller, provider_rpm=4, provider_input_tpm=2_000)  # 2 requests, 1,000 input tokens
    caller = make_caller(pool=pool, reserved_tpm=10_000, rpm=2, lend_fraction=0.0)
    assert not isinstance(try_admit(caller, tokens=1, input_tokens=600), Rejected)
    assert try_admit(caller, tokens=1, input_tokens=600).reason == "pool_input_tpm"
    assert not isinstance(try_admit(caller, tokens=1, input_tokens=100), Rejected)
    assert try_admit(caller, tokens=1, input_tokens=1).reason == "workload_rpm"


def test_pool_concurrency_limit_uses_leases(make_caller):
    pool = make_caller.pool(max_concurrency=2)
    caller = make_caller(pool=pool)
    admitted = [try_admit(caller, tokens=10) for _ in range(3)]
    assert isinstance(admitted[2], Rejected) and admitted[2].reason == "pool_saturated"
    settle(pool_id=pool.id, workload_id=caller.workload.id, request_id=admitted[0].request_id,
           actual_input_tokens=0, actual_output_tokens=5)
    assert not isinstance(try_admit(caller, tokens=10), Rejected)


def test_protected_reservation_survives_a_borrower(make_caller):
    """Three workloads: one strict, one lending half its reservation, one
    borrowing. The borrower may take idle capacity and the lent half, never
    the strict workload's or the lender's unlent part."""
    # pool bucket: 0.5 x 120,000 = 60,000 tokens (60 s burst)
    pool = slow_pool(make_caller, provider_tpm=120_000)
    strict = make_caller(pool=pool, reserved_tpm=20_000, ceiling_tpm=20_000, lend_fraction=0.0)
    lender = make_caller(pool=pool, reserved_tpm=20_000, ceiling_tpm=20_000, lend_fraction=0.5)
    borrower = make_caller(pool=pool, reserved_tpm=10_000, ceiling_tpm=60_000, lend_fraction=0.0)
    # when the borrower floods in 1,000-token requests
    admitted = 0
    while not isinstance(try_admit(borrower, tokens=1_000), Rejected):
        admitted += 1
        assert admitted < 100
    # then it got its own 10,000, the 10,000 unreserved and the lender's lent
    # 10,000 (within one refill-request), and no more
    assert 30 <= admitted <= 31
    # and the strict and lender workloads still get their protected parts in full
    assert not isinstance(try_admit(strict, tokens=20_000), Rejected)
    assert not isinstance(try_admit(lender, tokens=10_000), Rejected)


def test_workload_concurrency_limit_and_leases_that_expire_by_themselves(make_caller):
    pool = make_caller.pool()
    caller = make_caller(pool=pool, max_concurrency=2)
    # two in flight, each on a 300 ms lease (as if their worker died)
    for n in range(2):
        admit(pool_id=pool.id, workload_id=caller.workload.id, request_id=f"lease-{n}", input_tokens=0,
              output_tokens=10, lease_ttl_ms=300)
    third = try_admit(caller, tokens=10)
    assert isinstance(third, Rejected) and third.reason == "workload_concurrency"
    # once their leases expire the slots count as free, even before the reaper runs
    time.sleep(0.35)
    assert not isinstance(try_admit(caller, tokens=10), Rejected)
