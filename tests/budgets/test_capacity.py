"""Capacity that moves: multiplicative decrease on throttles, additive
recovery, shedding order when capacity falls below the reservations."""

from __future__ import annotations

import time
import uuid

import pytest

from budgets.admission import keys
from budgets.admission.buckets import admit
from budgets.admission.capacity import capacity_signal, capacity_state
from budgets.errors import Rejected

pytestmark = pytest.mark.django_db(transaction=True)


def test_throttles_halve_once_per_cooldown_and_successes_recover(make_caller, redis_client):
    caller = make_caller()
    pool_id = caller.pool.id
    # when the pool answers 429 three times in a burst
    factors = [capacity_signal(pool_id=pool_id, event="throttle", retry_after_ms=0) for _ in range(3)]
    # then that is one signal: one halving
    assert factors == [0.5, 0.5, 0.5]
    # and after the cooldown, successes grow it back additively
    redis_client.hset(keys.pool_capacity(pool_id), mapping={"last_decrease_ms": 0, "last_increase_ms": 0,
                                                            "hint": 1})
    recovered = capacity_signal(pool_id=pool_id, event="ok")
    assert recovered == 1.0


def test_upstream_retry_after_is_a_floor_for_sheddable_work(make_caller):
    pool = make_caller.pool()
    interactive = make_caller(pool=pool, reserved_tpm=100_000)
    batch = make_caller(pool=pool, workload_class="batch", reserved_tpm=100_000)
    capacity_signal(pool_id=pool.id, event="throttle", retry_after_ms=5_000)
    # interactive work within its reservation still flows
    admit(pool_id=pool.id, workload_id=interactive.workload.id, request_id=uuid.uuid4().hex, input_tokens=0,
          output_tokens=10, lease_ttl_ms=60_000)
    # batch waits at least what the pool asked
    with pytest.raises(Rejected) as excinfo:
        admit(pool_id=pool.id, workload_id=batch.workload.id, request_id=uuid.uuid4().hex, input_tokens=0,
              output_tokens=10, lease_ttl_ms=60_000)
    assert excinfo.value.reason == "pool_backoff"
    assert 4_000 < excinfo.value.retry_after_ms <= 5_000


def test_shedding_order_scheduled_then_batch_interactive_last(make_caller):
    # given a pool of 100,000 TPM admission budget, fully reserved:
    # interactive 50%, batch 30%, scheduled 20%
    pool = make_caller.pool(provider_tpm=125_000)
    interactive = make_caller(pool=pool, reserved_tpm=50_000)
    batch = make_caller(pool=pool, workload_class="batch", reserved_tpm=30_000)
    scheduled = make_caller(pool=pool, workload_class="scheduled", reserved_tpm=20_000, prompt_tokens_cap=100,
                            max_tokens_cap=100)
    # when effective capacity halves (one throttle)
    capacity_signal(pool_id=pool.id, event="throttle")
    state = capacity_state(pool_id=pool.id)
    # then interactive keeps all of its reservation, batch keeps what is left,
    # scheduled is shed entirely
    assert state.factor == 0.5
    assert state.shed[interactive.workload.id] == 1.0
    assert state.shed[batch.workload.id] == 0.0
    assert state.shed[scheduled.workload.id] == 0.0
    # and admission follows: interactive's protected bucket is intact
    assert admit(pool_id=pool.id, workload_id=interactive.workload.id, request_id="i1", input_tokens=0,
                 output_tokens=12_000, lease_ttl_ms=60_000).borrowed is False
    with pytest.raises(Rejected):
        admit(pool_id=pool.id, workload_id=scheduled.workload.id, request_id="s1", input_tokens=0,
              output_tokens=100, lease_ttl_ms=60_000)


def test_sustained_latency_growth_counts_as_a_throttle(make_caller):
    caller = make_caller()
    pool_id = caller.pool.id
    for _ in range(60):
        capacity_signal(pool_id=pool_id, event="ok", latency_per_token_ms=10.0)
    assert capacity_state(pool_id=pool_id).factor == 1.0
    # when latency per token jumps tenfold and stays there
    factor = 1.0
    for _ in range(20):
        factor = capacity_signal(pool_id=pool_id, event="ok", latency_per_token_ms=100.0)
    # then the pool's admission rate drops
    assert factor == 0.5


def test_recovery_is_slow_near_the_level_that_was_throttled(make_caller, redis_client):
    caller = make_caller()
    pool_id = caller.pool.id
    capacity_signal(pool_id=pool_id, event="throttle")  # 1.0 -> 0.5, hint 1.0
    capacity_signal(pool_id=pool_id, event="throttle")  # within cooldown: ignored
    key = keys.pool_capacity(pool_id)
    now_ms = time.time() * 1000
    # pretend the factor recovered to 0.95 of the last throttled level, 10 s after it
    redis_client.hset(key, mapping={"factor": 0.95, "hint": 1.0, "last_decrease_ms": now_ms - 10_000,
                                    "last_increase_ms": now_ms - 1_000})
    slow = capacity_signal(pool_id=pool_id, event="ok")
    # one second at a tenth of 2%/s
    assert slow == pytest.approx(0.952, abs=0.0005)


def test_throttles_inside_the_pools_retry_after_fall_at_most_two_halvings(make_caller, redis_client):
    caller = make_caller()
    pool_id = caller.pool.id
    key = keys.pool_capacity(pool_id)

    def after_cooldown(**fields):
        redis_client.hset(key, mapping={"last_decrease_ms": time.time() * 1000 - 2_500, **fields})

    assert capacity_signal(pool_id=pool_id, event="throttle", retry_after_ms=10_000) == 0.5
    # past the cooldown but inside the pool's Retry-After: one more halving...
    after_cooldown()
    assert capacity_signal(pool_id=pool_id, event="throttle", retry_after_ms=10_000) == 0.25
    # ...and no further: these 429s answer what was sent before we slowed down
    after_cooldown()
    assert capacity_signal(pool_id=pool_id, event="throttle", retry_after_ms=10_000) == 0.25
    # once the Retry-After has passed, a new 429 is news again
    after_cooldown(blocked_until_ms=0)
    assert capacity_signal(pool_id=pool_id, event="throttle", retry_after_ms=0) == 0.125


def test_fast_calls_getting_slower_are_not_a_saturated_engine(make_caller):
    caller = make_caller()
    for _ in range(60):
        capacity_signal(pool_id=caller.pool.id, event="ok", latency_per_token_ms=0.05)
    for _ in range(20):
        factor = capacity_signal(pool_id=caller.pool.id, event="ok", latency_per_token_ms=1.5)
    assert factor == 1.0


def test_a_request_too_big_for_a_shrunk_bucket_waits_rather_than_413(make_caller):
    pool = make_caller.pool(provider_tpm=100_000)  # pool bucket 80,000 x 15 s = 20,000
    caller = make_caller(pool=pool, workload_class="batch", reserved_tpm=10_000, ceiling_tpm=80_000,
                         prompt_tokens_cap=100, max_tokens_cap=10_000)
    for _ in range(5):  # 1.0 -> 0.03: the pool bucket holds ~600 tokens
        capacity_signal(pool_id=pool.id, event="throttle")
        from budgets.redis.clients import get_redis
        get_redis().hset(keys.pool_capacity(pool.id), "last_decrease_ms", 0)
    with pytest.raises(Rejected) as excinfo:
        admit(pool_id=pool.id, workload_id=caller.workload.id, request_id="big", input_tokens=0,
              output_tokens=8_000, lease_ttl_ms=60_000)
    assert excinfo.value.reason != "request_too_large"
    assert excinfo.value.status == 429 and excinfo.value.retry_after_ms is not None
