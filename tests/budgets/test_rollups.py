"""Daily rollups: rebuilt from the ledger idempotently and incrementally;
pages read them for final days and the ledger only for the last day or two,
so their totals equal the raw rows."""

from __future__ import annotations

import threading
import time
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models import Count, F, Sum
from django.test.utils import CaptureQueriesContext

from budgets.models import DailyUsage, RollupState, UsageRecord
from budgets.ledger.rollups import daily_usage_refresh, final_through_at
from budgets.selectors.usage import UsageFilters, ledger_rows, usage_summary
from tests.people import ledger_add, ledger_spread, world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=dt_timezone.utc)


def ledger_totals(queryset):
    return queryset.aggregate(n=Count("id"), tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")),
                              cost=Sum("cost"))


def test_refresh_builds_one_row_per_day_workload_and_model(world):
    ledger_spread(world=world, now=NOW, days=4, per_day=3)
    result = daily_usage_refresh(now=NOW)
    assert DailyUsage.objects.count() == 8  # 4 days x 2 workloads (one model each)
    assert sorted(result.days) == [date(2026, 11, 17), date(2026, 11, 18), date(2026, 11, 19), date(2026, 11, 20)]
    assert result.final_through == date(2026, 11, 19)
    row = DailyUsage.objects.get(day=date(2026, 11, 18), workload=world.wl_a)
    direct = ledger_totals(UsageRecord.objects.filter(workload=world.wl_a, created_at__date=date(2026, 11, 18)))
    assert row.requests == direct["n"] == 3
    assert row.actual_input_tokens + row.actual_output_tokens == direct["tokens"]
    assert row.cost == direct["cost"]


def test_refresh_is_idempotent_and_incremental(world):
    ledger_spread(world=world, now=NOW, days=2, per_day=2)
    daily_usage_refresh(now=NOW)
    snapshot = list(DailyUsage.objects.order_by("id").values())
    daily_usage_refresh(now=NOW)
    assert list(DailyUsage.objects.order_by("id").values()) == snapshot
    # a new row for today updates today's rollup only
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(minutes=1), input_tokens=1000, output_tokens=1)
    daily_usage_refresh(now=NOW + timedelta(minutes=1))
    today = DailyUsage.objects.get(day=NOW.date(), workload=world.wl_a)
    assert today.requests == 3 and today.actual_input_tokens == 100 + 101 + 1000
    assert RollupState.objects.get().last_ledger_id == UsageRecord.objects.order_by("-id").first().id


def test_a_day_becomes_final_only_after_the_lag():
    assert final_through_at(datetime(2026, 11, 20, 5, 59, tzinfo=dt_timezone.utc)) == date(2026, 11, 18)
    assert final_through_at(datetime(2026, 11, 20, 6, 1, tzinfo=dt_timezone.utc)) == date(2026, 11, 19)


def test_late_row_for_a_recent_day_is_picked_up(world):
    ledger_spread(world=world, now=NOW, days=2, per_day=1)
    daily_usage_refresh(now=NOW)
    # a row stamped yesterday (not final yet) but written now
    ledger_add(workload=world.wl_b, pool=world.pool, at=NOW - timedelta(days=1, hours=2), model="sim-large",
               input_tokens=7, output_tokens=0)
    daily_usage_refresh(now=NOW)
    row = DailyUsage.objects.get(day=(NOW - timedelta(days=1, hours=2)).date(), workload=world.wl_b)
    assert row.requests == 2


def test_a_refresh_with_no_new_rows_reads_no_ledger_day(world):
    # given a ledger rolled up, today's and yesterday's days not final yet
    ledger_spread(world=world, now=NOW, days=3, per_day=2)
    daily_usage_refresh(now=NOW)
    snapshot = list(DailyUsage.objects.order_by("id").values())
    # when the refresh runs again a minute later with no new row
    with CaptureQueriesContext(connection) as queries:
        result = daily_usage_refresh(now=NOW + timedelta(minutes=1))
    # then it rebuilds no day: an idle minute does not scan the day's rows
    assert result.days == [] and result.rows == 0
    assert not [q["sql"] for q in queries.captured_queries if "GROUP BY" in q["sql"].upper()]
    assert list(DailyUsage.objects.order_by("id").values()) == snapshot


def test_a_busy_day_not_final_yet_gets_its_new_rows_added_without_reading_the_day_again(world):
    # given today's rollup (not final), and a minute's new rows of today
    ledger_spread(world=world, now=NOW, days=1, per_day=3)
    daily_usage_refresh(now=NOW)
    for minutes in (3, 2, 1):
        ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(minutes=minutes), input_tokens=1000,
                   output_tokens=minutes, overflow=minutes == 1)
    ledger_add(workload=world.wl_b, pool=world.pool, at=NOW - timedelta(minutes=1), model="sim-other",
               input_tokens=5, output_tokens=5)
    # when the next run comes
    with CaptureQueriesContext(connection) as queries:
        result = daily_usage_refresh(now=NOW + timedelta(minutes=1))
    # then it adds the new rows' sums to today's rows (a new group gets its
    # row) and reads none of today's older rows: no query by the day's bounds
    assert result.days == [] and result.days_added == [NOW.date()]
    assert not [q["sql"] for q in queries.captured_queries if "created_at" in q["sql"] and ">=" in q["sql"]]
    # and every row of the day equals what the ledger sums for its group
    for row in DailyUsage.objects.filter(day=NOW.date()):
        group = UsageRecord.objects.filter(workload=row.workload_id, model=row.model, created_at__date=NOW.date())
        direct = ledger_totals(group)
        assert (row.requests, row.actual_input_tokens + row.actual_output_tokens, row.cost) \
            == (direct["n"], direct["tokens"], direct["cost"])
        assert row.overflow_requests == group.filter(overflow=True).count()
        assert row.overflow_cost == (group.filter(overflow=True).aggregate(c=Sum("cost"))["c"] or 0)
    assert DailyUsage.objects.get(day=NOW.date(), workload=world.wl_a).requests == 3 + 3
    assert DailyUsage.objects.get(day=NOW.date(), workload=world.wl_b, model="sim-other").requests == 1


@pytest.mark.django_db(transaction=True)
def test_runs_at_once_add_each_new_row_once(world):
    # given today's rollup and new rows of today
    ledger_spread(world=world, now=NOW, days=1, per_day=2)
    daily_usage_refresh(now=NOW)
    for _ in range(3):
        ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(minutes=1), input_tokens=10,
                   output_tokens=1)
    # when two runs start while a third holds the state row (their additions
    # would both go in if they read the mark without waiting for it)
    held, release = threading.Event(), threading.Event()
    failures: list[str] = []

    def holder() -> None:
        try:
            with transaction.atomic():
                RollupState.objects.select_for_update().get()
                held.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    def run() -> None:
        try:
            daily_usage_refresh(now=NOW + timedelta(minutes=1))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert held.wait(timeout=30)
    threads += [threading.Thread(target=run) for _ in range(2)]
    for thread in threads[1:]:
        thread.start()
    time.sleep(0.5)  # both runs reach the state row and wait there
    release.set()
    for thread in threads:
        thread.join(timeout=60)
    # then each new row is counted once
    assert not failures
    row = DailyUsage.objects.get(day=NOW.date(), workload=world.wl_a)
    assert row.requests == UsageRecord.objects.filter(workload=world.wl_a, created_at__date=NOW.date()).count() == 5


def test_a_row_that_committed_below_the_mark_is_rolled_up_when_its_day_turns_final(world):
    # given today's rollup
    ledger_spread(world=world, now=NOW, days=1, per_day=2)
    daily_usage_refresh(now=NOW)
    # and a row of today that committed after the next run read the highest
    # id, below it (as a transaction that took its id earlier and committed
    # later does): the run marks it read without seeing it
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(minutes=1), input_tokens=1000, output_tokens=1)
    RollupState.objects.update(last_ledger_id=UsageRecord.objects.order_by("-id").first().id)
    daily_usage_refresh(now=NOW + timedelta(minutes=1))
    day_row = DailyUsage.objects.get(day=NOW.date(), workload=world.wl_a)
    assert day_row.requests == 2  # not final: nobody reads it as complete yet
    # when the day turns final
    later = NOW + timedelta(days=1, hours=7)
    result = daily_usage_refresh(now=later)
    # then it is rebuilt once more, with every row
    assert NOW.date() in result.days and result.final_through == NOW.date()
    day_row.refresh_from_db()
    direct = ledger_totals(UsageRecord.objects.filter(workload=world.wl_a, created_at__date=NOW.date()))
    assert day_row.requests == direct["n"] == 3
    assert day_row.actual_input_tokens + day_row.actual_output_tokens == direct["tokens"]
    # and a refresh after that one rebuilds nothing
    assert daily_usage_refresh(now=later + timedelta(minutes=1)).days == []


@pytest.mark.parametrize("group_by", [("tenant",), ("cost_center",), ("workload",), ("model",), ("endpoint",), ("day",),
                                      ("month",), ("tenant", "model")])
def test_summary_equals_the_ledger_rows_across_final_and_live_days(world, group_by):
    # given 10 days of ledger, rolled up yesterday (so the last days are live)
    ledger_spread(world=world, now=NOW, days=10, per_day=2)
    daily_usage_refresh(now=NOW - timedelta(days=1))
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(minutes=3), input_tokens=5, output_tokens=5)
    filters = UsageFilters(start=NOW.date() - timedelta(days=6), end=NOW.date())
    # when the summary is asked
    summary = usage_summary(filters=filters, group_by=group_by)
    # then its totals are those of the raw rows the export streams
    direct = ledger_totals(ledger_rows(filters=filters))
    assert summary.total.requests == direct["n"]
    assert summary.total.actual_tokens == direct["tokens"]
    assert summary.total.cost == direct["cost"]
    assert summary.final_through == final_through_at(NOW - timedelta(days=1))
    assert sum(r.cost for r in summary.rows) == direct["cost"]


def test_summary_reads_final_days_from_rollups_not_the_ledger(world):
    ledger_spread(world=world, now=NOW, days=10, per_day=2)
    daily_usage_refresh(now=NOW)
    filters = UsageFilters(start=NOW.date() - timedelta(days=9), end=NOW.date() - timedelta(days=2))  # all final
    with CaptureQueriesContext(connection) as queries:
        summary = usage_summary(filters=filters, group_by=("tenant",))
    assert summary.total.requests == 8 * 2 * 2
    assert not any("budgets_usagerecord" in q["sql"] for q in queries.captured_queries)


def test_scope_limits_a_summary_to_the_callers_tenants(world):
    ledger_spread(world=world, now=NOW, days=3, per_day=1)
    daily_usage_refresh(now=NOW)
    filters = UsageFilters(start=NOW.date() - timedelta(days=5), end=NOW.date(), tenant_ids=frozenset({world.tenant_a.id}))
    summary = usage_summary(filters=filters, group_by=("tenant",))
    assert [row.key["tenant"] for row in summary.rows] == [world.tenant_a.id]
    assert summary.total.cost == ledger_totals(UsageRecord.objects.filter(tenant=world.tenant_a))["cost"]
    assert summary.total.cost > Decimal(0)


def test_finance_groups_by_endpoint_across_final_and_live_days(world):
    # given chat rows and embeddings rows, some days rolled up and one live
    ledger_spread(world=world, now=NOW, days=3, per_day=1)
    for days_ago in (2, 0):
        ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(days=days_ago, minutes=5),
                   input_tokens=300, output_tokens=0, estimated_output=0, endpoint="/v1/embeddings")
    daily_usage_refresh(now=NOW - timedelta(hours=12))
    filters = UsageFilters(start=NOW.date() - timedelta(days=5), end=NOW.date())
    # when finance groups by endpoint
    summary = usage_summary(filters=filters, group_by=("endpoint",))
    # then each endpoint's row holds exactly its ledger rows
    by_endpoint = {row.label: row for row in summary.rows}
    assert set(by_endpoint) == {"/v1/chat/completions", "/v1/embeddings"}
    for endpoint, row in by_endpoint.items():
        direct = ledger_totals(UsageRecord.objects.filter(endpoint=endpoint))
        assert (row.requests, row.actual_tokens, row.cost) == (direct["n"], direct["tokens"], direct["cost"])
    assert by_endpoint["/v1/embeddings"].requests == 2
    assert by_endpoint["/v1/embeddings"].actual_tokens == 600
    # and the rollups keep the endpoint apart: one row per day that had embeddings
    assert sorted(DailyUsage.objects.filter(endpoint="/v1/embeddings").values_list("day", flat=True)) == [
        (NOW - timedelta(days=2, minutes=5)).date(), (NOW - timedelta(minutes=5)).date()]
