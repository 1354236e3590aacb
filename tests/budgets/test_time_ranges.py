"""Time ranges everywhere: the picker's parsing and resolution, reservation
lines as they were at each time, usage visible at every scale, "the last
minute" as a rolling 60 s, spend per workload and per key for members, and
the key that made each request recorded on its ledger row."""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.urls import reverse
from django.utils import timezone

from budgets.admission.estimation import request_estimate
from budgets.admission.buckets import Admission
from budgets.errors import RateLimitSnapshot, Rejected
from budgets.ledger.writer import LedgerEntry, usage_record_write
from budgets.models import Reservation, ReservationVersion, UsageRecord
from budgets.selectors.reservations import ReservationAt, reservation_lines
from budgets.selectors.usage import rolling_minute_tokens, tokens_by_workload_bucket, usage_by_api_key
from budgets.services.reservations import HISTORY_START, reservation_delete, reservation_save
from budgets.web.charts import Series, line_chart
from budgets.web.ranges import RangeError, time_range_from
from gateway.core.request.enqueue import record_build
from gateway.core.request.records import RequestRecord, ledger_entry
from gateway.web.auth import _load_context
from tenants.models import ApiKey
from tests.people import world  # noqa: F401 (fixture)

NOW = datetime(2026, 11, 20, 15, 30, 20, tzinfo=dt_timezone.utc)
SVG = "{http://www.w3.org/2000/svg}"


def write(world, *, at, workload=None, tokens=(100, 50), key=None, endpoint=UsageRecord.CHAT_COMPLETIONS) -> str:
    workload = workload or world.wl_a
    request_id = "req_" + uuid.uuid4().hex
    usage_record_write(entry=LedgerEntry(
        request_id=request_id, created_at=at, tenant_id=workload.tenant_id, workload_id=workload.id,
        pool_id=world.pool.id, model="sim-small", lane="interactive", status="ok", borrowed=False,
        estimated_input_tokens=tokens[0], estimated_output_tokens=64, actual_input_tokens=tokens[0],
        actual_output_tokens=tokens[1], api_key_id=key.id if key else None, endpoint=endpoint))
    return request_id


# --- ranges -------------------------------------------------------------------------


@pytest.mark.parametrize("preset, span, bucket, count", [
    ("1h", timedelta(hours=1), "minute", 61), ("24h", timedelta(hours=24), "hour", 25),
    ("7d", timedelta(days=7), "hour", 169), ("30d", timedelta(days=30), "day", 31),
])
def test_presets_pick_a_resolution_that_fits(preset, span, bucket, count):
    time_range = time_range_from({"range": preset}, now=NOW)
    assert (time_range.start, time_range.end, time_range.bucket) == (NOW - span, NOW, bucket)
    # the first bucket starts before the range (it is whole), the last holds now
    assert len(time_range.buckets()) == count


def test_custom_ranges_are_utc_and_a_day_as_to_includes_it():
    time_range = time_range_from({"range": "custom", "from": "2026-11-01", "to": "2026-11-03"}, now=NOW)
    assert time_range.start == datetime(2026, 11, 1, tzinfo=dt_timezone.utc)
    assert time_range.end == datetime(2026, 11, 4, tzinfo=dt_timezone.utc)
    assert time_range.bucket == "hour" and time_range.query() == "range=custom&from=2026-11-01T00:00&to=2026-11-04T00:00"
    minutes = time_range_from({"range": "custom", "from": "2026-11-20T10:00", "to": "2026-11-20T11:30"}, now=NOW)
    assert (minutes.bucket, len(minutes.buckets())) == ("minute", 90)


@pytest.mark.parametrize("params, message", [
    ({"range": "forever"}, "Unknown range"), ({"range": "custom"}, "'from' must be"),
    ({"range": "custom", "from": "2026-11-20", "to": "2026-11-19"}, "'to' must be after"),
    ({"range": "custom", "from": "2020-01-01", "to": "2026-01-01"}, "at most 400 days"),
    ({"range": "custom", "from": "1900-01-01", "to": "1900-02-01"}, "between 2000 and 2100"),
])
def test_bad_ranges_say_why(params, message):
    with pytest.raises(RangeError, match=message):
        time_range_from(params, now=NOW)


# --- charts -------------------------------------------------------------------------


def test_usage_stays_visible_when_the_reservation_would_dwarf_it():
    # 30 tokens/min of usage against a 100,000 TPM reservation
    svg = ET.fromstring(str(line_chart(labels=["a", "b"], series=[
        Series("used", [20, 30]), Series("reserved TPM", [100_000, 100_000], dashed=True, scales=False)], title="t")))
    labels = [t.text for t in svg.iter(f"{SVG}text")]
    assert "40" in labels and "100k" not in labels  # the axis fits the usage (30 x 1.02 -> 40)
    assert "reserved TPM (above the chart: up to 100k)" in labels
    assert len(list(svg.iter(f"{SVG}polyline"))) == 1  # the off-chart line is not pinned to the top edge
    # when usage is within a few times the reservation, the line is on the chart
    svg = ET.fromstring(str(line_chart(labels=["a", "b"], series=[
        Series("used", [20, 30]), Series("reserved TPM", [50, 100], dashed=True, scales=False)], title="t")))
    assert "reserved TPM" in [t.text for t in svg.iter(f"{SVG}text")]


def test_a_reference_line_breaks_where_there_was_no_reservation():
    svg = ET.fromstring(str(line_chart(labels=list("abcd"), series=[
        Series("reserved", [None, 5, 5, None], dashed=True, scales=False)], title="t")))
    lines = list(svg.iter(f"{SVG}polyline"))
    assert len(lines) == 1 and len(lines[0].get("points").split()) == 2
    assert lines[0].get("stroke-dasharray") == "5 4"


# --- reservation history -----------------------------------------------------------


@pytest.mark.django_db
def test_the_services_write_every_version_and_lines_read_them_back(world):
    # given a reservation from before the history (written directly), then
    # changed twice through the services, then removed
    res = Reservation.objects.get(workload=world.wl_a)
    res.reserved_tpm, res.ceiling_tpm = 40_000, 60_000
    reservation_save(reservation=res)
    res.reserved_tpm, res.ceiling_tpm = 60_000, 90_000
    reservation_save(reservation=res)
    reservation_delete(reservation=res)
    versions = list(ReservationVersion.objects.order_by("id"))
    # the first change first records what it replaced, from the start of the history
    assert [(v.reserved_tpm, v.ceiling_tpm, v.deleted) for v in versions] == [
        (100_000, 150_000, False), (40_000, 60_000, False), (60_000, 90_000, False), (60_000, 90_000, True)]
    assert versions[0].valid_from == HISTORY_START
    # when read at times around them
    times = [versions[1].valid_from - timedelta(microseconds=1), versions[1].valid_from, versions[2].valid_from,
             versions[3].valid_from + timedelta(seconds=1)]
    lines = reservation_lines(workload_ids=[world.wl_a.id, world.wl_b.id], times=times,
                              current={world.wl_b.id: Reservation.objects.get(workload=world.wl_b)})
    # then each time gets the version in force then; none after the delete
    assert lines[world.wl_a.id] == [ReservationAt(100_000, 150_000), ReservationAt(40_000, 60_000),
                                    ReservationAt(60_000, 90_000), None]
    # a reservation with no history is drawn at its current numbers
    assert lines[world.wl_b.id] == [ReservationAt(50_000, 80_000)] * 4
    # a reservation created through the services has no line before it was
    created = ReservationVersion.objects.create(workload=world.wl_b, pool=world.pool, reserved_tpm=7, ceiling_tpm=9,
                                                rpm=1, valid_from=versions[3].valid_from + timedelta(hours=1))
    times = [created.valid_from - timedelta(seconds=1), created.valid_from]
    assert reservation_lines(workload_ids=[world.wl_b.id], times=times, current={})[world.wl_b.id] == [
        None, ReservationAt(7, 9)]


# --- usage -------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_last_minute_is_a_rolling_60_seconds(world):
    write(world, at=NOW - timedelta(seconds=61))  # outside
    write(world, at=NOW - timedelta(seconds=59), tokens=(1000, 0))  # previous calendar minute, inside
    write(world, at=NOW - timedelta(seconds=5), tokens=(10, 0))
    write(world, at=NOW - timedelta(seconds=5), workload=world.wl_b, tokens=(7, 0))
    assert rolling_minute_tokens(now=NOW, workload_ids=[world.wl_a.id]) == {world.wl_a.id: 1010}
    assert rolling_minute_tokens(now=NOW, pool=world.pool) == {world.wl_a.id: 1010, world.wl_b.id: 7}


@pytest.mark.django_db
def test_buckets_sum_the_ledger_at_every_resolution(world):
    write(world, at=NOW - timedelta(minutes=1), tokens=(100, 0))
    write(world, at=NOW - timedelta(minutes=1, seconds=10), tokens=(200, 0))
    write(world, at=NOW - timedelta(hours=2), tokens=(400, 0))
    write(world, at=NOW - timedelta(days=2), tokens=(800, 0))
    wid = world.wl_a.id
    minute = tokens_by_workload_bucket(workload_ids=[wid], start=NOW - timedelta(hours=1), end=NOW, bucket="minute")
    assert minute[wid] == {datetime(2026, 11, 20, 15, 29, tzinfo=dt_timezone.utc): 300}
    hour = tokens_by_workload_bucket(workload_ids=[wid], start=NOW - timedelta(days=1), end=NOW, bucket="hour")
    assert hour[wid] == {datetime(2026, 11, 20, 15, tzinfo=dt_timezone.utc): 300,
                         datetime(2026, 11, 20, 13, tzinfo=dt_timezone.utc): 400}
    day = tokens_by_workload_bucket(workload_ids=[wid], start=NOW - timedelta(days=30), end=NOW, bucket="day")
    assert day[wid] == {datetime(2026, 11, 20, tzinfo=dt_timezone.utc): 700,
                        datetime(2026, 11, 18, tzinfo=dt_timezone.utc): 800}


# --- API keys on the ledger --------------------------------------------------------


@pytest.mark.django_db
def test_the_key_that_made_a_request_reaches_its_ledger_row(world):
    key = ApiKey.objects.get(workload=world.wl_a)
    # the web side's context carries the key
    cached, _expires_in = _load_context(world.key_a)
    ctx = cached.context
    assert ctx.api_key_id == key.id
    # through the request record (and its Redis form) to the ledger entry
    record = record_build(ctx, request_id="req_" + uuid.uuid4().hex, model="sim-small", payload={},
                          estimate=request_estimate(messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                                    prompt_tokens_cap=100, max_tokens_cap=100, max_tokens_default=10,
                                                    encoding_name="cl100k_base"),
                          admission=Admission(request_id="r", pool_id=world.pool.id, workload_id=world.wl_a.id,
                                              input_tokens=1, output_tokens=10, borrowed=False,
                                              rate_limits=RateLimitSnapshot(0, 0, 0, 0),
                                              admitted_ms=NOW.timestamp() * 1000),
                          deadline_ms=0, retry_deadline_ms=0)
    again = RequestRecord.from_redis(record.to_redis())
    assert again.api_key_id == key.id
    usage_record_write(entry=ledger_entry(again, status="ok", actual_input_tokens=10, actual_output_tokens=5))
    assert UsageRecord.objects.get(request_id=record.request_id).api_key_id == key.id
    # a record without a key (a cron firing) writes none
    keyless = RequestRecord.from_redis({**record.to_redis(), "api_key_id": "0", "request_id": "req_nokey"})
    assert ledger_entry(keyless, status="ok").api_key_id is None


@pytest.mark.django_db
def test_usage_per_key_is_summed_from_the_ledger_in_range(world):
    key = ApiKey.objects.get(workload=world.wl_a)
    write(world, at=NOW - timedelta(minutes=5), key=key, tokens=(1000, 500))
    write(world, at=NOW - timedelta(minutes=6), key=key, tokens=(1000, 500))
    write(world, at=NOW - timedelta(days=3), key=key, tokens=(1000, 500))  # outside the range
    write(world, at=NOW - timedelta(minutes=5), tokens=(1000, 500))  # no key
    usage = usage_by_api_key(tenant_ids=frozenset({world.tenant_a.id}), start=NOW - timedelta(hours=24), end=NOW)
    assert list(usage) == [key.id]
    assert (usage[key.id].requests, usage[key.id].tokens, str(usage[key.id].cost)) == (2, 3000, "0.00090000")
    assert usage_by_api_key(tenant_ids=frozenset({world.tenant_b.id}), start=NOW - timedelta(days=5), end=NOW) == {}


@pytest.mark.django_db
def test_usage_per_key_is_split_by_endpoint_and_adds_up_to_its_total(world):
    # given one key's chat, embeddings and legacy completions in range, and
    # an embedding outside it
    key = ApiKey.objects.get(workload=world.wl_a)
    for _ in range(2):
        write(world, at=NOW - timedelta(minutes=5), key=key, tokens=(1000, 500))
    for _ in range(3):
        write(world, at=NOW - timedelta(minutes=4), key=key, tokens=(300, 0), endpoint=UsageRecord.EMBEDDINGS)
    write(world, at=NOW - timedelta(minutes=3), key=key, tokens=(200, 100), endpoint=UsageRecord.COMPLETIONS)
    write(world, at=NOW - timedelta(days=3), key=key, tokens=(9000, 0), endpoint=UsageRecord.EMBEDDINGS)
    # when
    usage = usage_by_api_key(tenant_ids=frozenset({world.tenant_a.id}), start=NOW - timedelta(hours=24), end=NOW)[key.id]
    # then most-used first, each with its own requests, tokens and cost
    # (sim-small: 0.15 in, 0.60 out per million), summing to the key's total
    parts = [(p.label, p.requests, p.tokens, str(p.cost)) for p in usage.by_endpoint]
    assert parts == [("embeddings", 3, 900, "0.00013500"), ("chat/completions", 2, 3000, "0.00090000"),
                     ("completions", 1, 300, "0.00009000")]
    assert (usage.requests, usage.tokens, str(usage.cost)) == (6, 4200, "0.00112500")


@pytest.mark.django_db
def test_the_keys_table_shows_each_keys_usage_by_endpoint(world, client):
    key = ApiKey.objects.get(workload=world.wl_a)
    now = timezone.now()
    write(world, at=now - timedelta(minutes=10), key=key, tokens=(1000, 500))
    write(world, at=now - timedelta(minutes=9), key=key, tokens=(400, 0), endpoint=UsageRecord.EMBEDDINGS)
    write(world, at=now - timedelta(minutes=9), key=key, tokens=(400, 0), endpoint=UsageRecord.EMBEDDINGS)
    client.force_login(world.member_a)
    body = client.get(reverse("tenant-detail", args=[world.tenant_a.slug]), {"range": "1h"}).content.decode()
    assert 'data-endpoint="/v1/embeddings" data-requests="2" data-tokens="800">embeddings: 2 req, 800 tok' in body
    assert 'data-endpoint="/v1/chat/completions" data-requests="1" data-tokens="1500">chat/completions: 1 req' in body
    assert 'data-endpoint="/v1/completions"' not in body


# --- rejection samples ---------------------------------------------------------------


def test_a_prompt_over_its_cap_carries_its_estimate():
    with pytest.raises(Rejected) as caught:
        request_estimate(messages=[{"role": "user", "content": "word " * 300}], max_tokens=10, prompt_tokens_cap=50,
                         max_tokens_cap=100, max_tokens_default=10, encoding_name="cl100k_base")
    rejected = caught.value
    assert rejected.reason == "context_length_exceeded"
    assert rejected.estimated_tokens > 50
    assert f"resulted in {rejected.estimated_tokens} tokens" in rejected.message


# --- the tenant page ----------------------------------------------------------------


@pytest.mark.django_db
def test_members_see_spend_per_workload_and_key_for_the_range(world, client):
    key = ApiKey.objects.get(workload=world.wl_a)
    now = timezone.now()
    write(world, at=now - timedelta(minutes=10), key=key, tokens=(1000, 500))
    write(world, at=now - timedelta(seconds=20), key=key, tokens=(2000, 1000))
    write(world, at=now - timedelta(minutes=10), workload=world.wl_b, tokens=(9999, 0))
    client.force_login(world.member_a)
    body = client.get(reverse("tenant-detail", args=[world.tenant_a.slug]), {"range": "1h"}).content.decode()
    # 3000 + 1500 tokens; 0.15/M in, 0.60/M out
    assert 'id="range-total-tokens">4,500<' in body
    assert 'id="range-total-cost" data-value="0.00135000">0.001350 USD<' in body
    assert 'class="num key-requests" data-value="2"' in body and 'class="num key-cost" data-value="0.00135000"' in body
    assert 'class="used-last-minute" data-value="3000"' in body
    assert "rolling 60 s" in body and "9,999" not in body
    # a bad range is a 400 in the page, another tenant's page a 404
    assert client.get(reverse("tenant-detail", args=[world.tenant_a.slug]), {"range": "x"}).status_code == 400
    assert client.get(reverse("tenant-detail", args=[world.tenant_b.slug]), {"range": "1h"}).status_code == 404


@pytest.mark.django_db
def test_pool_page_draws_usage_over_the_range_for_admins_only(world, client):
    now = timezone.now()
    write(world, at=now - timedelta(minutes=3), tokens=(6000, 0))
    write(world, at=now - timedelta(minutes=3), workload=world.wl_b, tokens=(3000, 0))
    client.force_login(world.admin)
    response = client.get(reverse("pool-detail", args=[world.pool.slug]), {"range": "1h"})
    assert response.status_code == 200
    svg = ET.fromstring(str(response.context["range_chart"]))
    # both workloads' tokens in one minute bucket: 9,000 tokens/min
    assert any("9k" in (t.text or "") for t in svg.iter(f"{SVG}title"))
    labels = [t.text for t in svg.iter(f"{SVG}text")]
    # the reserved sum (150k) dwarfs 9k/min: off the chart, said in the legend
    assert "reserved (sum, as it was) (above the chart: up to 150k)" in labels
    assert client.get(reverse("pool-detail", args=[world.pool.slug]), {"range": "nope"}).status_code == 400
    client.force_login(world.member_a)
    assert client.get(reverse("pool-detail", args=[world.pool.slug])).status_code == 403
