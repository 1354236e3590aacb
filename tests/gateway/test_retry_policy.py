"""The retry policy's arithmetic and budgets, against the real Redis."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gateway.worker.retry import RetryPolicy, retry_budget_earn, retry_budget_spend

pytestmark = pytest.mark.django_db(transaction=True)


def test_full_jitter_spans_the_whole_window():
    policy = replace(RetryPolicy.from_settings(), base_ms=250, cap_ms=8_000)
    rng = random.Random(7)
    window = policy.backoff_window_ms(3)  # 250 x 2^2
    assert window == 1_000
    samples = [policy.delay_ms(3, upstream_retry_after_ms=None, rng=rng) for _ in range(10_000)]
    assert min(samples) < 0.01 * window
    assert max(samples) > 0.99 * window
    assert all(0 <= s <= window for s in samples)
    # uniform: every tenth of the window gets about a tenth of the samples
    deciles = [0] * 10
    for sample in samples:
        deciles[min(9, int(sample / window * 10))] += 1
    assert all(850 <= count <= 1_150 for count in deciles), deciles


def test_window_is_capped_and_retry_after_is_a_floor():
    policy = replace(RetryPolicy.from_settings(), base_ms=250, cap_ms=8_000)
    assert policy.backoff_window_ms(10) == 8_000
    rng = random.Random(1)
    # the jitter window starts at the pool's Retry-After: never earlier, and
    # spread out after it rather than all at the instant it ends
    delays = [policy.delay_ms(1, upstream_retry_after_ms=700, rng=rng) for _ in range(1_000)]
    assert 700 <= min(delays) < 710 and 940 < max(delays) <= 950
    delays = [policy.delay_ms(4, upstream_retry_after_ms=700, rng=rng) for _ in range(1_000)]
    assert min(delays) >= 700 and max(delays) > 2_500


@pytest.mark.redis_cluster
def test_pool_retry_budget_keeps_retries_under_ten_percent(make_caller):
    caller = make_caller()
    policy = replace(RetryPolicy.from_settings(), pool_ratio=0.1, pool_burst=10, session_budget=1_000)
    granted = 0
    for _ in range(200):
        retry_budget_earn(pool_id=caller.pool.id, policy=policy)
        if retry_budget_spend(pool_id=caller.pool.id, workload_id=caller.workload.id, session_id=None,
                              policy=policy) == "ok":
            granted += 1
    # 200 first attempts earn 20 retries, no more
    assert granted == 20


@pytest.mark.redis_cluster
def test_session_retry_budget_is_per_session(make_caller):
    caller = make_caller()
    policy = replace(RetryPolicy.from_settings(), pool_ratio=1.0, pool_burst=100, session_budget=3)
    for _ in range(50):
        retry_budget_earn(pool_id=caller.pool.id, policy=policy)
    verdicts = [retry_budget_spend(pool_id=caller.pool.id, workload_id=caller.workload.id, session_id="chain-1",
                                   policy=policy) for _ in range(5)]
    assert verdicts == ["ok", "ok", "ok", "session_retry_budget", "session_retry_budget"]
    assert retry_budget_spend(pool_id=caller.pool.id, workload_id=caller.workload.id, session_id="chain-2",
                              policy=policy) == "ok"
