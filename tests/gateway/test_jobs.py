"""Async jobs through the real processes: POST /v1/jobs, the pacer, the lanes,
the ledger. Over budget means delayed, not rejected."""

from __future__ import annotations

import time

import httpx
import pytest

import llm_tokens
from budgets.models import UsageRecord
from gateway.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Summarize the quarterly report."}]


def post_job(platform, api_key: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{platform.base_url}/v1/jobs", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}", **headers})


def wait_final(platform, api_key: str, job_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = httpx.get(f"{platform.base_url}/v1/jobs/{job_id}", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"}).json()
        if view["status"] in {"succeeded", "failed", "rejected", "expired"} and view["usage"] is not None or \
                view["status"] in {"rejected", "expired"}:
            return view
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} still {view['status']}")


@pytest.fixture
def sim_pool(platform, make_caller):
    return make_caller.pool(base_url=f"{platform.sim_url}/v1")


@pytest.mark.redis_cluster
def test_a_job_runs_and_reports_result_tokens_and_cost(platform, make_caller, sim_pool):
    from budgets.models import ModelPrice
    from django.utils import timezone
    from decimal import Decimal

    ModelPrice.objects.create(model="sim-small", input_per_million=Decimal("1"), output_per_million=Decimal("2"),
                              effective_from=timezone.now() - timezone.timedelta(days=1))
    caller = make_caller(pool=sim_pool, workload_class="batch")
    # when a job is submitted
    response = post_job(platform, caller.api_key, {"model": "sim-small", "messages": HELLO, "max_tokens": 50,
                                                   "sim": {"output_tokens": 21}})
    # then it is accepted with a status URL
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["object"] == "job" and job["status"] in {"queued", "succeeded"}
    assert response.headers["location"] == job["status_url"]
    # and once settled it shows the completion, tokens and cost from the ledger
    final = wait_final(platform, caller.api_key, job["id"])
    prompt_tokens = llm_tokens.count_chat_tokens(HELLO)
    assert final["status"] == "succeeded"
    assert final["usage"]["prompt_tokens"] == prompt_tokens
    assert final["usage"]["completion_tokens"] == 21
    assert final["result"]["choices"][0]["message"]["content"]
    expected_cost = (Decimal(prompt_tokens) * 1 + Decimal(21) * 2) / Decimal(1_000_000)
    assert Decimal(final["cost"]) == expected_cost
    row = UsageRecord.objects.get(request_id=final["request_id"])
    assert row.lane == "batch" and row.status == "ok"


@pytest.mark.redis_cluster
def test_over_budget_jobs_are_delayed_not_rejected(platform, make_caller, sim_pool):
    # given a ceiling bucket of 15 s x 8,000 TPM = 2,000 tokens, refilling at 133 tokens/s
    caller = make_caller(pool=sim_pool, workload_class="batch", reserved_tpm=8_000, ceiling_tpm=8_000,
                         prompt_tokens_cap=200, max_tokens_cap=600)
    # (each holds its estimate for ~2 s: 10 s of simulated latency at time-scale 5)
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 600, "sim": {"output_tokens": 5, "latency_ms": 10_000}}
    # when four jobs of ~620 tokens arrive at once
    jobs = [post_job(platform, caller.api_key, body).json() for _ in range(4)]
    # then all are accepted; the fourth waits for budget instead of failing
    assert [j["status"] for j in jobs[:3]] == ["queued"] * 3
    assert jobs[3]["status"] == "delayed"
    assert jobs[3]["reason"] == "workload_tpm"
    assert jobs[3]["release_at"] is not None
    # and it runs once budget refills (settlement refunded the unused output)
    final = wait_final(platform, caller.api_key, jobs[3]["id"], timeout=40)
    assert final["status"] == "succeeded"
    assert final["delays"] >= 1
    assert UsageRecord.objects.filter(workload=caller.workload).count() == 4


def test_a_job_that_would_outlive_its_deadline_is_rejected_at_once(platform, make_caller, sim_pool):
    caller = make_caller(pool=sim_pool, workload_class="batch", reserved_tpm=8_000, ceiling_tpm=8_000,
                         prompt_tokens_cap=100, max_tokens_cap=1_900)
    big = {"model": "sim-small", "messages": HELLO, "max_tokens": 1_900, "sim": {"output_tokens": 1, "latency_ms": 10_000}}
    first = post_job(platform, caller.api_key, big)  # holds the whole bucket for ~2 s
    assert first.status_code == 202
    # the next one needs ~14 s of refill, but may wait only 2 s
    response = post_job(platform, caller.api_key, {**big, "deadline_seconds": 2})
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "deadline_unreachable"
    assert "workload_tpm" in response.json()["error"]["message"]
    assert Job.objects.filter(workload=caller.workload, status="rejected").count() == 1
    assert wait_final(platform, caller.api_key, first.json()["id"])["status"] == "succeeded"


def test_job_idempotency_key_same_body_same_job_other_body_409(platform, make_caller, sim_pool):
    caller = make_caller(pool=sim_pool, workload_class="batch")
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 20}
    first = post_job(platform, caller.api_key, body, **{"Idempotency-Key": "k-1"})
    again = post_job(platform, caller.api_key, body, **{"Idempotency-Key": "k-1"})
    other = post_job(platform, caller.api_key, {**body, "max_tokens": 21}, **{"Idempotency-Key": "k-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["x-sluice-idempotent-replay"] == "true"
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert Job.objects.filter(workload=caller.workload).count() == 1


def test_jobs_are_private_to_their_workload(platform, make_caller, sim_pool):
    owner = make_caller(pool=sim_pool, workload_class="batch")
    stranger = make_caller(pool=sim_pool, workload_class="batch")
    job = post_job(platform, owner.api_key, {"model": "sim-small", "messages": HELLO, "max_tokens": 5}).json()
    response = httpx.get(f"{platform.base_url}/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {stranger.api_key}"})
    assert response.status_code == 404
    assert "choices" not in response.text


@pytest.mark.parametrize("extra,param", [
    ({"callback_url": "ftp://example.test/x"}, "callback_url"),
    ({"callback_url": ["https://example.com/hook"]}, "callback_url"),
    ({"deadline_seconds": -1}, "deadline_seconds"),
    ({"deadline_seconds": "soon"}, "deadline_seconds"),
])
def test_bad_job_fields_are_400(platform, make_caller, sim_pool, extra, param):
    caller = make_caller(pool=sim_pool, workload_class="batch")
    response = post_job(platform, caller.api_key, {"model": "sim-small", "messages": HELLO, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert Job.objects.count() == 0


def test_scheduled_jobs_leave_through_a_leaky_bucket_at_the_reserved_rate(platform, make_caller, sim_pool):
    # given a scheduled workload reserved 12,000 TPM (200 tokens/s)
    caller = make_caller(pool=sim_pool, workload_class="scheduled", reserved_tpm=12_000, prompt_tokens_cap=200,
                         max_tokens_cap=200)
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 100 - llm_tokens.count_chat_tokens(HELLO),
            "sim": {"output_tokens": 3}}
    # when six 100-token jobs arrive together
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(6) as executor:
        ids = list(executor.map(lambda _: post_job(platform, caller.api_key, body).json()["id"], range(6)))
    for job_id in ids:
        assert wait_final(platform, caller.api_key, job_id, timeout=30)["status"] == "succeeded"
    jobs = list(Job.objects.filter(pk__in=ids))
    # then the leaky bucket planned their releases exactly cost / rate = 0.5 s apart
    planned = sorted(j.release_at.timestamp() for j in jobs if j.release_at is not None)
    assert len(planned) >= 4  # the first leaves at once (and a straggler might find the bucket drained)
    gaps = [b - a for a, b in zip(planned, planned[1:])]
    assert all(abs(gap - 0.5) < 0.002 for gap in gaps), gaps
    # and the pacer released each close to its planned time: steady, no burst
    released = sorted(j.released_at.timestamp() for j in jobs)
    assert all(b - a > 0.3 for a, b in zip(released, released[1:])), released
    lags = [j.released_at.timestamp() - j.release_at.timestamp() for j in jobs if j.release_at is not None]
    assert all(-0.001 <= lag < 0.3 for lag in lags), lags
