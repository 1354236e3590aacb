"""The finance page's time range: last hour and last 24 h next to the day
presets, a custom UTC from/to given as a date or a date and time, sub-day
edges summed from the ledger in [start, end) and whole days from the
rollups, a spend chart whose buckets fit the range, and a CSV export whose
rows are the page's totals for every range."""

from __future__ import annotations

import csv
import io
import re
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.utils import timezone

from budgets.ledger.pricing import price_table_currency
from budgets.models import DailyUsage, RollupState, UsageRecord
from budgets.selectors.usage import UsageFilters, ledger_rows, spend_by_time, usage_summary
from tests.people import ledger_add

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 10, tzinfo=dt_timezone.utc)


def page_totals(client, query: str) -> tuple[int, int, Decimal, str]:
    response = client.get(f"/finance/?{query}")
    assert response.status_code == 200, response.content.decode()[:500]
    body = response.content.decode()
    requests = int(re.search(r'id="total-requests" data-value="(\d+)"', body).group(1))
    actual = int(re.search(r'id="total-actual" data-value="(\d+)"', body).group(1))
    cost = Decimal(re.search(r'id="total-cost" data-value="([\d.]+)"', body).group(1))
    return requests, actual, cost, body


def export_rows(client, query: str) -> list[dict]:
    response = client.get(f"/finance/ledger.csv?{query}")
    assert response.status_code == 200 and response.streaming
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def chart_buckets(body: str) -> tuple[str, int]:
    found = re.search(r'id="spend-chart" data-bucket="(\w+)" data-buckets="(\d+)"', body)
    return found.group(1), int(found.group(2))


def ledger_cost(request_ids: list[str]) -> Decimal:
    return sum((r.cost for r in UsageRecord.objects.filter(request_id__in=request_ids)), Decimal(0))


def test_last_hour_includes_59_minutes_ago_and_excludes_61(login, world):
    now = timezone.now()
    inside = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=59), input_tokens=120,
                        output_tokens=30)
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=61), input_tokens=700)
    client = login(world.finance)
    requests, actual, cost, body = page_totals(client, "period=last_hour&group_by=workload")
    assert (requests, actual, cost) == (1, 150, ledger_cost([inside]))
    assert chart_buckets(body) == ("minute", 61)  # 60 whole minutes and the partial one the range starts in
    rows = export_rows(client, "period=last_hour&group_by=workload")
    assert [r["request_id"] for r in rows] == [inside]


def test_last_24_hours_counts_the_ledger_rows_of_the_last_24_hours(login, world):
    now = timezone.now()
    kept = [ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(hours=h)) for h in (1, 23)]
    kept.append(ledger_add(workload=world.wl_b, pool=world.pool, at=now - timedelta(hours=23, minutes=59),
                           model="sim-large", input_tokens=200, output_tokens=80))
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(hours=24, minutes=1))
    client = login(world.finance)
    requests, actual, cost, body = page_totals(client, "period=last_24_hours")
    assert (requests, actual, cost) == (3, 150 + 150 + 280, ledger_cost(kept))
    assert chart_buckets(body) == ("hour", 25)
    assert sorted(r["request_id"] for r in export_rows(client, "period=last_24_hours")) == sorted(kept)


def test_a_custom_time_range_is_half_open_utc_and_the_csv_equals_the_page(login, world):
    at_start = ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=10))
    inside = ledger_add(workload=world.wl_b, pool=world.pool, at=DAY + timedelta(hours=11, minutes=59, seconds=59),
                        model="sim-large", input_tokens=200, output_tokens=80)
    ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=12))  # the end: excluded
    ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=9, minutes=59, seconds=59))
    client = login(world.finance)
    query = "start=2026-11-10T10:00&end=2026-11-10T12:00&group_by=model"
    requests, actual, cost, body = page_totals(client, query)
    assert (requests, actual, cost) == (2, 150 + 280, ledger_cost([at_start, inside]))
    assert chart_buckets(body) == ("minute", 120)
    assert "2026-11-10 10:00 — 2026-11-10 12:00 UTC" in body
    assert f"Spend ({price_table_currency()}) per UTC minute" in body
    rows = export_rows(client, query)
    assert sorted(r["request_id"] for r in rows) == sorted([at_start, inside])
    assert len(rows) == requests
    assert sum(Decimal(r["cost"]) for r in rows) == cost
    assert sum(int(r["actual_input_tokens"]) + int(r["actual_output_tokens"]) for r in rows) == actual
    # the same hours written with a space, and a date-only "to" that includes its whole day
    assert page_totals(client, "start=2026-11-10 10:00&end=2026-11-10 12:00")[0] == 2
    assert page_totals(client, "start=2026-11-10T10:00&end=2026-11-10")[0] == 3


def test_partial_days_come_from_the_ledger_and_whole_days_from_the_rollups(world):
    # rollups for four days (the ledger row on 11-11 is deliberately not in them:
    # a whole day must be read from its rollup, a partial one from the ledger)
    for offset in range(4):
        DailyUsage.objects.create(day=(DAY + timedelta(days=offset)).date(), tenant=world.tenant_a, workload=world.wl_a,
                                  pool=world.pool, model="sim-small", requests=10, ok_requests=10,
                                  actual_input_tokens=1000, actual_output_tokens=100, estimated_input_tokens=1000,
                                  estimated_output_tokens=200, cost=Decimal("0.01"))
    RollupState.objects.update_or_create(name="daily_usage", defaults={"final_through": date(2026, 11, 20)})
    first = ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=18))
    last = ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(days=3, hours=5, minutes=59))
    ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=17, minutes=59))
    middle = ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(days=1, hours=12))
    ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(days=3, hours=6))
    start_at, end_at = DAY + timedelta(hours=18), DAY + timedelta(days=3, hours=6)
    filters = UsageFilters(start=start_at.date(), end=end_at.date(), start_at=start_at, end_at=end_at)

    by_day = usage_summary(filters=filters, group_by=("day",))
    assert [(r.label, r.requests) for r in by_day.rows] == [
        ("2026-11-10", 1), ("2026-11-11", 10), ("2026-11-12", 10), ("2026-11-13", 1)]
    assert by_day.total.cost == Decimal("0.02") + ledger_cost([first, last])
    assert spend_by_time(filters=filters, bucket="day") == {
        DAY: ledger_cost([first]), DAY + timedelta(days=1): Decimal("0.01"), DAY + timedelta(days=2): Decimal("0.01"),
        DAY + timedelta(days=3): ledger_cost([last])}
    # the export is the ledger rows in [start, end), whatever the rollups hold
    assert sorted(ledger_rows(filters=filters).values_list("request_id", flat=True)) == sorted([first, middle, last])


def test_hour_buckets_sum_the_ledger_rows_in_each_utc_hour(world):
    ids = [ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=h, minutes=m))
           for h, m in ((1, 0), (1, 59), (3, 30))]
    ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(hours=5))  # the end: excluded
    filters = UsageFilters(start=DAY.date(), end=DAY.date(), start_at=DAY + timedelta(hours=1),
                           end_at=DAY + timedelta(hours=5))
    assert spend_by_time(filters=filters, bucket="hour") == {
        DAY + timedelta(hours=1): ledger_cost(ids[:2]), DAY + timedelta(hours=3): ledger_cost(ids[2:])}


@pytest.mark.parametrize("query, bucket, count", [
    ("start=2026-11-01&end=2026-11-07", "day", 7),  # whole days: per day, from the rollups
    ("start=2026-11-01T00:30&end=2026-11-08T00:30", "hour", 7 * 24 + 1),
    ("start=2026-11-01T00:00&end=2026-11-02T00:00", "day", 1),
    ("start=2026-10-01&end=2026-10-30", "day", 30),
    ("start=2026-01-01&end=2026-12-31", "month", 12),
    ("start=2026-11-10T10:00&end=2026-11-10T10:05", "minute", 5),
])
def test_the_spend_chart_picks_buckets_that_fit_the_range(login, world, query, bucket, count):
    _requests, _actual, _cost, body = page_totals(login(world.finance), query)
    assert chart_buckets(body) == (bucket, count)
    assert f"per UTC {bucket}" in body


@pytest.mark.parametrize("period", ["this_month", "last_month", "last_7_days", "last_30_days", "this_year",
                                    "last_hour", "last_24_hours"])
def test_every_period_link_is_answered_and_exported(login, world, period):
    client = login(world.finance)
    body = page_totals(client, f"period={period}")[3]
    assert f'data-period="{period}"' in body
    assert client.get(f"/finance/ledger.csv?period={period}").status_code == 200


@pytest.mark.parametrize("query", [
    "start=2026-11-10T25:00", "start=2026-11-10T12:00&end=2026-11-10T12:00",
    "start=2026-11-10T12:00&end=2026-11-10T11:59", "start=10:00", "end=2101-01-01T00:00",
])
def test_bad_custom_times_are_a_400(login, world, query):
    client = login(world.finance)
    assert client.get(f"/finance/?{query}").status_code == 400
    assert client.get(f"/finance/ledger.csv?{query}").status_code == 400
