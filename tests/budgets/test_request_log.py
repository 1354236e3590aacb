"""The request log: keyset pages over the ledger and the rejection samples
(flushed and still pending in Redis), every filter, the request's own page,
the latency table, and who may see what (404 across tenants, never 403)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.urls import reverse

from budgets.ledger.rejections import rejection_count_call, rejections_flush
from budgets.ledger.writer import LedgerEntry, usage_record_write
from budgets.models import RejectionSample, RejectionStat, UsageRecord
from budgets.selectors.latency import (
    PercentileCont,
    _percentiles_python,
    _percentiles_sql,
    latency_by_workload_lane,
    percentile,
)
from budgets.selectors.request_log import PAGE_SIZE, REJECTED, Cursor, LogFilters, request_log_page
from tenants.models import ApiKey
from tests.people import ledger_add, world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=dt_timezone.utc)


def ledger(world, *, at, workload=None, key=None, status="ok", lane="interactive", model="sim-small",
           tokens=(100, 50), est=(100, 64), timings=(0, 0, 0), borrowed=False) -> str:
    workload = workload or world.wl_a
    request_id = "req_" + uuid.uuid4().hex
    usage_record_write(entry=LedgerEntry(
        request_id=request_id, created_at=at, tenant_id=workload.tenant_id, workload_id=workload.id,
        pool_id=world.pool.id, model=model, lane=lane, status=status, borrowed=borrowed,
        estimated_input_tokens=est[0], estimated_output_tokens=est[1], actual_input_tokens=tokens[0],
        actual_output_tokens=tokens[1], queue_wait_ms=timings[0], upstream_ms=timings[1], total_ms=timings[2],
        api_key_id=key.id if key else None,
    ))
    return request_id


def sample(world, *, at, workload=None, reason="workload_tpm", tokens=500, sample_id=None) -> str:
    workload = workload or world.wl_a
    sample_id = sample_id or uuid.uuid4().hex
    RejectionSample.objects.create(sample_id=sample_id, at=at, tenant_id=workload.tenant_id, workload=workload,
                                   pool=world.pool, reason=reason, estimated_tokens=tokens, retry_after_ms=1500)
    return sample_id


def walk(filters, size):
    """Every entry, page by page, through the cursor the page hands out."""
    seen, cursor, pages = [], None, 0
    while True:
        page = request_log_page(filters=filters, cursor=cursor, size=size)
        seen.extend(page.entries)
        pages += 1
        if page.next_cursor is None:
            return seen, pages
        cursor = Cursor.decode(page.next_cursor)
        assert pages < 100


def key_of(workload):
    return ApiKey.objects.get(workload=workload)


def test_keyset_pages_merge_ledger_and_rejections_in_one_exact_order(world):
    # given ledger rows and rejections interleaved, two ledger rows and a
    # rejection at the very same instant
    ids = [ledger(world, at=T0 + timedelta(seconds=i)) for i in range(6)]
    tie = [ledger(world, at=T0 + timedelta(seconds=10)), ledger(world, at=T0 + timedelta(seconds=10))]
    samples = [sample(world, at=T0 + timedelta(seconds=10), sample_id="b" * 32),
               sample(world, at=T0 + timedelta(seconds=3, milliseconds=500), sample_id="a" * 32)]
    ledger(world, at=T0 + timedelta(seconds=5), workload=world.wl_b)  # another tenant's
    filters = LogFilters(start=T0, end=T0 + timedelta(hours=1), tenant_ids=frozenset({world.tenant_a.id}))
    # when the log is walked three at a time
    entries, pages = walk(filters, size=3)
    # then every row of the tenant comes exactly once, newest first, ledger
    # before rejection at one instant, higher id first
    assert pages == 4
    got = [e.request_id for e in entries]
    assert got == [tie[1], tie[0], samples[0], ids[5], ids[4], samples[1], ids[3], ids[2], ids[1], ids[0]]
    assert len(set(got)) == 10


def test_a_row_written_after_the_first_page_never_shifts_the_next(world):
    for i in range(4):
        ledger(world, at=T0 + timedelta(seconds=i))
    filters = LogFilters(start=T0, end=T0 + timedelta(hours=1))
    first = request_log_page(filters=filters, size=2)
    ledger(world, at=T0 + timedelta(seconds=30))  # newer than everything shown
    second = request_log_page(filters=filters, cursor=Cursor.decode(first.next_cursor), size=2)
    assert [e.at for e in second.entries] == [T0 + timedelta(seconds=1), T0]
    assert second.next_cursor is None


def test_filters_by_key_status_lane_model_and_rejections_only(world):
    key = key_of(world.wl_a)
    with_key = ledger(world, at=T0, key=key)
    ledger(world, at=T0 + timedelta(seconds=1))
    failed = ledger(world, at=T0 + timedelta(seconds=2), status="upstream_error", tokens=(0, 0))
    batch = ledger(world, at=T0 + timedelta(seconds=3), lane="batch", model="sim-large")
    refused = sample(world, at=T0 + timedelta(seconds=4), reason="pool_tpm")
    other_reason = sample(world, at=T0 + timedelta(seconds=5), reason="workload_rpm")
    base = dict(start=T0, end=T0 + timedelta(hours=1), tenant_ids=frozenset({world.tenant_a.id}))

    def ids(**kw):
        return [e.request_id for e in request_log_page(filters=LogFilters(**base, **kw)).entries]

    assert ids(api_key_id=key.id) == [with_key]
    assert ids(status="upstream_error") == [failed]
    assert ids(lane="batch") == [batch]
    assert ids(model="sim-large") == [batch]
    assert ids(status=REJECTED) == [other_reason, refused]
    assert ids(reason="pool_tpm") == [refused]
    assert len(ids()) == 6


def test_log_entries_carry_the_ledgers_numbers(world):
    key = key_of(world.wl_a)
    request_id = ledger(world, at=T0, key=key, tokens=(1000, 500), est=(1000, 800), timings=(40, 900, 960),
                        lane="batch", borrowed=True)
    entry = request_log_page(filters=LogFilters(start=T0, end=T0 + timedelta(minutes=1))).entries[0]
    row = UsageRecord.objects.get(request_id=request_id)
    assert row.api_key_id == key.id
    assert (entry.request_id, entry.estimated_tokens, entry.actual_tokens) == (request_id, 1800, 1500)
    # sim-small: 0.15 in, 0.60 out per million
    assert entry.cost == row.cost == Decimal("0.00045000")
    assert entry.currency == "USD" and entry.key_prefix == key.prefix and entry.borrowed is True
    assert entry.timings == {"queue_wait_ms": 40, "upstream_ms": 900, "ttft_ms": None, "total_ms": 960}


def test_pending_rejections_in_redis_show_before_the_flush_and_once_after(world):
    # given a rejection counted in Redis just now (not flushed yet)
    now = datetime.now(tz=dt_timezone.utc)
    rejection_count_call(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                         reason="context_length_exceeded", estimated_tokens=9008, retry_after_ms=None,
                         message="at most 2000 tokens; resulted in 9008 tokens", now_s=now.timestamp()).run()
    filters = LogFilters(start=now - timedelta(minutes=5), end=now + timedelta(minutes=1),
                         tenant_ids=frozenset({world.tenant_a.id}))
    before = request_log_page(filters=filters).entries
    assert [(e.status, e.reason, e.estimated_tokens) for e in before] == [(REJECTED, "context_length_exceeded", 9008)]
    # Tenant B never sees it
    assert request_log_page(filters=LogFilters(start=filters.start, end=filters.end,
                                               tenant_ids=frozenset({world.tenant_b.id}))).entries == []
    # when the minute is flushed, it is the same one row (from the database now)
    rejections_flush(now_s=now.timestamp() + 180)
    stored = RejectionSample.objects.get()
    assert (stored.estimated_tokens, stored.message) == (9008, "at most 2000 tokens; resulted in 9008 tokens")
    after = request_log_page(filters=filters).entries
    assert [e.request_id for e in after] == [before[0].request_id]


def test_percentiles_are_continuous_on_postgresql_and_in_the_python_fallback(world):
    for total in (100, 200, 300, 400):
        ledger(world, at=T0, timings=(total // 10, total - total // 10 - 5, total))
    ledger(world, at=T0 + timedelta(seconds=1), status="upstream_error", tokens=(0, 0), timings=(0, 0, 1000))
    sample(world, at=T0 + timedelta(seconds=2))
    filters = LogFilters(start=T0, end=T0 + timedelta(hours=1), tenant_ids=frozenset({world.tenant_a.id}))
    rows = latency_by_workload_lane(filters=filters)
    assert [(r.workload_slug, r.lane, r.requests, r.ok, r.errors) for r in rows] == [
        (world.wl_a.slug, "interactive", 5, 4, 1)]
    row = rows[0]
    # percentile_cont over 100, 200, 300, 400, 1000
    # (floating point: both sides compute 0.95 x 4 = 3.7999..., hence the rounding)
    assert {p: round(v, 6) for p, v in row.percentiles["total_ms"].items()} == {50: 300.0, 95: 880.0, 99: 976.0}
    assert row.percentiles["queue_wait_ms"][50] == 20.0
    # the fallback interpolates exactly as PostgreSQL does
    fallback = [percentile([100.0, 200.0, 300.0, 400.0, 1000.0], f) for f in (0.5, 0.95, 0.99)]
    assert fallback == [row.percentiles["total_ms"][p] for p in (50, 95, 99)]
    direct = UsageRecord.objects.filter(workload=world.wl_a).aggregate(p=PercentileCont("total_ms", fraction=0.95))
    assert direct["p"] == row.percentiles["total_ms"][95]
    # and the fallback's whole path (rows read, grouped, interpolated) gives the SQL's numbers
    rows_in_range = UsageRecord.objects.filter(filters.ledger_q()).order_by()
    assert _percentiles_python(rows_in_range) == _percentiles_sql(rows_in_range)
    # the rejection was counted only as a sample here (no RejectionStat row):
    # the rates count flushed and pending minutes
    assert row.rejections == 0 and row.success_rate == 0.8 and row.error_rate == 0.2


def test_rejection_rates_use_the_exact_minute_counts(world):
    ledger(world, at=T0 + timedelta(minutes=1))
    RejectionStat.objects.create(minute=T0, tenant=world.tenant_a, workload=world.wl_a, pool=world.pool,
                                 reason="workload_tpm", count=3)
    RejectionStat.objects.create(minute=T0, tenant=world.tenant_b, workload=world.wl_b, pool=world.pool,
                                 reason="workload_tpm", count=7)
    rows = latency_by_workload_lane(filters=LogFilters(start=T0, end=T0 + timedelta(hours=1),
                                                       tenant_ids=frozenset({world.tenant_a.id})))
    by_lane = {r.lane: r for r in rows}
    assert by_lane["—"].rejections == 3 and by_lane["—"].rejection_rate == 1.0
    assert by_lane["interactive"].requests == 1 and by_lane["interactive"].success_rate == 1.0
    assert {r.workload_id for r in rows} == {world.wl_a.id}


def test_cursor_decoding_refuses_garbage():
    assert Cursor.decode("nonsense") is None
    assert Cursor.decode("123.1.notanumber") is None
    assert Cursor.decode("123.7.5") is None
    assert Cursor.decode("99999999999999999999999.1.5") is None
    cursor = Cursor(at=T0 + timedelta(microseconds=7), kind=1, tiebreak="42")
    assert Cursor.decode(cursor.encode()) == cursor


# --- the pages ----------------------------------------------------------------------


def test_member_sees_own_log_and_request_page_with_exact_numbers(world, client):
    key = key_of(world.wl_a)
    now = datetime.now(tz=dt_timezone.utc)
    request_id = ledger(world, at=now - timedelta(minutes=2), key=key, tokens=(1000, 500), timings=(40, 900, 960))
    client.force_login(world.member_a)
    page = client.get(reverse("tenant-request-log", args=[world.tenant_a.slug]), {"range": "1h"})
    assert page.status_code == 200
    body = page.content.decode()
    assert f'data-request-id="{request_id}"' in body
    assert 'data-value="0.00045000"' in body
    assert 'data-timing="total_ms-p50">960 ms' in body
    detail = client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, request_id]))
    assert detail.status_code == 200
    text = detail.content.decode()
    assert "0.000450 USD" in text and "1,500" in text
    assert "started on the pool" in text and "960 ms" in text


def test_tenants_never_see_each_others_requests(world, client):
    now = datetime.now(tz=dt_timezone.utc)
    a_request = ledger(world, at=now - timedelta(minutes=1))
    b_request = ledger(world, at=now - timedelta(minutes=1), workload=world.wl_b)
    client.force_login(world.member_b)
    # another tenant's log and request: 404, not 403
    assert client.get(reverse("tenant-request-log", args=[world.tenant_a.slug])).status_code == 404
    assert client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, a_request])).status_code == 404
    # its own tenant's URL with the other tenant's request id: 404 too
    assert client.get(reverse("tenant-request-detail", args=[world.tenant_b.slug, a_request])).status_code == 404
    # filtering its own log by the other tenant's workload or key: refused, nothing shown
    response = client.get(reverse("tenant-request-log", args=[world.tenant_b.slug]), {"workload": world.wl_a.id})
    assert response.status_code == 400 and a_request not in response.content.decode()
    response = client.get(reverse("tenant-request-log", args=[world.tenant_b.slug]),
                          {"key": key_of(world.wl_a).id})
    assert response.status_code == 400
    own = client.get(reverse("tenant-request-log", args=[world.tenant_b.slug])).content.decode()
    assert b_request in own and a_request not in own
    # the all-tenant log is for admins and finance
    assert client.get(reverse("request-log")).status_code == 403
    assert client.get(reverse("request-detail", args=[a_request])).status_code == 403


def test_finance_reads_every_tenant_and_cannot_write(world, client):
    now = datetime.now(tz=dt_timezone.utc)
    a_request = ledger(world, at=now - timedelta(minutes=1))
    b_request = ledger(world, at=now - timedelta(minutes=1), workload=world.wl_b)
    client.force_login(world.finance)
    body = client.get(reverse("request-log")).content.decode()
    assert a_request in body and b_request in body
    assert client.get(reverse("request-detail", args=[b_request])).status_code == 200
    # finance's writes are refused before any view (tenants.middleware)
    assert client.post(reverse("request-log")).status_code == 403
    assert client.post(reverse("tenant-request-log", args=[world.tenant_a.slug])).status_code == 403
    # and the pages take no writes from anyone
    client.force_login(world.admin)
    assert client.post(reverse("request-log")).status_code == 405


def test_bad_filters_are_a_400_in_the_page_never_a_500(world, client):
    client.force_login(world.member_a)
    url = reverse("tenant-request-log", args=[world.tenant_a.slug])
    for params in ({"range": "forever"}, {"range": "custom", "from": "yesterday"},
                   {"range": "custom", "from": "2026-11-20", "to": "2026-11-19"},
                   {"range": "custom", "from": "2020-01-01", "to": "2026-01-01"},
                   {"status": "exploded"}, {"reason": "DROP TABLE"}, {"workload": "abc"}):
        response = client.get(url, params)
        assert response.status_code == 400, params
    assert client.get(url, {"after": "garbage"}).status_code == 200  # a bad cursor starts at the top
    assert client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, "req_nope"])).status_code == 404


def test_the_log_filters_by_endpoint_and_keeps_the_filter_in_its_paging_link(world, client):
    # given three embeddings, a legacy completion and a chat in the last
    # hour, another tenant's embedding and a rejection (no endpoint recorded)
    now = datetime.now(tz=dt_timezone.utc)
    embedded = [ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=5 - i),
                           output_tokens=0, endpoint=UsageRecord.EMBEDDINGS) for i in range(3)]
    completed = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=1),
                           endpoint=UsageRecord.COMPLETIONS)
    chatted = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(seconds=30))
    ledger_add(workload=world.wl_b, pool=world.pool, at=now - timedelta(minutes=2), endpoint=UsageRecord.EMBEDDINGS)
    sample(world, at=now - timedelta(seconds=10))
    base = dict(start=now - timedelta(hours=1), end=now + timedelta(seconds=1), tenant_ids=frozenset({world.tenant_a.id}))

    def ids(**kw):
        return [e.request_id for e in request_log_page(filters=LogFilters(**base, **kw)).entries]

    # then the selector keeps only that endpoint's ledger rows
    assert ids(endpoint=UsageRecord.EMBEDDINGS) == embedded[::-1]
    assert ids(endpoint=UsageRecord.COMPLETIONS) == [completed]
    assert ids(endpoint=UsageRecord.CHAT_COMPLETIONS) == [chatted]
    assert len(ids()) == 6
    # and the page pages through it two at a time with the filter kept
    client.force_login(world.member_a)
    url = reverse("tenant-request-log", args=[world.tenant_a.slug])
    first = client.get(url, {"range": "1h", "endpoint": UsageRecord.EMBEDDINGS})
    assert first.status_code == 200
    assert [e.request_id for e in first.context["page"].entries][:3] == embedded[::-1]
    assert '<option value="/v1/embeddings" selected>embeddings</option>' in first.content.decode()
    assert "endpoint=%2Fv1%2Fembeddings" in first.context["query"]
    latency = first.context["latency"]
    assert sum(row.requests for row in latency) == 3 and sum(row.rejections for row in latency) == 0


def test_the_log_pages_an_endpoint_filter_through_its_next_link(world, client):
    # given one page and one row of embeddings, chats interleaved
    now = datetime.now(tz=dt_timezone.utc)
    embedded = [ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(seconds=200 - 2 * i),
                           output_tokens=0, endpoint=UsageRecord.EMBEDDINGS) for i in range(PAGE_SIZE + 1)]
    for i in range(5):
        ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(seconds=199 - 2 * i))
    client.force_login(world.member_a)
    url = reverse("tenant-request-log", args=[world.tenant_a.slug])
    # when the first page's "Older requests" link is followed
    first = client.get(url, {"range": "1h", "endpoint": UsageRecord.EMBEDDINGS})
    body = first.content.decode()
    link = body[body.index('id="next-page" href="') + len('id="next-page" href="'):].split('"')[0].replace("&amp;", "&")
    second = client.get(url + link)
    # then the two pages hold every embedding once, and nothing else
    assert "endpoint=%2Fv1%2Fembeddings" in link
    got = [e.request_id for e in first.context["page"].entries + second.context["page"].entries]
    assert got == embedded[::-1]
    assert second.context["page"].next_cursor is None


def test_an_unknown_endpoint_filter_is_a_400_in_the_page(world, client):
    client.force_login(world.member_a)
    url = reverse("tenant-request-log", args=[world.tenant_a.slug])
    for value in ("/v1/files", "embeddings", "x" * 500):
        response = client.get(url, {"endpoint": value})
        assert response.status_code == 400, value
        assert "endpoint:" in response.content.decode()


def test_the_log_and_the_request_page_name_each_requests_endpoint(world, client):
    now = datetime.now(tz=dt_timezone.utc)
    embedded = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=2), model="sim-small",
                          input_tokens=300, output_tokens=0, endpoint="/v1/embeddings")
    chatted = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=1))
    client.force_login(world.member_a)
    body = client.get(reverse("tenant-request-log", args=[world.tenant_a.slug]), {"range": "1h"}).content.decode()
    rows = {request_id: body[body.index(f'data-request-id="{request_id}"'):] for request_id in (embedded, chatted)}
    assert rows[embedded].split("</tr>")[0].count('data-endpoint="/v1/embeddings"') == 1
    assert rows[chatted].split("</tr>")[0].count('data-endpoint="/v1/chat/completions"') == 1
    detail = client.get(reverse("tenant-request-detail", args=[world.tenant_a.slug, embedded])).content.decode()
    assert "· /v1/embeddings" in detail
