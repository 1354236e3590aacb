"""Little's law numbers per pool and lane, and their admin-only endpoint."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from gateway.core.metrics import pool_live_metrics

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.redis_cluster
def test_arrivals_time_in_system_and_in_flight_per_lane(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)

    def call(_):
        return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 8, "sim": {"output_tokens": 8}}).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        assert list(executor.map(call, range(12))) == [200] * 12
    # a worker counts a departure after its answer's ledger row, a moment after the answer
    deadline = time.monotonic() + 10
    while (metrics := pool_live_metrics(pool_id=pool.id))["lane_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    lane = metrics["lanes"]["interactive"]
    # twelve arrivals in the 60 s window, all departed
    assert lane["arrival_rate_per_s"] == pytest.approx(12 / 60, abs=1e-3)
    assert lane["in_flight"] == 0
    assert lane["mean_time_in_system_s"] > 0
    assert lane["littles_l"] == pytest.approx(lane["arrival_rate_per_s"] * lane["mean_time_in_system_s"], abs=1e-3)
    assert metrics["lanes"]["batch"]["arrival_rate_per_s"] == 0
    assert metrics["in_flight"] == 0
    assert metrics["effective_capacity_factor"] == 1.0
    assert set(metrics["queue_depth"]) == {"interactive", "interactive-long", "batch", "scheduled"}


def test_metrics_endpoint_is_for_platform_admins_only(make_caller):
    caller = make_caller()
    url = f"/api/pools/{caller.pool.id}/metrics"
    client = Client()
    assert client.get(url).status_code == 401
    member = get_user_model().objects.create_user("member", password="x-member-pass")
    client.force_login(member)
    response = client.get(url)
    assert response.status_code == 403
    assert "arrival_rate" not in response.content.decode()
    admin = get_user_model().objects.create_user("ops", password="x-ops-pass", is_staff=True)
    client.force_login(admin)
    response = client.get(url)
    assert response.status_code == 200
    assert {"arrival_rate_per_s", "mean_time_in_system_s", "littles_l", "in_flight", "lanes"} <= set(response.json())
    assert client.get("/api/pools/999999/metrics").status_code == 404


def test_pool_numbers_show_lane_limits_provider_remaining_the_circuit_and_why(platform, make_caller, redis_client,
                                                                              settings):
    from budgets.admission.provider_limits import provider_limits_record
    from gateway.core import keys
    from gateway.core.protection.circuit import circuit_record
    from gateway.core.protection.concurrency import slot_acquire_call
    from tests.test_observability import scrape, value

    # given a learned long-lane limit with one call in it, a provider stating half
    # the configured limit, and a circuit opened by a failed call, with two requests held
    pool = make_caller.pool(provider_tpm=1_000_000)
    make_caller(pool=pool)
    redis_client.hset(keys.lane_limits(pool.id), mapping={"interactive-long.limit": 3.5,
                                                          "last_decrease_why": "the pool answered 429",
                                                          "short_ms": 900, "interactive-long.call_ms": 3_000})
    assert slot_acquire_call(pool_id=pool.id, lane="interactive-long", holder="r1").run().taken
    provider_limits_record(pool_id=pool.id, headers={"x-ratelimit-limit-tokens": "500000",
                                                      "x-ratelimit-remaining-tokens": "1234",
                                                      "x-ratelimit-remaining-requests": "77"})
    settings.SLUICE_CIRCUIT_FAILURES = 1
    circuit_record(pool_id=pool.id, holder="r2", ok=False, detail="HTTP 503")
    redis_client.zadd(keys.pool_held(pool.id), {"req_h1|interactive|10": 9e12, "req_h2|interactive|10": 9e12})

    # when
    metrics = pool_live_metrics(pool_id=pool.id)
    samples = scrape(platform)

    # then the pool page's numbers...
    # (the long lane's starts spaced min(900, 3,000 / (2 x 3)) = 500 ms; batch has no long call timed)
    assert metrics["lane_limits"] == {"interactive-long": {"limit": 3.5, "in_use": 1, "start_gap_ms": 500.0},
                                      "batch": {"limit": settings.SLUICE_LANE_LIMIT_INITIAL, "in_use": 0,
                                                "start_gap_ms": 0.0}}
    assert metrics["lane_limit_reason"] == "the pool answered 429"
    assert (metrics["provider"]["remaining_tokens"], metrics["provider"]["remaining_requests"]) == (1234.0, 77.0)
    assert metrics["effective_capacity_factor"] == 0.5
    assert metrics["capacity_reason"] == ("the provider states a limit of 500,000 tokens per minute in its "
                                          "x-ratelimit headers: 50% of the configured limits")
    assert metrics["circuit"] == {"state": "open", "why": "1 calls in a row failed, the last: HTTP 503", "opened": 1,
                                  "held": 2}
    # ...and /metrics
    pid = pool.id
    assert value(samples, "sluice_lane_concurrency_limit", pool_id=pid, lane="interactive-long") == 3.5
    assert value(samples, "sluice_lane_concurrency_in_use", pool_id=pid, lane="interactive-long") == 1
    assert value(samples, "sluice_pool_provider_remaining", pool_id=pid, unit="tokens") == 1234
    assert value(samples, "sluice_pool_provider_remaining", pool_id=pid, unit="requests") == 77
    assert value(samples, "sluice_pool_capacity_factor", pool_id=pid) == 0.5
    assert value(samples, "sluice_pool_circuit_state", pool_id=pid, state="open") == 1
    assert value(samples, "sluice_pool_circuit_state", pool_id=pid, state="closed") == 0
    assert value(samples, "sluice_pool_held_requests", pool_id=pid) == 2
