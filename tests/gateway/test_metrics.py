"""Little's law numbers per pool and lane, and their admin-only endpoint."""

from __future__ import annotations

import concurrent.futures

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
    metrics = pool_live_metrics(pool_id=pool.id)
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
