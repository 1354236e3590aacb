"""Latency percentiles and outcome rates over a time range, per workload and
lane, from the ledger (rejections from the exact per-minute counts).

PostgreSQL computes the percentiles in the query (``percentile_cont``, the
continuous percentile: linear interpolation between the two nearest ranks).
SQLite, which ``make run`` uses, has no such aggregate: there the rows'
timings are read and the same interpolation is done in Python, so both
databases give the same numbers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connection
from django.db.models import Aggregate, Count, FloatField, Q

from tenants.models import Workload

from budgets.ledger.rejections import NO_POOL, rejections_pending
from budgets.models import InferencePool, RejectionStat, UsageRecord
from budgets.selectors.request_log import TIMINGS, LogFilters

PERCENTILES = (50, 95, 99)


class PercentileCont(Aggregate):
    """PostgreSQL's ``percentile_cont(f) WITHIN GROUP (ORDER BY expr)``."""

    function = "PERCENTILE_CONT"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, *, fraction: float, **extra):
        super().__init__(expression, fraction=float(fraction), **extra)


def percentile(values: list[float], fraction: float) -> float | None:
    """``percentile_cont`` over sorted ``values`` (None when empty)."""
    if not values:
        return None
    position = (len(values) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


@dataclass
class LatencyRow:
    workload_id: int
    workload_slug: str
    lane: str
    requests: int = 0
    ok: int = 0
    errors: int = 0
    rejections: int = 0
    # timing name -> {50: ms, 95: ms, 99: ms}
    percentiles: dict[str, dict[int, float | None]] = field(default_factory=dict)

    @property
    def attempts(self) -> int:
        """Everything that was asked: answered, failed or refused."""
        return self.requests + self.rejections

    def rate(self, count: int) -> float | None:
        return count / self.attempts if self.attempts else None

    @property
    def success_rate(self) -> float | None:
        return self.rate(self.ok)

    @property
    def error_rate(self) -> float | None:
        return self.rate(self.errors)

    @property
    def rejection_rate(self) -> float | None:
        return self.rate(self.rejections)


def _percentiles_sql(rows) -> dict[tuple[int, str], dict[str, dict[int, float | None]]]:
    aggregates = {f"{name}_p{p}": PercentileCont(name, fraction=p / 100) for name in TIMINGS for p in PERCENTILES}
    out = {}
    for values in rows.values("workload_id", "lane").annotate(**aggregates):
        out[(values["workload_id"], values["lane"])] = {
            name: {p: values[f"{name}_p{p}"] for p in PERCENTILES} for name in TIMINGS}
    return out


def _percentiles_python(rows) -> dict[tuple[int, str], dict[str, dict[int, float | None]]]:
    samples: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for values in rows.values("workload_id", "lane", *TIMINGS).iterator(chunk_size=5000):
        group = samples[(values["workload_id"], values["lane"])]
        for name in TIMINGS:
            if values[name] is not None:
                group[name].append(float(values[name]))
    out = {}
    for key, by_name in samples.items():
        out[key] = {}
        for name in TIMINGS:
            ordered = sorted(by_name.get(name, []))
            out[key][name] = {p: percentile(ordered, p / 100) for p in PERCENTILES}
    return out


def latency_by_workload_lane(*, filters: LogFilters) -> list[LatencyRow]:
    """Per (workload, lane): request counts, success/error/rejection rates,
    and p50/p95/p99 of every timing, over ``filters``' range and scope.
    Rejections have no lane: they are one row per workload with lane "—"."""
    rows = UsageRecord.objects.filter(filters.ledger_q()).order_by()
    counts = rows.values("workload_id", "lane").annotate(
        n=Count("id"), ok=Count("id", filter=Q(status=UsageRecord.Status.OK)))
    by_key: dict[tuple[int, str], LatencyRow] = {}
    for values in counts:
        key = (values["workload_id"], values["lane"])
        by_key[key] = LatencyRow(workload_id=key[0], workload_slug="", lane=key[1], requests=values["n"],
                                 ok=values["ok"], errors=values["n"] - values["ok"])
    if by_key:
        stats = _percentiles_sql(rows) if connection.vendor == "postgresql" else _percentiles_python(rows)
        for key, by_name in stats.items():
            by_key[key].percentiles = by_name
    if filters.wants_rejections:
        for wid, count in rejection_counts(filters=filters).items():
            by_key.setdefault((wid, "—"), LatencyRow(workload_id=wid, workload_slug="", lane="—")).rejections = count
    slugs = dict(Workload.objects.filter(pk__in={k[0] for k in by_key}).values_list("id", "slug"))
    out = sorted(by_key.values(), key=lambda r: (slugs.get(r.workload_id, ""), r.lane))
    for row in out:
        row.workload_slug = slugs.get(row.workload_id, str(row.workload_id))
        if not row.percentiles:
            row.percentiles = {name: {p: None for p in PERCENTILES} for name in TIMINGS}
    return out


def rejection_counts(*, filters: LogFilters) -> dict[int, int]:
    """Rejections per workload in the range: flushed minutes with the minutes
    still pending in Redis laid over them (a minute counts when it starts
    inside the range)."""
    stats = RejectionStat.objects.filter(minute__gte=_minute_floor(filters.start), minute__lt=filters.end)
    workload_ids = None
    if filters.tenant_ids is not None:
        workload_ids = set(Workload.objects.filter(tenant_id__in=filters.tenant_ids).values_list("id", flat=True))
    if filters.workload_id is not None:
        workload_ids = {filters.workload_id} & workload_ids if workload_ids is not None else {filters.workload_id}
    if workload_ids is not None:
        stats = stats.filter(workload_id__in=workload_ids)
    per_key: dict[tuple[datetime, int, str], int] = {}
    for minute, wid, reason, count in stats.values_list("minute", "workload_id", "reason", "count"):
        per_key[(minute, wid, reason)] = count
    if workload_ids is None or workload_ids:
        pool_ids = [NO_POOL, *InferencePool.objects.values_list("id", flat=True)]
        pending = rejections_pending(pool_ids=pool_ids, since=filters.start, workload_ids=workload_ids)
        per_key.update({k: v for k, v in pending.counts.items() if k[0] < filters.end})
    totals: dict[int, int] = defaultdict(int)
    for (_minute, wid, reason), count in per_key.items():
        if not filters.reason or reason == filters.reason:
            totals[wid] += count
    return dict(totals)


def _minute_floor(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)
