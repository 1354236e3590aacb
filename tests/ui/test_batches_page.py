"""The Batch API's pages: a workload's batches (counts, lines by state, the
plan's verdict, the ledger's tokens and cost, file links), one batch (its
validation errors, metadata, status times and error lines, and a cancel for
those who may change the tenant), and a file's download, each scoped to the
tenant. Rows are written with the ORM; files through the real store."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from budgets.models import UsageRecord
from budgets.web.templatetags.sluice_ui import money
from gateway.core.batches.files import file_write
from gateway.core.batches.lifecycle import batch_plan, batch_usage
from gateway.models import Batch, BatchFile, Job
from tests.people import ledger_add

pytestmark = pytest.mark.django_db

PLAN_CEILING = {"estimated_tokens": 9000, "requests": 3, "basis": "token count", "reserved_tpm": 1, "ceiling_tpm": 9000,
                "rpm": 60, "seconds_at_reserved": 540000.0, "seconds_at_ceiling": 60.0, "fits_window": "ceiling",
                "note": "Fits the completion window only by borrowing idle capacity up to the workload's ceiling; "
                        "lines not started when the window ends expire."}


@pytest.fixture(autouse=True)
def files_dir(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "files"


def make_file(workload, purpose=BatchFile.Purpose.BATCH, content: bytes = b'{"custom_id": "a"}\n') -> BatchFile:
    return file_write(tenant_id=workload.tenant_id, workload_id=workload.id, purpose=purpose, filename="in.jsonl",
                      lines=iter(content.splitlines(keepends=True)))


def make_batch(workload, *, status=Batch.Status.IN_PROGRESS, created_ago_s: int = 0, **fields) -> Batch:
    fields.setdefault("input_file", make_file(workload))
    batch = Batch.objects.create(tenant_id=workload.tenant_id, workload=workload, endpoint="/v1/chat/completions",
                                 status=status, expires_at=timezone.now() + timedelta(hours=24), **fields)
    if created_ago_s:
        Batch.objects.filter(pk=batch.pk).update(created_at=timezone.now() - timedelta(seconds=created_ago_s))
        batch.refresh_from_db()
    return batch


def make_line(batch, line: int, status: str, **fields) -> Job:
    return Job.objects.create(tenant_id=batch.tenant_id, workload=batch.workload, batch=batch, line=line,
                              custom_id=f"req-{line}", status=status, body={}, body_sha256="",
                              endpoint=batch.endpoint, deadline=batch.expires_at, **fields)


def billed_line(world, batch, line: int, status=Job.Status.SUCCEEDED, **fields) -> Job:
    """A line that ran: its ledger row through the real writer."""
    request_id = ledger_add(workload=batch.workload, pool=world.pool, at=timezone.now(), input_tokens=100 + line,
                            output_tokens=10, endpoint=batch.endpoint)
    return make_line(batch, line, status, request_id=request_id, finished_at=timezone.now(), **fields)


def page_of(client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def batches_url(world, **query) -> str:
    url = f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/batches"
    return url + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def row_of(body: str, batch_id: str) -> str:
    match = re.search(rf'<tr data-status="[a-z_]+" id="{batch_id}".*?</tr>', body, re.S)
    assert match, batch_id
    return match.group(0)


def test_batches_page_shows_counts_lines_plan_usage_and_files(login, world):
    # given a running batch: 2 lines done (one ok, one failed upstream), one on the lane, one delayed, two pending
    batch = make_batch(world.wl_a, total=6, plan=PLAN_CEILING,
                       output_file=make_file(world.wl_a, BatchFile.Purpose.BATCH_OUTPUT))
    billed_line(world, batch, 1)
    billed_line(world, batch, 2, status=Job.Status.FAILED, result_status=500)
    make_line(batch, 3, Job.Status.QUEUED, request_id="req_running")
    make_line(batch, 4, Job.Status.DELAYED)
    make_line(batch, 5, Job.Status.PENDING)
    make_line(batch, 6, Job.Status.PENDING)
    # when the member opens the workload's batches
    row = row_of(page_of(login(world.member_a), batches_url(world)), batch.id)
    # then the row says it all
    assert '<span class="badge in_progress">In progress</span>' in row
    assert '<td class="num request-counts">6 / 1 / 1</td>' in row
    assert '<td class="num lines">2 / 1 / 1 / 2</td>' in row
    assert 'data-fits="ceiling"' in row and "Fits only at ceiling" in row and "borrowing idle capacity" in row
    usage = batch_usage(batch.id)
    assert usage["total_tokens"] == 101 + 102 + 20
    assert f'<td class="num tokens">{usage["total_tokens"]}</td>' in row
    assert Decimal(usage["cost"]) > 0
    assert f'<td class="num cost">{money(usage["cost"], 6)}</td>' in row
    assert f'/t/{world.tenant_a.slug}/files/{batch.input_file_id}/content' in row
    assert f'/t/{world.tenant_a.slug}/files/{batch.output_file_id}/content' in row and "file-error" not in row
    assert f'href="/t/{world.tenant_a.slug}/batches/{batch.id}"' in row


def test_a_batch_over_its_window_says_so(login, world):
    plan = batch_plan(type("Ctx", (), {"slices": []})(), tokens=10_000, requests=2, window_s=86400, basis="file size")
    batch = make_batch(world.wl_a, plan=plan)
    row = row_of(page_of(login(world.member_a), batches_url(world)), batch.id)
    assert 'data-fits="no"' in row and "Cannot finish within the completion window" in row


def test_batches_are_newest_first_and_paged_by_after(login, world):
    # given three batches a minute apart, and one of another workload
    oldest, middle, newest = (make_batch(world.wl_a, created_ago_s=ago) for ago in (180, 120, 60))
    other = make_batch(world.wl_b)
    client = login(world.member_a)
    # when the page shows two at a time
    first = page_of(client, batches_url(world, limit=2))
    # then the two newest, in order, and a link to the rest
    assert first.index(newest.id) < first.index(middle.id) and oldest.id not in first and other.id not in first
    assert f'id="older" href="?after={middle.id}"' in first
    second = page_of(client, batches_url(world, limit=2, after=middle.id))
    assert oldest.id in second and newest.id not in second and middle.id not in second and 'id="older"' not in second


def test_the_status_filter_narrows_the_list(login, world):
    running = make_batch(world.wl_a)
    done = make_batch(world.wl_a, status=Batch.Status.COMPLETED, completed_at=timezone.now())
    body = page_of(login(world.member_a), batches_url(world, status="completed"))
    assert done.id in body and running.id not in body
    assert '<option value="completed" selected>' in body


@pytest.mark.parametrize("query", ["status=bogus", "after=garbage", "after=batch_" + "0" * 32, "limit=0",
                                   "limit=%E2%91%A0", "after=%00", "limit=101"])
def test_bad_query_input_is_a_400_page(login, world, query):
    response = login(world.member_a).get(batches_url(world) + "?" + query)
    assert response.status_code == 400
    assert 'class="flash error"' in response.content.decode()


def test_a_cursor_from_another_workload_is_refused(login, world):
    foreign = make_batch(world.wl_b)
    response = login(world.admin).get(batches_url(world, after=foreign.id))
    assert response.status_code == 400 and "not one of this workload" in response.content.decode()


def test_the_pages_are_tenant_scoped(login, world):
    batch = make_batch(world.wl_a)
    a, b = world.tenant_a.slug, world.tenant_b.slug
    for url in (batches_url(world), f"/t/{a}/batches/{batch.id}", f"/t/{a}/files/{batch.input_file_id}/content",
                f"/t/{a}/batches/{batch.id}/cancel",
                # another tenant's batch, file and workload under one's own tenant's slug
                f"/t/{b}/batches/{batch.id}", f"/t/{b}/files/{batch.input_file_id}/content",
                f"/t/{b}/workloads/{world.wl_a.slug}/batches"):
        assert login(world.member_b).get(url).status_code == 404, url
    assert login(world.member_b).post(f"/t/{b}/batches/{batch.id}/cancel", {"confirm": "cancel"}).status_code == 404
    for reader in (world.finance, world.admin, world.member_a):
        assert login(reader).get(batches_url(world)).status_code == 200
        assert login(reader).get(f"/t/{a}/batches/{batch.id}").status_code == 200
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS


def test_finance_reads_a_batch_but_cannot_cancel_it(login, world):
    batch = make_batch(world.wl_a, total=1)
    make_line(batch, 1, Job.Status.PENDING)
    url = f"/t/{world.tenant_a.slug}/batches/{batch.id}"
    assert 'id="cancel-batch"' not in page_of(login(world.finance), url)
    assert 'id="cancel-batch"' in page_of(login(world.member_a), url)
    assert login(world.finance).get(url + "/cancel").status_code == 404
    # refused (the read-only middleware answers a finance POST before the view does)
    assert login(world.finance).post(url + "/cancel", {"confirm": "cancel"}).status_code in (403, 404)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS
    assert Job.objects.get(batch=batch).status == Job.Status.PENDING


def test_a_member_cancels_an_active_batch_after_confirming(login, world):
    # given a batch with a line on the lane and two waiting
    batch = make_batch(world.wl_a, total=3)
    running = make_line(batch, 1, Job.Status.QUEUED, request_id="req_running")
    make_line(batch, 2, Job.Status.PENDING)
    make_line(batch, 3, Job.Status.PENDING)
    client = login(world.member_a)
    url = f"/t/{world.tenant_a.slug}/batches/{batch.id}/cancel"
    # when the confirmation is asked for, then posted without its confirm
    assert 'id="confirm-cancel"' in page_of(client, url)
    assert client.post(url, {}).status_code == 400
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS
    # and then confirmed
    response = client.post(url, {"confirm": "cancel"})
    # then the batch is cancelling, its waiting lines cancelled, its running line left to finish
    assert response.status_code == 302 and response["Location"] == f"/t/{world.tenant_a.slug}/batches/{batch.id}"
    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLING and batch.cancelling_at is not None
    assert Job.objects.filter(batch=batch, status=Job.Status.CANCELLED).count() == 2
    running.refresh_from_db()
    assert running.status == Job.Status.QUEUED
    detail = page_of(client, response["Location"])
    assert "is cancelling" in detail and 'id="cancel-batch"' not in detail


def test_cancelling_an_ended_batch_changes_nothing(login, world):
    batch = make_batch(world.wl_a, status=Batch.Status.COMPLETED, completed_at=timezone.now())
    client = login(world.member_a)
    url = f"/t/{world.tenant_a.slug}/batches/{batch.id}"
    assert 'id="cancel-batch"' not in page_of(client, url)
    assert 'id="confirm-cancel"' not in page_of(client, url + "/cancel")
    assert client.post(url + "/cancel", {"confirm": "cancel"}).status_code == 302
    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED and batch.cancelling_at is None


def test_the_detail_page_shows_validation_errors_metadata_and_times(login, world):
    batch = make_batch(world.wl_a, status=Batch.Status.FAILED, failed_at=timezone.now(),
                       metadata={"team": "search-index"},
                       errors=[{"code": "invalid_json_line", "message": "Line 3 is not JSON.", "param": None,
                                "line": 3},
                               {"code": "duplicate_custom_id", "message": "custom_id 'x' repeats.", "param": None,
                                "line": 7}])
    body = page_of(login(world.member_a), f"/t/{world.tenant_a.slug}/batches/{batch.id}")
    errors = re.search(r'<table id="validation-errors">.*?</table>', body, re.S).group(0)
    assert errors.count("<tr><td") == 2 and "invalid_json_line" in errors and "Line 3 is not JSON." in errors
    assert '<td class="num">7</td>' in errors
    assert "search-index" in re.search(r'<table id="metadata">.*?</table>', body, re.S).group(0)
    times = re.search(r'<table id="status-times">.*?</table>', body, re.S).group(0)
    assert "<th>Created</th>" in times and "<th>Failed</th>" in times and "<th>Completed</th>" not in times
    assert '<span class="badge failed" id="batch-status">Failed validation</span>' in body


def test_the_detail_page_lists_the_error_files_lines_with_their_requests(login, world):
    # given a finished batch: an ok line, a line the pool failed (billed), a line refused at validation,
    # a line its window expired, then 60 more refused lines
    batch = make_batch(world.wl_a, status=Batch.Status.COMPLETED, completed_at=timezone.now(), total=64)
    billed_line(world, batch, 1)
    failed = billed_line(world, batch, 2, status=Job.Status.FAILED, result_status=503, reason="upstream_error",
                         result={"error": {"message": "The pool is overloaded.", "type": "server_error",
                                           "code": "upstream_error"}})
    make_line(batch, 3, Job.Status.REJECTED, result_status=400, reason="model_not_allowed",
              result={"error": {"message": "This workload may not use sim-large.", "type": "invalid_request_error",
                                "code": "model_not_allowed"}})
    make_line(batch, 4, Job.Status.EXPIRED, reason="batch_expired",
              result={"error": {"message": "Not executed before the window expired.", "code": "batch_expired"}})
    for line in range(5, 65):
        make_line(batch, line, Job.Status.REJECTED, result_status=400, reason="invalid_body",
                  result={"error": {"message": f"Line {line} is bad.", "code": "invalid_body"}})
    # when the member opens the batch
    body = page_of(login(world.member_a), f"/t/{world.tenant_a.slug}/batches/{batch.id}")
    table = re.search(r'<table id="error-lines">.*?</table>', body, re.S).group(0)
    rows = re.findall(r'<tr data-custom-id="([^"]+)">(.*?)</tr>', table, re.S)
    # then the first 50 lines of the error file, in file order, without the ok line
    assert [custom_id for custom_id, _ in rows] == [f"req-{n}" for n in range(2, 52)]
    by_id = dict(rows)
    assert '<td class="num">503</td>' in by_id["req-2"] and "upstream_error" in by_id["req-2"]
    assert "The pool is overloaded." in by_id["req-2"]
    assert f'href="/t/{world.tenant_a.slug}/log/{failed.request_id}/"' in by_id["req-2"]
    assert UsageRecord.objects.filter(request_id=failed.request_id).exists()
    assert '<td class="num">400</td>' in by_id["req-3"] and "model_not_allowed" in by_id["req-3"]
    assert "line-request" not in by_id["req-3"]
    assert '<td class="num">—</td>' in by_id["req-4"] and "batch_expired" in by_id["req-4"]
    assert "Not executed before the window expired." in by_id["req-4"]
    # and the counts agree with the lines
    assert 'id="count-completed">1<' in body and 'id="count-failed">63<' in body


def test_a_line_on_the_lane_links_to_no_request_until_billed(login, world):
    batch = make_batch(world.wl_a, status=Batch.Status.CANCELLING, cancelling_at=timezone.now(), total=2)
    make_line(batch, 1, Job.Status.FAILED, request_id="req_unbilled", result_status=500)
    body = page_of(login(world.member_a), f"/t/{world.tenant_a.slug}/batches/{batch.id}")
    assert "<code>req_unbilled</code>" in body and "/log/req_unbilled/" not in body
    assert "as it will be written" in body


def test_a_file_downloads_as_an_attachment_with_its_bytes(login, world):
    content = b"".join(b'{"custom_id": "%d", "body": {}}\n' % n for n in range(5000))  # several read chunks
    stored = make_file(world.wl_a, BatchFile.Purpose.BATCH_ERROR, content=content)
    response = login(world.finance).get(f"/t/{world.tenant_a.slug}/files/{stored.id}/content")
    assert response.status_code == 200 and response.streaming
    assert response["Content-Disposition"] == f'attachment; filename="{stored.id}.jsonl"'
    assert int(response["Content-Length"]) == len(content) > 64 * 1024
    with pytest.warns(Warning, match="asynchronous iterator"):  # the test client is WSGI; uvicorn iterates it async
        assert b"".join(response) == content


def test_another_tenants_file_is_not_found(login, world):
    theirs = make_file(world.wl_b)
    ours = make_file(world.wl_a)
    client = login(world.member_a)
    assert client.get(f"/t/{world.tenant_a.slug}/files/{theirs.id}/content").status_code == 404
    assert client.get(f"/t/{world.tenant_b.slug}/files/{theirs.id}/content").status_code == 404
    assert client.get(f"/t/{world.tenant_a.slug}/files/file-nope/content").status_code == 404
    assert client.get(f"/t/{world.tenant_a.slug}/files/{ours.id}/content").status_code == 200
    client.logout()
    anonymous = client.get(f"/t/{world.tenant_a.slug}/files/{ours.id}/content")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")


def test_the_tenant_and_jobs_pages_link_to_the_batches(login, world):
    client = login(world.member_a)
    link = f'href="/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/batches"'
    assert link in page_of(client, f"/t/{world.tenant_a.slug}/")
    assert link in page_of(client, f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/jobs")


def test_a_page_of_batches_costs_the_same_queries_however_many_it_shows(login, world):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries_for_page(client) -> int:
        with CaptureQueriesContext(connection) as captured:
            page_of(client, batches_url(world))
        return len(captured.captured_queries)

    client = login(world.member_a)
    for _ in range(2):
        billed_line(world, make_batch(world.wl_a, total=1), 1)
    with_two = queries_for_page(client)
    for _ in range(6):
        billed_line(world, make_batch(world.wl_a, total=1), 1)
    assert queries_for_page(client) == with_two
