"""Daily usage rollups: the ledger summed per UTC day and (tenant, workload,
pool, model, endpoint), so pages read a few hundred rows instead of a year of ledger.

``daily_usage_refresh`` runs every minute and reads only what is new since
its last run (ledger ids above its high-water mark, on the primary-key index):

* a day not final yet gets the new rows' sums **added** to its groups' rows,
  so a busy day costs each run its last minute of rows, not the whole day
  again (a scan that grows with the day's traffic);
* every day that became *final* since the last run is **rebuilt** from all
  its rows, once: a ledger row is stamped with its admission time but may be
  written minutes later (queue timeout + upstream timeout + lease reaping),
  and a transaction may commit an id below the mark after it was read, so a
  day's rows are all there only once it is older than ``FINAL_LAG``. The
  rebuild takes them all, and replaces whatever the additions summed;
* a final day that new rows touch anyway is rebuilt too, and so is every
  day a first run sees (nothing was added before it).

A day not final yet may miss a row that committed below the mark until it
turns final, and nobody reads it as complete before then. A run with no new
rows reads no ledger day: an idle platform's minute costs a look at the
highest id. A run is one transaction with the state row locked: its
additions and its mark commit together, so a run that fails adds nothing,
and two runs at once add nothing twice.

``RollupState.final_through`` tells readers which days are complete: pages
read DailyUsage up to it and the (at most a couple of) later days live from
the ledger, so what a page shows equals what the ledger export sums."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time as dt_time, timedelta, timezone as dt_timezone

from django.db import transaction
from django.db.models import Count, F, Max, Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from budgets.models import DailyUsage, RollupState, UsageRecord

STATE_NAME = "daily_usage"
# Longer than any request can take from admission to its ledger row (queue
# timeout + upstream timeout + lease expiry and reaping), with a wide margin.
FINAL_LAG = timedelta(hours=6)

GROUP_FIELDS = ("tenant_id", "workload_id", "pool_id", "model", "endpoint")
SUM_FIELDS = ("estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens", "actual_output_tokens", "cost")


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, dt_time.min, tzinfo=dt_timezone.utc)
    return start, start + timedelta(days=1)


def ledger_aggregates(queryset, *, by_day: bool = True, group_fields: tuple[str, ...] = GROUP_FIELDS):
    """Ledger rows summed per group (and per UTC day): the one definition of
    what a rollup row holds, shared by the rollup and the live reads."""
    fields = list(group_fields)
    if by_day:
        queryset = queryset.annotate(day=TruncDate("created_at", tzinfo=dt_timezone.utc))
        fields = ["day", *fields]
    return (
        queryset.order_by().values(*fields).annotate(
            requests=Count("id"),
            ok_requests=Count("id", filter=Q(status=UsageRecord.Status.OK)),
            borrowed_requests=Count("id", filter=Q(borrowed=True)),
            overflow_requests=Count("id", filter=Q(overflow=True)),
            overflow_cost_sum=Sum("cost", filter=Q(overflow=True)),
            **{f"{name}_sum": Sum(name) for name in SUM_FIELDS},
        )
    )


def _group_values(agg: dict) -> dict:
    """What a rollup row holds for one group of ``ledger_aggregates``."""
    return {"requests": agg["requests"], "ok_requests": agg["ok_requests"],
            "borrowed_requests": agg["borrowed_requests"], "overflow_requests": agg["overflow_requests"],
            "overflow_cost": agg["overflow_cost_sum"] or 0, **{name: agg[f"{name}_sum"] or 0 for name in SUM_FIELDS}}


def _day_rows(day: date) -> list[DailyUsage]:
    start, end = day_bounds(day)
    return [DailyUsage(day=day, **{name: agg[name] for name in GROUP_FIELDS}, **_group_values(agg))
            for agg in ledger_aggregates(UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end))]


def _rows_add(aggs: list[dict]) -> int:
    """Add new ledger rows' sums (``ledger_aggregates`` by day) to their
    days' rollup rows; a group's first rows create its row."""
    for agg in aggs:
        group = {"day": agg["day"], **{name: agg[name] for name in GROUP_FIELDS}}
        values = _group_values(agg)
        if not DailyUsage.objects.filter(**group).update(**{name: F(name) + value for name, value in values.items()}):
            DailyUsage.objects.create(**group, **values)
    return len(aggs)


def daily_usage_rebuild_day(*, day: date) -> int:
    """Recompute one day's rollup rows from the ledger. Returns the row count."""
    rows = _day_rows(day)
    with transaction.atomic():
        keep = set()
        if rows:
            DailyUsage.objects.bulk_create(
                rows, batch_size=1000, update_conflicts=True,
                unique_fields=["day", "tenant", "workload", "pool", "model", "endpoint"],
                update_fields=["requests", "ok_requests", "borrowed_requests", "overflow_requests", "overflow_cost",
                               *SUM_FIELDS],
            )
            keep = {(r.tenant_id, r.workload_id, r.pool_id, r.model, r.endpoint) for r in rows}
        # The ledger is append-only, so groups never vanish; this only matters
        # if the table was edited by hand.
        for stale in DailyUsage.objects.filter(day=day).values("id", *GROUP_FIELDS):
            if tuple(stale[name] for name in GROUP_FIELDS) not in keep:
                DailyUsage.objects.filter(pk=stale["id"]).delete()
    return len(rows)


@dataclass(frozen=True)
class RefreshResult:
    days: list[date]  # rebuilt from all their rows
    rows: int  # rows rebuilt, and groups added to
    last_ledger_id: int
    final_through: date
    days_added: list[date] = ()  # not final: the new rows' sums added


def final_through_at(now: datetime) -> date:
    """The last day no ledger row can still arrive for."""
    return (now - FINAL_LAG).astimezone(dt_timezone.utc).date() - timedelta(days=1)


def daily_usage_refresh(*, now: datetime | None = None) -> RefreshResult:
    now = now or timezone.now()
    final = final_through_at(now)
    with transaction.atomic():
        RollupState.objects.get_or_create(name=STATE_NAME)
        state = RollupState.objects.select_for_update().get(name=STATE_NAME)
        high = UsageRecord.objects.aggregate(m=Max("id"))["m"] or 0
        rebuild: set[date] = set()
        # The days that turned final since the last run: rebuilt once more,
        # now that no row can still arrive for them.
        if state.final_through is not None:
            day = state.final_through + timedelta(days=1)
            while day <= final:
                rebuild.add(day)
                day += timedelta(days=1)
        new: list[dict] = []
        if high > state.last_ledger_id:
            new = list(ledger_aggregates(UsageRecord.objects.filter(id__gt=state.last_ledger_id, id__lte=high)))
            first_run = state.last_ledger_id == 0
            rebuild.update(agg["day"] for agg in new if first_run or agg["day"] <= final)
        added = [agg for agg in new if agg["day"] not in rebuild]
        rows = _rows_add(added)
        for day in sorted(rebuild):
            rows += daily_usage_rebuild_day(day=day)
        RollupState.objects.filter(name=STATE_NAME).update(last_ledger_id=high, final_through=final, refreshed_at=now)
    return RefreshResult(days=sorted(rebuild), rows=rows, last_ledger_id=high, final_through=final,
                         days_added=sorted({agg["day"] for agg in added}))


def rollup_final_through() -> date | None:
    state = RollupState.objects.filter(name=STATE_NAME).first()
    return state.final_through if state else None
