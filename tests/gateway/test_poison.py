"""A request that makes the worker fail for a reason of its own (here: a
payload the SDK cannot encode, enqueued past the door as a bug or a future
gap would let it through) is settled and answered at once: the caller hears
a 500 ``worker_error`` within moments, the lease is gone, the pool was not
called so nothing is charged, the job is failed and its callback sent. It
never holds the pool's in-flight slots that every other tenant needs."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading
import time

import httpx
import pytest
from django import db
from django.utils import timezone

from budgets.admission import keys
from budgets.admission.estimation import Estimate
from budgets.redis.clients import get_redis
from budgets.models import UsageRecord
from gateway.core import keys as gateway_keys
from gateway.core.request.admission import lease_ttl_ms
from gateway.core.request.routing import request_route_admit
from gateway.core.request.context import context_for_workload
from gateway.core.request.enqueue import new_request_id, record_build, record_enqueue
from gateway.core.lanes import HOUSEKEEPING
from gateway.core.request.records import Outcome, RequestRecord
from gateway.models import Job

from tests.gateway.ledger import ledger_rows

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Still fine over here?"}]
# A lone surrogate: valid JSON ("\ud800"), but no UTF-8 encoder can send it.
POISON = [{"role": "user", "content": "poison \ud800 pill"}]
ESTIMATE = Estimate(input_tokens=20, output_tokens=30, max_tokens_requested=30, clamped=False)


def counters(redis_client, pool_id: int) -> dict[str, int]:
    return {k: int(v) for k, v in redis_client.hgetall(keys.pool_counters(pool_id)).items()}


def poison_enqueue(workload, *, job_id: str = "") -> RequestRecord:
    """Admit and enqueue a record the door would have refused."""
    ctx = context_for_workload(workload)
    request_id = new_request_id()
    lease_ms = lease_ttl_ms(queue_s=ctx.queue_timeout_s)
    admission = request_route_admit(ctx.route("sim-small"), request_id=request_id, model="sim-small",
                                    estimate_for=lambda _on_pool: ESTIMATE, lease_ms=lease_ms).admission
    record = record_build(ctx, request_id=request_id, model="sim-small",
                          payload={"model": "sim-small", "messages": POISON, "max_tokens": 30}, estimate=ESTIMATE,
                          admission=admission, deadline_ms=admission.admitted_ms + ctx.queue_timeout_s * 1000,
                          retry_deadline_ms=admission.admitted_ms + ctx.queue_timeout_s * 1000, job_id=job_id)
    record_enqueue(record, lease_ms=lease_ms)
    return record


def wait_outcome(request_id: str, timeout_s: float = 20.0) -> Outcome:
    popped = get_redis(blocking=True).blpop([gateway_keys.request_result(request_id)], timeout=timeout_s)
    assert popped is not None, f"no outcome for {request_id} within {timeout_s}s"
    return Outcome.from_json(popped[1])


def test_a_poison_request_is_answered_at_once_refunded_and_its_lease_released(platform, make_caller, redis_client):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    # when a request the SDK cannot encode reaches the worker
    started = time.monotonic()
    record = poison_enqueue(caller.workload)
    outcome = wait_outcome(record.request_id)
    waited = time.monotonic() - started
    # then its caller hears a worker_error within moments, not at the 135 s deadline
    assert waited < 10.0
    assert outcome.status == "worker_error"
    assert outcome.http_status == 500
    assert outcome.body["error"]["code"] == "worker_error"
    assert outcome.body["error"]["type"] == "server_error"
    assert "nothing is charged" in outcome.body["error"]["message"]
    # and its slot is free: no lease left, everything refunded (the pool was never called)
    assert redis_client.zcard(keys.pool_leases(pool.id)) == 0
    assert redis_client.exists(keys.lease(pool.id, record.request_id)) == 0
    wid = caller.workload.id
    assert counters(redis_client, pool.id)[f"{wid}.debited_tok"] == 0
    assert counters(redis_client, pool.id)[f"{wid}.admitted_req"] == 0
    assert platform.sim_stats()["requests_total"] == 0
    # and the ledger says what happened
    row = UsageRecord.objects.get(request_id=record.request_id)
    assert (row.status, row.error) == ("worker_error", "worker_error")
    assert (row.actual_input_tokens, row.actual_output_tokens) == (0, 0)
    assert (row.estimated_input_tokens, row.estimated_output_tokens) == (20, 30)


@pytest.fixture
def loopback_callbacks(platform):
    """The batch lane (the job's and the callbacks' lane) may call back a
    receiver on this machine, for this test only."""
    with platform.environment({"SLUICE_CALLBACK_ALLOW_PRIVATE": "1"}, lanes=[HOUSEKEEPING.name]):
        yield platform


def test_a_poison_job_is_failed_with_its_callback_sent(loopback_callbacks, make_caller, redis_client):
    platform = loopback_callbacks
    received: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="batch")
        job = Job.objects.create(tenant=caller.tenant, workload=caller.workload, status=Job.Status.QUEUED,
                                 body={"model": "sim-small", "messages": HELLO}, body_sha256="x" * 64,
                                 callback_url=f"http://127.0.0.1:{server.server_port}/hook",
                                 deadline=timezone.now() + timezone.timedelta(hours=1))
        # when the job's request turns out to be poison in the worker
        record = poison_enqueue(caller.workload, job_id=str(job.id))
        job.request_id = record.request_id
        job.save(update_fields=["request_id"])
        # The receiver holds the POST before the worker has read the 204 and
        # recorded it: wait for the recorded status, not for the POST.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if job.callback_status is not None:
                break
            time.sleep(0.05)
    finally:
        server.shutdown()
    # then the job is failed, not left queued forever, and its callback says so
    job.refresh_from_db()
    assert (job.status, job.reason) == ("failed", "worker_error")
    assert job.result["error"]["code"] == "worker_error"
    assert job.callback_status == 204
    assert len(received) == 1
    assert (received[0]["id"], received[0]["status"]) == (str(job.id), "failed")
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0


def test_64_poison_requests_do_not_touch_another_tenants_traffic(platform, make_caller, redis_client):
    # given a pool that holds 64 requests in flight, shared by two tenants
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", max_concurrency=64)
    attacker = make_caller(pool=pool)
    victim = make_caller(pool=pool)
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 8, "sim": {"output_tokens": 8}}

    def victim_call(_) -> tuple[int, str | None, float]:
        started = time.monotonic()
        response = httpx.post(f"{platform.base_url}/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {victim.api_key}"})
        code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
        return response.status_code, code, time.monotonic() - started

    def victim_run() -> list[tuple[int, str | None, float]]:
        with concurrent.futures.ThreadPoolExecutor(8) as executor:
            return list(executor.map(victim_call, range(48)))

    def p99(results) -> float:
        latencies = sorted(r[2] for r in results)
        return latencies[int(0.99 * (len(latencies) - 1))]

    solo = victim_run()
    # when the attacker's 64 poison requests arrive while the victim's traffic runs
    poisoned: list[RequestRecord] = []

    def attack():
        try:
            for _ in range(64):
                poisoned.append(poison_enqueue(attacker.workload))
                time.sleep(0.01)  # a steady stream, as the probe sent them
        finally:
            db.connection.close()

    attacker_thread = threading.Thread(target=attack)
    attacker_thread.start()
    mixed = victim_run()
    attacker_thread.join(60)
    # then every poison request was answered and settled, none holds a slot
    outcomes = [wait_outcome(record.request_id) for record in poisoned]
    assert len(outcomes) == 64
    assert {o.status for o in outcomes} == {"worker_error"}
    assert redis_client.zcard(keys.pool_leases(pool.id)) == 0
    assert counters(redis_client, pool.id)[f"{attacker.workload.id}.admitted_req"] == 0
    # and the victim's traffic did not notice: every call a 200, none saturated
    assert [r[0] for r in solo] == [200] * 48
    assert [r[0] for r in mixed] == [200] * 48
    assert [r for r in mixed if r[1] == "pool_saturated"] == []
    # (a generous bound, not a speed claim: held slots would mean 429s, not a slower p99)
    assert p99(mixed) <= 3 * p99(solo) + 1.0, (p99(solo), p99(mixed))
    assert len(ledger_rows(96, workload=victim.workload, status="ok")) == 96
    assert len(ledger_rows(64, workload=attacker.workload, status="worker_error")) == 64
