"""Job callbacks through the real processes: a job settles, its callback
goes out from the housekeeping lane, signed, and a failing receiver is tried
again with exponential backoff (parked in Redis, moved by the pacer) until
it answers or the attempts run out.

These receivers listen on 127.0.0.1, which Sluice refuses by default: this
module runs the web process and the housekeeping lane's worker with private
receivers allowed (and a short backoff), and puts them back afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.core import keys
from gateway.core.jobs.callbacks import callback_signature_verify
from gateway.core.lanes import HOUSEKEEPING
from gateway.models import Job, JobCallbackDelivery
from tenants.models import Tenant
from tests.receivers import CallbackReceiver

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Summarize the quarterly report."}]
BACKOFF_BASE_S = 0.4
MAX_ATTEMPTS = 4


@pytest.fixture(scope="module")
def private_callbacks(platform):
    overrides = {"SLUICE_CALLBACK_ALLOW_PRIVATE": "1", "SLUICE_CALLBACK_BACKOFF_BASE_S": str(BACKOFF_BASE_S),
                 "SLUICE_CALLBACK_BACKOFF_CAP_S": "5", "SLUICE_CALLBACK_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    with platform.environment(overrides, lanes=[HOUSEKEEPING.name]):
        yield platform


def submit(platform, api_key: str, callback_url: str) -> dict:
    response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30, headers={"Authorization": f"Bearer {api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 9, "callback_url": callback_url})
    assert response.status_code == 202, response.text
    return response.json()


def wait_attempts(job_id: str, count: int, timeout: float = 30.0) -> list[JobCallbackDelivery]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = list(JobCallbackDelivery.objects.filter(job_id=job_id).order_by("attempt"))
        if len(rows) >= count:
            return rows
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id}: {len(rows)} callback attempts logged, expected {count}")


def job_view(platform, api_key: str, job_id: str) -> dict:
    return httpx.get(f"{platform.base_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {api_key}"},
                     timeout=10).json()


def test_a_settled_job_is_posted_signed_to_its_callback(private_callbacks, make_caller, redis_client):
    platform = private_callbacks
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="batch")
    with CallbackReceiver(statuses=[204]) as receiver:
        # when a job with a callback URL settles
        job = submit(platform, caller.api_key, receiver.url())
        [received] = receiver.wait_for(1)
        rows = wait_attempts(job["id"], 1)
    # then its receiver got the settled job once, signed with the tenant's secret
    body = json.loads(received.body)
    assert (body["id"], body["status"], received.path) == (job["id"], "succeeded", "/hook")
    assert "callback_status" not in body and "callback_attempts" not in body
    secret = Tenant.objects.get(pk=caller.tenant.pk).callback_secret
    assert callback_signature_verify(secret=secret, header=received.headers["x-sluice-signature"], body=received.body,
                                     now=time.time(), tolerance_s=60)
    assert not callback_signature_verify(secret=secret + "x", header=received.headers["x-sluice-signature"],
                                         body=received.body, now=time.time(), tolerance_s=60)
    assert (received.headers["x-sluice-job-id"], received.headers["x-sluice-attempt"]) == (job["id"], "1")
    assert received.headers["host"] == f"127.0.0.1:{receiver.port}"
    # and the delivery log says so, in the database and in the job's API view
    assert [(r.attempt, r.status_code, r.delivered, r.address, r.error) for r in rows] == \
        [(1, 204, True, "127.0.0.1", "")]
    assert Job.objects.get(pk=job["id"]).callback_status == 204
    view = job_view(platform, caller.api_key, job["id"])
    assert view["callback_status"] == 204
    assert [(a["attempt"], a["status_code"], a["delivered"], a["error"], a["next_attempt_at"])
            for a in view["callback_attempts"]] == [(1, 204, True, None, None)]
    assert redis_client.zcard(keys.CALLBACK_RETRIES) == 0


def test_a_failing_receiver_is_tried_again_with_exponential_backoff(private_callbacks, make_caller):
    platform = private_callbacks
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="batch")
    with CallbackReceiver(statuses=[500, 502, 204]) as receiver:
        # when the receiver fails twice, then answers
        job = submit(platform, caller.api_key, receiver.url())
        received = receiver.wait_for(3)
        rows = wait_attempts(job["id"], 3)
    # then the same signed body came three times, numbered, each after a
    # longer wait: attempt n waits within [c/2, c] for c = base x 2^(n-1)
    assert [r.headers["x-sluice-attempt"] for r in received] == ["1", "2", "3"]
    assert len({r.body for r in received}) == 1
    gaps = [b.at - a.at for a, b in zip(received, received[1:])]
    assert BACKOFF_BASE_S / 2 <= gaps[0] < BACKOFF_BASE_S + 2.0, gaps
    assert BACKOFF_BASE_S <= gaps[1] < 2 * BACKOFF_BASE_S + 2.0, gaps
    # and every attempt is in the log, the failed ones with when the next was due
    assert [(r.attempt, r.status_code, r.delivered, r.error) for r in rows] == \
        [(1, 500, False, "HTTP 500"), (2, 502, False, "HTTP 502"), (3, 204, True, "")]
    assert rows[0].next_attempt_at is not None and rows[1].next_attempt_at is not None
    assert rows[2].next_attempt_at is None
    view = job_view(platform, caller.api_key, job["id"])
    assert view["callback_status"] == 204
    assert [a["status_code"] for a in view["callback_attempts"]] == [500, 502, 204]


def test_callback_attempts_stop_at_the_cap(private_callbacks, make_caller, redis_client):
    platform = private_callbacks
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="batch")
    with CallbackReceiver(statuses=[503]) as receiver:
        # when the receiver never recovers
        job = submit(platform, caller.api_key, receiver.url())
        rows = wait_attempts(job["id"], MAX_ATTEMPTS, timeout=40)
        received = receiver.wait_for(MAX_ATTEMPTS)
    # then it was tried exactly SLUICE_CALLBACK_MAX_ATTEMPTS times and nothing more is planned
    assert [r.attempt for r in rows] == list(range(1, MAX_ATTEMPTS + 1))
    assert len(received) == MAX_ATTEMPTS
    assert all(r.status_code == 503 and not r.delivered for r in rows)
    assert rows[-1].next_attempt_at is None
    assert not [m for m in redis_client.zrange(keys.CALLBACK_RETRIES, 0, -1) if m.startswith(job["id"])]
    assert Job.objects.get(pk=job["id"]).callback_status == 503
