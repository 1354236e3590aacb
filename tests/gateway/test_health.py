"""Health kept apart from pool status, through the real processes: /healthz
(alive) and /readyz (database and Redis) ignore pools and tell anonymous
callers only up or down; pools are probed in the background (the pacer's
prober), and a dead pool refuses only its own workloads, with 503
pool_unavailable and a Retry-After, on the API, the job API, the pool page
and the live metrics."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from budgets.admission import keys
from budgets.admission.pool_status import pool_status
from gateway.core.metrics import pool_live_metrics
from gateway.worker.prober import pools_probe, probe_targets
from llm_platform import processes
from tests.platform_harness import HEALTH_TOKEN, Process

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Are you there?"}]
DEAD_URL = "http://127.0.0.1:9/v1"  # nothing listens on the discard port


def chat(platform, api_key: str) -> httpx.Response:
    return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"},
                      json={"model": "sim-small", "messages": HELLO, "max_tokens": 8, "sim": {"output_tokens": 4}})


def mark_down(pool) -> None:
    """Two failed probes in a row, as the prober records them."""
    for _ in range(2):
        results = pools_probe(targets=[t for t in probe_targets() if t.pool_id == pool.id])
        assert results[pool.id].ok is False


@pytest.fixture
def two_pools(platform, make_caller):
    """A workload on a pool that answers (the simulator) and one on a pool that does not."""
    alive = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    dead = make_caller(pool=make_caller.pool(base_url=DEAD_URL))
    return alive, dead


def test_probes_tell_a_pool_that_answers_from_one_that_does_not(two_pools):
    alive, dead = two_pools
    # when every active pool is probed twice
    first = pools_probe()
    second = pools_probe()
    # then the simulator answered and the dead port did not
    assert first[alive.pool.id].ok is True and first[alive.pool.id].detail == "HTTP 200"
    assert first[dead.pool.id].ok is False and first[dead.pool.id].detail.startswith("ConnectError")
    assert second[dead.pool.id].ok is False
    assert pool_status(pool_id=alive.pool.id).available is True
    status = pool_status(pool_id=dead.pool.id)
    assert (status.available, status.probed, status.failures_in_a_row) == (False, True, 2)


def test_a_dead_pool_refuses_only_its_own_workloads(platform, two_pools):
    alive, dead = two_pools
    platform.sim_reset()
    mark_down(dead.pool)
    # when both workloads call
    refused = chat(platform, dead.api_key)
    served = chat(platform, alive.api_key)
    # then the dead pool's caller hears at once, OpenAI-shaped, when to come back
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("pool_unavailable", "service_unavailable")
    # (until the next probe, due 5 s after the last one)
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 0 < wait_ms <= 5_000
    assert refused.headers["retry-after"] == str(-(-wait_ms // 1000))
    # and the other pool serves as usual
    assert served.status_code == 200, served.text
    assert platform.sim_stats()["requests_total"] == 1


def test_jobs_for_a_dead_pool_wait_for_it_instead_of_failing(platform, make_caller):
    caller = make_caller(pool=make_caller.pool(base_url=DEAD_URL), workload_class="batch")
    mark_down(caller.pool)
    response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30, headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 8})
    assert response.status_code == 202, response.text
    job = response.json()
    assert (job["status"], job["reason"], job["delays"]) == ("delayed", "pool_unavailable", 1)


def test_health_ignores_pools_and_shows_anonymous_callers_only_up_or_down(platform, two_pools):
    _, dead = two_pools
    mark_down(dead.pool)
    # anonymous: up/down only, whatever the pools do
    live = httpx.get(f"{platform.base_url}/healthz", timeout=10)
    ready = httpx.get(f"{platform.base_url}/readyz", timeout=10)
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert live.headers["cache-control"] == "no-store"
    # a wrong token is anonymous
    wrong = httpx.get(f"{platform.base_url}/readyz", timeout=10, headers={"Authorization": "Bearer nope"})
    assert wrong.json() == {"status": "ready"}
    # the token gets the details, pools' last probes included (read, not probed)
    detailed = httpx.get(f"{platform.base_url}/readyz", timeout=10,
                         headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
    assert detailed["database"] == {"ok": True, "detail": "ok"}
    assert detailed["redis"] == {"ok": True, "detail": "ok"}
    pool = detailed["pools"][dead.pool.slug]
    assert (pool["available"], pool["probed"], pool["failures_in_a_row"]) == (False, True, 2)
    live_detailed = httpx.get(f"{platform.base_url}/healthz", timeout=10,
                              headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
    assert live_detailed["status"] == "ok" and live_detailed["ready"] is True
    assert live_detailed["pools"][dead.pool.slug]["available"] is False


def test_health_details_for_platform_admins_only():
    client = Client()
    assert client.get("/readyz").json() == {"status": "ready"}
    member = get_user_model().objects.create_user("member", password="x-member-pass")
    client.force_login(member)
    assert client.get("/readyz").json() == {"status": "ready"}
    admin = get_user_model().objects.create_user("ops", password="x-ops-pass", is_staff=True)
    client.force_login(admin)
    detailed = client.get("/readyz").json()
    assert detailed["status"] == "ready" and detailed["database"]["ok"] is True and "pools" in detailed
    assert client.post("/readyz").status_code == 405


def test_a_dead_pool_shows_on_its_page_and_in_the_live_metrics(make_caller):
    caller = make_caller(pool=make_caller.pool(base_url=DEAD_URL))
    mark_down(caller.pool)
    metrics = pool_live_metrics(pool_id=caller.pool.id)
    assert metrics["pool_status"]["available"] is False
    assert metrics["pool_status"]["failures_in_a_row"] == 2
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops", password="x-ops-pass", is_staff=True))
    page = client.get(f"/ops/pools/{caller.pool.slug}/").content.decode()
    assert 'id="pool-unavailable"' in page and "503 pool_unavailable" in page
    assert "unavailable" in client.get("/ops/pools/").content.decode()


def test_the_pacer_probes_in_the_background_and_stops_at_once(platform, make_caller, tmp_path, redis_client):
    # given a dead pool and a pacer probing every 0.3 s
    caller = make_caller(pool=make_caller.pool(base_url=DEAD_URL))
    env = {**platform.env, "SLUICE_POOL_PROBE_INTERVAL_S": "0.3", "SLUICE_POOL_PROBE_TIMEOUT_S": "0.5",
           "SLUICE_POOL_PROBE_FAILURES": "2"}
    pacer = Process("pacer-prober", processes.pacer_command(), env, tmp_path).start()
    try:
        # then the pool is marked down without anyone calling it
        deadline = time.monotonic() + 20
        while "down_until_ms" not in redis_client.hgetall(keys.pool_capacity(caller.pool.id)):
            pacer.assert_alive()
            assert time.monotonic() < deadline, pacer.log_tail()
            time.sleep(0.1)
        # and SIGTERM stops the pacer and its prober within 5 s
        started = time.monotonic()
        pacer.popen.send_signal(signal.SIGTERM)
        assert pacer.popen.wait(timeout=5) == 0
        assert time.monotonic() - started < 5
        assert "pacer stopped" in pacer.log_tail()
    finally:
        pacer.kill()
