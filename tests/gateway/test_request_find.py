"""Finding a request by any id a caller holds (request id, the chatcmpl- id
of its answer, a job id) from the request log's search box and
``GET /api/requests/{id}``; every refusal findable by its id for 24 hours,
sampled or not, with a page; another tenant's ids are 404, never 403.
Against the real PostgreSQL and Redis."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.urls import reverse
from django.utils import timezone

from budgets.ledger import rejections
from budgets.ledger.rejections import rejection_count_call, rejections_flush
from budgets.ledger.writer import LedgerEntry, usage_record_write
from budgets.models import RejectionSample, RejectionStat
from gateway.models import Job
from tenants.models import ApiKey
from tests.people import world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

REFUSAL_MESSAGE = "Workload token budget exhausted: 1,200 tokens asked, 300 left; retry after 1.5 s."


def key_of(workload) -> ApiKey:
    return ApiKey.objects.get(workload=workload)


def ledger_row(world, *, workload=None, completion_id: str = "") -> str:
    workload = workload or world.wl_a
    request_id = "req_" + uuid.uuid4().hex
    usage_record_write(entry=LedgerEntry(
        request_id=request_id, created_at=timezone.now() - timedelta(minutes=1), tenant_id=workload.tenant_id,
        workload_id=workload.id, pool_id=world.pool.id, model="sim-small", lane="interactive", status="ok",
        borrowed=False, estimated_input_tokens=1000, estimated_output_tokens=600, actual_input_tokens=1000,
        actual_output_tokens=500, queue_wait_ms=40, upstream_ms=900, total_ms=960, api_key_id=key_of(workload).id,
        completion_id=completion_id,
    ))
    return request_id


def job_of(world, *, workload=None, request_id: str = "", status: str = Job.Status.QUEUED) -> Job:
    workload = workload or world.wl_a
    return Job.objects.create(tenant_id=workload.tenant_id, workload=workload, status=status,
                              body={"model": "sim-small", "messages": []}, body_sha256="0" * 64, request_id=request_id,
                              deadline=timezone.now() + timedelta(hours=1), api_key=key_of(workload))


def refuse(world, *, workload=None, now_s: float | None = None, request_id: str | None = None) -> str:
    """One refusal through the real count script, filed under its request id."""
    workload = workload or world.wl_a
    request_id = request_id or "req_" + uuid.uuid4().hex
    rejection_count_call(pool_id=world.pool.id, workload_id=workload.id, tenant_id=workload.tenant_id,
                         reason="workload_tpm", estimated_tokens=1200, retry_after_ms=1500, message=REFUSAL_MESSAGE,
                         request_id=request_id, api_key_id=key_of(workload).id, now_s=now_s).run()
    return request_id


def ids_of_tenant_a(world) -> dict[str, str]:
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    request_id = ledger_row(world, completion_id=completion_id)
    job = job_of(world, request_id=request_id)
    waiting = job_of(world, status=Job.Status.DELAYED)
    return {"request": request_id, "completion": completion_id, "job": str(job.id), "job_hex": job.id.hex,
            "waiting_job": str(waiting.id), "refusal": refuse(world)}


def test_the_search_box_opens_the_request_from_each_kind_of_id(world, client):
    # given a ledger row with its answer id, its job, a job not run yet and a refusal of tenant A
    ids = ids_of_tenant_a(world)
    find = reverse("tenant-request-find", args=[world.tenant_a.slug])
    row_page = reverse("tenant-request-detail", args=[world.tenant_a.slug, ids["request"]])
    client.force_login(world.member_a)
    # when a member searches by each id, then each opens the request's page
    for kind in ("request", "completion", "job", "job_hex"):
        response = client.get(find, {"q": f"  {ids[kind]} "})
        assert (kind, response.status_code, response["Location"]) == (kind, 302, row_page)
    refusal = client.get(find, {"q": ids["refusal"]})
    assert refusal["Location"] == reverse("tenant-request-detail", args=[world.tenant_a.slug, ids["refusal"]])
    # a job that has not run yet opens its row on the workload's jobs page
    waiting = client.get(find, {"q": ids["waiting_job"]})
    assert waiting["Location"] == (reverse("workload-jobs", args=[world.tenant_a.slug, world.wl_a.slug])
                                   + f"#job-{ids['waiting_job']}")
    # an unknown id is a 404 page that says so; an empty box a 400
    missing = client.get(find, {"q": "req_" + "0" * 32})
    assert missing.status_code == 404 and 'id="find-message"' in missing.content.decode()
    assert client.get(find, {"q": ""}).status_code == 400
    # the log page carries the box
    log = client.get(reverse("tenant-request-log", args=[world.tenant_a.slug])).content.decode()
    assert f'id="request-find" role="search" action="{find}"' in log


@pytest.mark.parametrize("who", ["admin", "finance"])
def test_admins_and_finance_search_every_tenant(world, client, who):
    ids = ids_of_tenant_a(world)
    client.force_login(getattr(world, who))
    find = reverse("request-find")
    for kind in ("request", "completion", "job"):
        assert client.get(find, {"q": ids[kind]})["Location"] == reverse("request-detail", args=[ids["request"]])
    assert client.get(find, {"q": ids["refusal"]})["Location"] == reverse("request-detail", args=[ids["refusal"]])
    assert client.get(reverse("request-detail", args=[ids["refusal"]])).status_code == 200


def test_another_tenants_ids_are_not_found_never_forbidden(world, client):
    # given tenant A's ids, and tenant B's member signed in
    ids = ids_of_tenant_a(world)
    client.force_login(world.member_b)
    for kind in ("request", "completion", "job", "waiting_job", "refusal"):
        # searching B's own log finds nothing of A's
        own = client.get(reverse("tenant-request-find", args=[world.tenant_b.slug]), {"q": ids[kind]})
        assert (kind, own.status_code) == (kind, 404)
        # A's log is not B's to search
        other = client.get(reverse("tenant-request-find", args=[world.tenant_a.slug]), {"q": ids[kind]})
        assert (kind, other.status_code) == (kind, 404)
        # nor the API
        api = client.get(f"/api/requests/{ids[kind]}")
        assert (kind, api.status_code, api.json()) == (kind, 404, {"detail": "Not found."})
    # the refusal's page under B's tenant: 404 too
    assert client.get(reverse("tenant-request-detail", args=[world.tenant_b.slug, ids["refusal"]])).status_code == 404
    # and B's own refusal is found
    own_refusal = refuse(world, workload=world.wl_b)
    assert client.get(f"/api/requests/{own_refusal}").json()["tenant"] == world.tenant_b.slug


def test_the_api_answers_each_kind_of_id_with_exact_fields(world, client):
    ids = ids_of_tenant_a(world)
    client.force_login(world.member_a)
    prefix = key_of(world.wl_a).prefix
    # a ledger row, by its request id, its answer id or its job id: the same answer
    for kind in ("request", "completion", "job"):
        body = client.get(f"/api/requests/{ids[kind]}/").json()
        assert (body["kind"], body["request_id"], body["completion_id"], body["tenant"], body["workload"]) == (
            "ledger", ids["request"], ids["completion"], world.tenant_a.slug, world.wl_a.slug)
        assert (body["api_key_prefix"], body["status"], body["actual_input_tokens"], body["actual_output_tokens"],
                body["cost"], body["job"]["id"]) == (prefix, "ok", 1000, 500, "0.00045000", ids["job"])
        assert body["timings_ms"]["total_ms"] == 960
    # a refusal
    refusal = client.get(f"/api/requests/{ids['refusal']}").json()
    assert {k: refusal[k] for k in ("kind", "request_id", "workload", "api_key_prefix", "status", "reason", "message",
                                    "retry_after_ms", "retry_after_s", "estimated_tokens")} == {
        "kind": "refusal", "request_id": ids["refusal"], "workload": world.wl_a.slug, "api_key_prefix": prefix,
        "status": "rejected", "reason": "workload_tpm", "message": REFUSAL_MESSAGE, "retry_after_ms": 1500,
        "retry_after_s": 2, "estimated_tokens": 1200}
    # a job that has not run yet
    waiting = client.get(f"/api/requests/{ids['waiting_job']}").json()
    assert (waiting["kind"], waiting["request_id"], waiting["status"], waiting["job"]["id"]) == (
        "job", None, "delayed", ids["waiting_job"])
    # finance reads any tenant's
    client.force_login(world.finance)
    assert client.get(f"/api/requests/{ids['completion']}").json()["request_id"] == ids["request"]


def test_a_refusal_beyond_the_sample_is_found_by_its_id_with_its_page(world, client):
    # given 31 refusals of one workload in one closed minute, sent as a web
    # process sends them (its tally, one script call)
    minute = int(time.time() // 60) * 60 - 120
    refused = ["req_" + uuid.uuid4().hex for _ in range(31)]
    key = key_of(world.wl_a)
    for i, request_id in enumerate(refused):
        rejections._tally.note(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                               reason="workload_tpm", estimated_tokens=1200, retry_after_ms=1500,
                               message=REFUSAL_MESSAGE, request_id=request_id, api_key_id=key.id,
                               now_s=minute + 1 + i)
    assert rejections.rejection_tally_send_at_exit() is True
    # when the minute is flushed to the database
    rejections_flush(now_s=time.time() + 3600)
    # then the count is exact and five are kept as samples, with their ids and key
    assert RejectionStat.objects.get(workload=world.wl_a).count == 31
    assert sorted(RejectionSample.objects.filter(workload=world.wl_a).values_list("sample_id", "api_key_id")) == sorted(
        (request_id, key.id) for request_id in refused[:5])
    # and every one of the 31 has a page, the 31st (never sampled) included
    client.force_login(world.member_a)
    for request_id in refused:
        page = client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, request_id]))
        assert page.status_code == 200, request_id
    text = client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, refused[-1]])).content.decode()
    at = datetime.fromtimestamp(minute + 31, tz=dt_timezone.utc)
    for shown in (f'id="refusal-reason">workload_tpm<', f'id="refusal-message">{REFUSAL_MESSAGE}<',
                  'id="refusal-retry-after">1.5 s (header: 2 s, 1,500 ms)<', f"<code>{key.prefix}…</code>",
                  f'id="refusal-workload">{world.wl_a.slug}<', f'id="refusal-at">{at:%Y-%m-%d %H:%M:%S}.000000<'):
        assert shown in text
    # and the search box finds it
    found = client.get(reverse("tenant-request-find", args=[world.tenant_a.slug]), {"q": refused[-1]})
    assert found["Location"] == reverse("tenant-request-detail", args=[world.tenant_a.slug, refused[-1]])


def test_refusals_past_the_hourly_cap_are_counted_but_not_filed(world, client, settings):
    settings.SLUICE_REFUSAL_LOOKUP_PER_POOL_HOUR = 3
    now_s = int(time.time() // 3600) * 3600 - 3600 + 10  # all in the last full hour
    refused = [refuse(world, now_s=now_s + i) for i in range(5)]
    rejections_flush(now_s=time.time() + 3600)
    assert sum(RejectionStat.objects.filter(workload=world.wl_a).values_list("count", flat=True)) == 5
    RejectionSample.objects.all().delete()  # only the by-id hash is left to find them
    client.force_login(world.member_a)
    statuses = [client.get(f"/api/requests/{request_id}").status_code for request_id in refused]
    assert statuses == [200, 200, 200, 404, 404]
