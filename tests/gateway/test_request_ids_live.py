"""Through the real processes: the ids a caller holds (the chatcmpl- id the
SDK returned, the x-request-id of a 429) find their requests; jobs released
later by the pacer and cron firings carry their key to the ledger, count in
per-key usage, and show their delays with reasons on the jobs page."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import pytest
from django.urls import reverse
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule

from budgets.models import UsageRecord
from budgets.selectors.usage import usage_by_api_key
from gateway.core.jobs.schedules import schedule_sync
from gateway.core.request_lookup import request_find
from gateway.models import Job, JobSchedule
from gateway.worker.tasks import run_schedule
from tenants.models import ApiKey, Membership
from tests.gateway.sdk_calls import sdk
from tests.people import make_user

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Summarize the quarterly report."}]


def member_of(tenant):
    user = make_user(f"member-{tenant.slug}")
    Membership.objects.create(tenant=tenant, user=user)
    return user


def wait_for(check, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise TimeoutError(what)


def post_job(platform, api_key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.base_url}/v1/jobs", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"})


def test_the_chatcmpl_id_and_a_429s_request_id_find_their_requests(platform, make_caller, client):
    # given a workload whose ceiling bucket holds 1,000 tokens
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=200, max_tokens_cap=400)
    scope = frozenset({caller.tenant.id})
    # when a call succeeds, and calls past the budget are refused with 429
    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=400, extra_body={"sim": {"output_tokens": 5}})
    completion = raw.parse()
    refused = []
    for _ in range(12):
        if len(refused) == 3:
            break
        response = httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {caller.api_key}"},
                              json={"model": "sim-small", "messages": HELLO, "max_tokens": 400,
                                    "sim": {"output_tokens": 400}})
        if response.status_code == 429:
            refused.append(response.headers["x-request-id"])
    assert len(refused) == 3
    # then the SDK's chatcmpl- id finds the ledger row of the answer's x-request-id
    assert completion.id.startswith("chatcmpl-")
    found = wait_for(lambda: request_find(tenant_ids=scope, query=completion.id), timeout=15, what="the ledger row")
    assert found.request_id == raw.headers["x-request-id"]
    assert UsageRecord.objects.get(request_id=found.request_id).completion_id == completion.id
    # and a stream's chunk id finds its row too
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=5, stream=True, extra_body={"sim": {"output_tokens": 3}})
    chunk_ids = {chunk.id for chunk in stream}
    assert len(chunk_ids) == 1 and next(iter(chunk_ids)).startswith("chatcmpl-")
    streamed = wait_for(lambda: request_find(tenant_ids=scope, query=next(iter(chunk_ids))), timeout=15,
                        what="the stream's row")
    assert UsageRecord.objects.get(request_id=streamed.request_id).lane == "interactive"
    # and each 429's x-request-id opens that refusal's page, with its key
    key = ApiKey.objects.get(workload=caller.workload)
    client.force_login(member_of(caller.tenant))
    for request_id in refused:
        wait_for(lambda: request_find(tenant_ids=scope, query=request_id), timeout=15, what=f"refusal {request_id}")
        response = client.get(reverse("tenant-request-find", args=[caller.tenant.slug]), {"q": request_id})
        assert response["Location"] == reverse("tenant-request-detail", args=[caller.tenant.slug, request_id])
        page = client.get(response["Location"]).content.decode()
        assert 'id="refusal-reason">workload_tpm<' in page and f"<code>{key.prefix}…</code>" in page


def test_a_job_released_later_carries_its_key_and_shows_its_delay(platform, make_caller, client):
    # given a ceiling bucket of 15 s x 8,000 TPM = 2,000 tokens
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="batch", reserved_tpm=8_000, ceiling_tpm=8_000,
                         prompt_tokens_cap=200, max_tokens_cap=600)
    key = ApiKey.objects.get(workload=caller.workload)
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 600, "sim": {"output_tokens": 5, "latency_ms": 10_000}}
    started = timezone.now()
    # when four jobs of ~620 tokens arrive at once: the fourth waits for budget
    jobs = [post_job(platform, caller.api_key, body).json() for _ in range(4)]
    assert [j["status"] for j in jobs] == ["queued"] * 3 + ["delayed"]
    late = jobs[3]["id"]
    job = wait_for(lambda: Job.objects.filter(pk=late, status=Job.Status.SUCCEEDED).exclude(request_id="").first(),
                   timeout=40, what="the delayed job to succeed")
    row = wait_for(lambda: UsageRecord.objects.filter(request_id=job.request_id).first(), timeout=10, what="its row")
    # then its ledger row carries the key that submitted it
    assert row.api_key_id == key.id
    assert UsageRecord.objects.filter(workload=caller.workload, api_key=key).count() == 4
    usage = usage_by_api_key(tenant_ids=frozenset({caller.tenant.id}), start=started - timedelta(minutes=1),
                             end=timezone.now() + timedelta(minutes=1))
    assert usage[key.id].requests == 4
    # and it counts its delay, with the reason
    assert job.delays == 1
    assert [d["reason"] for d in job.delay_history] == ["workload_tpm"]
    # and the jobs page links it to its request, tokens and cost, and shows the delay
    client.force_login(member_of(caller.tenant))
    page = client.get(reverse("workload-jobs", args=[caller.tenant.slug, caller.workload.slug])).content.decode()
    row_html = page.split(f'data-job-id="{late}"', 1)[1].split("</tr>", 1)[0]
    assert '<td class="num" data-value="1"><details><summary>1</summary>' in row_html
    assert '<span class="reason">workload_tpm</span>' in row_html
    assert reverse("tenant-request-detail", args=[caller.tenant.slug, row.request_id]) in row_html
    assert f'<td class="num">{row.actual_input_tokens + row.actual_output_tokens:,}</td>' in row_html


def test_cron_firings_carry_their_schedules_key_and_count_their_pacing(platform, make_caller):
    # given a scheduled workload paced at 600 TPM (10 tokens a second) and a
    # schedule made with its key
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="scheduled", reserved_tpm=600, ceiling_tpm=600,
                         prompt_tokens_cap=40, max_tokens_cap=40, max_tokens_default=10)
    key = ApiKey.objects.get(workload=caller.workload)
    crontab = CrontabSchedule.objects.create(minute="0", hour="2", day_of_week="*", day_of_month="*",
                                             month_of_year="*")
    schedule = JobSchedule(name=f"nightly-{caller.workload.id}", workload=caller.workload, crontab=crontab,
                           body={"model": "sim-small", "messages": [{"role": "user", "content": "Enrich."}],
                                 "max_tokens": 10, "sim": {"output_tokens": 2}}, jobs_per_run=3, api_key=key)
    schedule.full_clean()
    schedule.save()
    schedule_sync(schedule=schedule)
    started = timezone.now()
    # when it fires: three jobs leave the leaky bucket one after another
    run_schedule.delay(schedule.pk)
    wait_for(lambda: Job.objects.filter(schedule=schedule, status=Job.Status.SUCCEEDED).count() == 3, timeout=60,
             what="three succeeded jobs")
    jobs = list(Job.objects.filter(schedule=schedule))
    # then every job and ledger row carries the schedule's key
    assert {j.api_key_id for j in jobs} == {key.id}
    rows = wait_for(lambda: UsageRecord.objects.filter(request_id__in=[j.request_id for j in jobs]).count() == 3,
                    timeout=10, what="three rows")
    assert rows
    assert set(UsageRecord.objects.filter(workload=caller.workload).values_list("api_key_id", flat=True)) == {key.id}
    usage = usage_by_api_key(tenant_ids=frozenset({caller.tenant.id}), start=started - timedelta(minutes=1),
                             end=timezone.now() + timedelta(minutes=1))
    assert usage[key.id].requests == 3
    # and the two that waited for the pacer count it, with its reason
    assert sorted(j.delays for j in jobs) == [0, 1, 1]
    assert sorted(d["reason"] for j in jobs for d in j.delay_history) == ["paced", "paced"]


def test_a_job_refused_at_submission_is_found_by_its_429s_request_id(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="batch", reserved_tpm=8_000, ceiling_tpm=8_000,
                         prompt_tokens_cap=100, max_tokens_cap=1_900)
    big = {"model": "sim-small", "messages": HELLO, "max_tokens": 1_900, "sim": {"output_tokens": 1, "latency_ms": 10_000}}
    assert post_job(platform, caller.api_key, big).status_code == 202  # holds the whole bucket for ~2 s
    refused = post_job(platform, caller.api_key, {**big, "deadline_seconds": 2})
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "deadline_unreachable")
    request_id = refused.headers["x-request-id"]
    scope = frozenset({caller.tenant.id})
    found = wait_for(lambda: request_find(tenant_ids=scope, query=request_id), timeout=15, what="the refusal")
    assert found.request_id == request_id
