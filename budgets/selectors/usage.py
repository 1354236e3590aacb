"""Usage and spend for the pages and the API, read from the daily rollups.

Days up to ``RollupState.final_through`` come from DailyUsage; later days (at
most a couple) are summed live from the ledger with the same grouping, so a
page's totals equal the sum of the ledger rows the CSV export streams for the
same filters, and a year of ledger never gets scanned by a page."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import TruncDate, TruncHour, TruncMinute, TruncMonth

from tenants.models import Tenant, Workload

from budgets.models import InferencePool, UsageRecord
from budgets.models import DailyUsage
from budgets.ledger.rollups import day_bounds, rollup_final_through

GROUPS = ("tenant", "cost_center", "workload", "model", "endpoint", "pool", "day", "month")
# The days a usage query may name. Day arithmetic near date.max overflows
# (9999-12-31 + 1 day), and nothing was metered before 2000 or will be past 2100.
FIRST_DAY = date(2000, 1, 1)
LAST_DAY = date(2100, 12, 31)


def usage_day_problem(day: date | None) -> str | None:
    """Why ``day`` cannot be used in a usage query, or None."""
    if day is not None and not FIRST_DAY <= day <= LAST_DAY:
        return f"Choose a day between {FIRST_DAY:%Y-%m-%d} and {LAST_DAY:%Y-%m-%d}."
    return None
# The ledger's cost has 8 decimal places (UsageRecord.cost).
COST_PLACES = Decimal("0.00000001")


def cost_exact(value) -> Decimal:
    """A summed cost as the ledger's exact Decimal. SQLite (``make run``)
    keeps decimals as binary floats and sums them as such; snapping each sum
    to the ledger's 8 places keeps totals free of float residue
    (0.1200679000000001), and adding them as Decimals keeps them so."""
    if value is None:
        return Decimal(0)
    return Decimal(str(value)).quantize(COST_PLACES)


SUMS = ("requests", "ok_requests", "estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens",
        "actual_output_tokens", "cost", "overflow_requests", "overflow_cost")


@dataclass(frozen=True)
class UsageFilters:
    """Which ledger rows count. ``tenant_ids`` is the caller's scope (None =
    every tenant, for admins and finance); the other fields are the filters a
    user chose. ``start`` and ``end`` are UTC days, both included; when
    ``start_at`` and ``end_at`` are set they are the exact half-open UTC range
    [start_at, end_at) (start and end are then the days it touches)."""

    start: date
    end: date
    tenant_ids: frozenset[int] | None = None
    tenant_id: int | None = None
    cost_center: str | None = None
    workload_id: int | None = None
    workload_ids: frozenset[int] | None = None
    model: str | None = None
    pool_id: int | None = None
    start_at: datetime | None = None
    end_at: datetime | None = None

    def bounds(self) -> tuple[datetime, datetime]:
        """The half-open UTC range [start, end) the filters cover."""
        if self.start_at is not None and self.end_at is not None:
            return self.start_at, self.end_at
        return day_bounds(self.start)[0], day_bounds(self.end)[1]

    def q(self) -> Q:
        q = Q()
        if self.tenant_ids is not None:
            q &= Q(tenant_id__in=self.tenant_ids)
        if self.tenant_id is not None:
            q &= Q(tenant_id=self.tenant_id)
        if self.cost_center:
            q &= Q(tenant__cost_center=self.cost_center)
        if self.workload_id is not None:
            q &= Q(workload_id=self.workload_id)
        if self.workload_ids is not None:
            q &= Q(workload_id__in=self.workload_ids)
        if self.model:
            q &= Q(model=self.model)
        if self.pool_id is not None:
            q &= Q(pool_id=self.pool_id)
        return q


def ledger_rows(*, filters: UsageFilters) -> QuerySet[UsageRecord]:
    """The raw ledger rows matching the filters (the CSV export)."""
    start, end = filters.bounds()
    return UsageRecord.objects.filter(filters.q(), created_at__gte=start, created_at__lt=end)


@dataclass
class UsageRow:
    key: dict
    requests: int = 0
    ok_requests: int = 0
    estimated_input_tokens: int = 0
    estimated_output_tokens: int = 0
    actual_input_tokens: int = 0
    actual_output_tokens: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal(0))
    # Of which served by overflow slices (routing across pools).
    overflow_requests: int = 0
    overflow_cost: Decimal = field(default_factory=lambda: Decimal(0))
    label: str = ""

    @property
    def estimated_tokens(self) -> int:
        return self.estimated_input_tokens + self.estimated_output_tokens

    @property
    def actual_tokens(self) -> int:
        return self.actual_input_tokens + self.actual_output_tokens

    @property
    def actual_over_estimated(self) -> float | None:
        return self.actual_tokens / self.estimated_tokens if self.estimated_tokens else None

    def add(self, values: dict) -> None:
        for name in SUMS:
            if name in ("cost", "overflow_cost"):
                setattr(self, name, getattr(self, name) + cost_exact(values.get(name)))
            else:
                setattr(self, name, getattr(self, name) + (values.get(name) or 0))


@dataclass
class UsageSummary:
    rows: list[UsageRow]
    total: UsageRow
    group_by: tuple[str, ...]
    final_through: date | None


def _group_expressions(group_by: tuple[str, ...], *, ledger: bool) -> dict:
    """``by_<group>`` expressions (prefixed: a bare ``tenant`` would clash
    with the model's field of that name)."""
    exprs = {}
    for name in group_by:
        if name == "tenant":
            expr = F("tenant_id")
        elif name == "cost_center":
            expr = F("tenant__cost_center")
        elif name == "workload":
            expr = F("workload_id")
        elif name in ("model", "endpoint"):
            expr = F(name)
        elif name == "pool":
            expr = F("pool_id")
        elif name == "day":
            expr = TruncDate("created_at", tzinfo=dt_timezone.utc) if ledger else F("day")
        elif name == "month":
            expr = TruncMonth("created_at", tzinfo=dt_timezone.utc) if ledger else TruncMonth("day")
        else:
            raise ValueError(f"cannot group by {name!r}")
        exprs[f"by_{name}"] = expr
    return exprs


def _sum_expressions(*, ledger: bool) -> dict:
    if ledger:
        return {
            "requests": Count("id"),
            "ok_requests": Count("id", filter=Q(status=UsageRecord.Status.OK)),
            # Before "cost": once annotated, that name is the aggregate, not the field.
            "overflow_requests": Count("id", filter=Q(overflow=True)),
            "overflow_cost": Sum("cost", filter=Q(overflow=True)),
            **{name: Sum(name) for name in SUMS[2:7]},
        }
    return {name: Sum(name) for name in SUMS}


def _normalise(key: dict) -> tuple:
    """The group's key in a form both halves agree on (a month truncated on
    the ledger is a datetime, on the rollups a date)."""
    return tuple((name, value.date() if isinstance(value, datetime) else value) for name, value in key.items())


def _whole_days(filters: UsageFilters) -> tuple[date, date] | None:
    """The whole UTC days inside the filters' range (first, last), or None."""
    start, end = filters.bounds()
    first = start.astimezone(dt_timezone.utc).date()
    if day_bounds(first)[0] < start:
        first += timedelta(days=1)
    last = end.astimezone(dt_timezone.utc).date() - timedelta(days=1)
    return (first, last) if first <= last else None


def _summary_parts(*, filters: UsageFilters, group_by: tuple[str, ...], final: date | None) -> list:
    """The grouped sums that together cover the filters' range exactly: whole
    UTC days from the rollups (through ``final``) and the live ledger after
    them; the partial days at either edge from the ledger rows in the range."""
    parts = []
    start, end = filters.bounds()
    days = _whole_days(filters)
    day_filters = {**filters.__dict__, "start_at": None, "end_at": None}
    if days is None:  # under a day or within two partial days: the ledger only
        edges = [(start, end)]
    else:
        first, last = days
        edges = [(start, day_bounds(first)[0]), (day_bounds(last)[1], end)]
        rollup_end = min(last, final) if final else None
        if rollup_end is not None and rollup_end >= first:
            exprs = _group_expressions(group_by, ledger=False)
            rollup = DailyUsage.objects.filter(filters.q(), day__gte=first, day__lte=rollup_end)
            parts.append(rollup.order_by().values(**exprs).annotate(**_sum_expressions(ledger=False)))
        live_start = max(first, final + timedelta(days=1)) if final else first
        if live_start <= last:
            edges.append((day_bounds(live_start)[0], day_bounds(last)[1]))
    for edge_start, edge_end in edges:
        if edge_start < edge_end:
            exprs = _group_expressions(group_by, ledger=True)
            live = ledger_rows(filters=UsageFilters(**{**day_filters, "start_at": edge_start, "end_at": edge_end}))
            parts.append(live.order_by().values(**exprs).annotate(**_sum_expressions(ledger=True)))
    return parts


def usage_rows(*, filters: UsageFilters, group_by: tuple[str, ...], final: date | None) -> list[UsageRow]:
    """The filters' sums per group, unlabelled and unsorted: the whole days
    through ``final`` (``rollup_final_through()``) from the rollups, the rest
    from the ledger. The spend reconcile reads the month this way too."""
    merged: dict[tuple, UsageRow] = {}
    for part in _summary_parts(filters=filters, group_by=group_by, final=final):
        for values in part:
            key = {name: values[f"by_{name}"] for name in group_by}
            normal = _normalise(key)
            row = merged.get(normal)
            if row is None:
                row = merged[normal] = UsageRow(key=dict(zip(group_by, (v for _n, v in normal))))
            row.add(values)
    return list(merged.values())


def usage_summary(*, filters: UsageFilters, group_by: tuple[str, ...] = ("tenant",)) -> UsageSummary:
    final = rollup_final_through()
    rows = usage_rows(filters=filters, group_by=group_by, final=final)
    _label(rows)
    if {"day", "month"} & set(group_by):
        rows.sort(key=lambda r: r.label)  # time order (labels lead with the ISO date)
    else:
        rows.sort(key=lambda r: (-r.cost, r.label))
    total = UsageRow(key={}, label="Total")
    for row in rows:
        total.add(row.__dict__)
    return UsageSummary(rows=rows, total=total, group_by=group_by, final_through=final)


def _label(rows: list[UsageRow]) -> None:
    tenant_ids = {r.key["tenant"] for r in rows if "tenant" in r.key}
    workload_ids = {r.key["workload"] for r in rows if "workload" in r.key}
    pool_ids = {r.key["pool"] for r in rows if "pool" in r.key}
    tenants = dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("id", "slug")) if tenant_ids else {}
    workloads = dict(Workload.objects.filter(pk__in=workload_ids).values_list("id", "slug")) if workload_ids else {}
    pools = dict(InferencePool.objects.filter(pk__in=pool_ids).values_list("id", "slug")) if pool_ids else {}
    for row in rows:
        parts = []
        for name, value in row.key.items():
            if name == "tenant":
                parts.append(tenants.get(value, f"tenant {value}"))
            elif name == "workload":
                parts.append(workloads.get(value, f"workload {value}"))
            elif name == "pool":
                parts.append(pools.get(value, f"pool {value}"))
            elif name == "month":
                parts.append(f"{value:%Y-%m}" if value else "")
            elif name == "day":
                parts.append(f"{value:%Y-%m-%d}" if value else "")
            elif name == "cost_center":
                parts.append(value or "(none)")
            else:
                parts.append(str(value))
        row.label = " / ".join(parts)


def usage_models(*, tenant_ids: frozenset[int] | None = None) -> list[str]:
    """Models that appear in the rollups (for filter choices)."""
    queryset = DailyUsage.objects.all()
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=tenant_ids)
    return sorted(set(queryset.values_list("model", flat=True).distinct()))


def daily_tokens_by_workload(*, workload_ids: list[int], start: date, end: date) -> dict[int, dict[date, int]]:
    """Actual tokens per day per workload, for the tenant page's charts."""
    summary = usage_summary(filters=UsageFilters(start=start, end=end, workload_ids=frozenset(workload_ids)),
                            group_by=("workload", "day")) if workload_ids else None
    out: dict[int, dict[date, int]] = defaultdict(dict)
    if summary is None:
        return out
    wanted = set(workload_ids)
    for row in summary.rows:
        wid = row.key["workload"]
        if wid in wanted:
            out[wid][row.key["day"]] = row.actual_tokens
    return out


def minute_tokens_by_workload(*, workload_ids: list[int], since: datetime) -> dict[int, dict[datetime, int]]:
    """Actual tokens per minute per workload since ``since`` (at most an hour:
    a bounded slice of the ledger through its (workload, created_at) index)."""
    out: dict[int, dict[datetime, int]] = defaultdict(dict)
    if not workload_ids:
        return out
    rows = (
        UsageRecord.objects.filter(workload_id__in=workload_ids, created_at__gte=since).order_by()
        .annotate(minute=TruncMinute("created_at", tzinfo=dt_timezone.utc)).values("workload_id", "minute")
        .annotate(tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")))
    )
    for row in rows:
        out[row["workload_id"]][row["minute"]] = row["tokens"] or 0
    return out


ROLLING_WINDOW = timedelta(seconds=60)


def rolling_minute_tokens(*, now: datetime, pool: InferencePool | None = None,
                          workload_ids: list[int] | None = None) -> dict[int, int]:
    """Tokens each workload used in the rolling 60 s before ``now`` (ledger):
    the one definition of "used in the last minute" every page shows."""
    rows = UsageRecord.objects.filter(created_at__gte=now - ROLLING_WINDOW, created_at__lte=now)
    if pool is not None:
        rows = rows.filter(pool=pool)
    if workload_ids is not None:
        rows = rows.filter(workload_id__in=workload_ids)
    rows = rows.order_by().values("workload_id").annotate(tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")))
    return {row["workload_id"]: row["tokens"] or 0 for row in rows}


def tokens_by_workload_bucket(*, workload_ids: list[int], start: datetime, end: datetime,
                              bucket: str) -> dict[int, dict[datetime, int]]:
    """Actual tokens per workload per UTC minute, hour or day in [start, end).
    Days come from the rollups (fast at any range); minutes and hours from
    the ledger through its (workload, created_at, id) index (a range that
    picks them spans at most a few days: budgets/web/ranges.py)."""
    out: dict[int, dict[datetime, int]] = defaultdict(dict)
    if not workload_ids:
        return out
    if bucket == "day":
        first, last = start.astimezone(dt_timezone.utc).date(), (end - timedelta(microseconds=1)).astimezone(dt_timezone.utc).date()
        for wid, per_day in daily_tokens_by_workload(workload_ids=workload_ids, start=first, end=last).items():
            for day, tokens in per_day.items():
                out[wid][datetime(day.year, day.month, day.day, tzinfo=dt_timezone.utc)] = tokens
        return out
    trunc = TruncMinute if bucket == "minute" else TruncHour
    rows = (
        UsageRecord.objects.filter(workload_id__in=workload_ids, created_at__gte=start, created_at__lt=end).order_by()
        .annotate(bucket=trunc("created_at", tzinfo=dt_timezone.utc)).values("workload_id", "bucket")
        .annotate(tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")))
    )
    for row in rows:
        out[row["workload_id"]][row["bucket"]] = row["tokens"] or 0
    return out


@dataclass(frozen=True)
class EndpointUsage:
    endpoint: str  # a /v1 path (UsageRecord.ENDPOINT_LABELS)
    requests: int
    tokens: int
    cost: Decimal

    @property
    def label(self) -> str:
        return UsageRecord.ENDPOINT_LABELS.get(self.endpoint, self.endpoint)


@dataclass(frozen=True)
class KeyUsage:
    api_key_id: int
    requests: int
    tokens: int
    cost: Decimal
    by_endpoint: tuple[EndpointUsage, ...] = ()  # most requests first


def usage_by_api_key(*, tenant_ids: frozenset[int] | None, start: datetime, end: datetime) -> dict[int, KeyUsage]:
    """Requests, tokens and cost per API key in [start, end), in all and per
    /v1 endpoint (ledger, through its (api_key, created_at, id) index)."""
    rows = UsageRecord.objects.filter(api_key__isnull=False, created_at__gte=start, created_at__lt=end)
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=tenant_ids)
    rows = rows.order_by().values("api_key_id", "endpoint").annotate(
        n=Count("id"), tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")), spent=Sum("cost"))
    per_key: dict[int, list[EndpointUsage]] = defaultdict(list)
    for r in rows:
        per_key[r["api_key_id"]].append(EndpointUsage(endpoint=r["endpoint"], requests=r["n"], tokens=r["tokens"] or 0,
                                                      cost=cost_exact(r["spent"])))
    return {key_id: _key_usage_of(key_id, parts) for key_id, parts in per_key.items()}


def _key_usage_of(api_key_id: int, parts: list[EndpointUsage]) -> KeyUsage:
    parts.sort(key=lambda p: (-p.requests, p.endpoint))
    return KeyUsage(api_key_id=api_key_id, requests=sum(p.requests for p in parts),
                    tokens=sum(p.tokens for p in parts), cost=sum((p.cost for p in parts), Decimal(0)),
                    by_endpoint=tuple(parts))


@dataclass(frozen=True)
class WorkloadSpend:
    workload_id: int
    requests: int
    tokens: int
    cost: Decimal


def spend_by_workload(*, workload_ids: list[int], start: datetime, end: datetime,
                      whole_days: bool) -> dict[int, WorkloadSpend]:
    """Requests, actual tokens and cost per workload. ``whole_days``: sum the
    UTC days [start's day, end's day] through the rollups (fast for long
    ranges; the page says so); else the ledger rows in [start, end)."""
    if not workload_ids:
        return {}
    if whole_days:
        last = (end - timedelta(microseconds=1)).astimezone(dt_timezone.utc).date()
        summary = usage_summary(filters=UsageFilters(start=start.astimezone(dt_timezone.utc).date(), end=last,
                                                     workload_ids=frozenset(workload_ids)), group_by=("workload",))
        return {r.key["workload"]: WorkloadSpend(r.key["workload"], r.requests, r.actual_tokens, r.cost)
                for r in summary.rows}
    rows = (UsageRecord.objects.filter(workload_id__in=workload_ids, created_at__gte=start, created_at__lt=end)
            .order_by().values("workload_id")
            .annotate(n=Count("id"), tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")), spent=Sum("cost")))
    return {r["workload_id"]: WorkloadSpend(r["workload_id"], r["n"], r["tokens"] or 0, cost_exact(r["spent"]))
            for r in rows}


def spend_by_time(*, filters: UsageFilters, bucket: str) -> dict[datetime, Decimal]:
    """Cost per UTC minute, hour, day or month (keyed by the bucket's start)
    in the filters' range. Days and months are summed like ``usage_summary``
    (rollups for whole days); minutes and hours from the ledger rows in the
    range (a range that picks them spans a few days: budgets/web/ranges.py)."""
    if bucket in ("day", "month"):
        summary = usage_summary(filters=filters, group_by=(bucket,))
        return {datetime(r.key[bucket].year, r.key[bucket].month, r.key[bucket].day, tzinfo=dt_timezone.utc): r.cost
                for r in summary.rows}
    trunc = {"minute": TruncMinute, "hour": TruncHour}[bucket]
    rows = (ledger_rows(filters=filters).order_by().annotate(at=trunc("created_at", tzinfo=dt_timezone.utc))
            .values("at").annotate(spent=Sum("cost")))
    return {row["at"]: cost_exact(row["spent"]) for row in rows}


@dataclass(frozen=True)
class MinuteUse:
    """A workload's use per UTC minute over its last ``days`` days: the
    busiest minute and the 95th percentile (nearest rank) of the minutes in
    which it sent anything, against which a reviewer weighs its slice.
    Idle minutes are left out: a workload busy two hours a day would
    otherwise show a p95 of 0."""

    days: int
    peak_tpm: int
    p95_tpm: int
    busy_minutes: int


def workload_minute_use(*, workload_id: int, now: datetime, days: int) -> MinuteUse:
    """Per-minute actual tokens from the ledger, through its (workload,
    created_at) index: at most one row per minute of the window."""
    rows = (
        UsageRecord.objects.filter(workload_id=workload_id, created_at__gte=now - timedelta(days=days),
                                   created_at__lt=now).order_by()
        .annotate(minute=TruncMinute("created_at", tzinfo=dt_timezone.utc)).values("minute")
        .annotate(tokens=Sum(F("actual_input_tokens") + F("actual_output_tokens")))
    )
    per_minute = sorted(row["tokens"] or 0 for row in rows)
    if not per_minute:
        return MinuteUse(days=days, peak_tpm=0, p95_tpm=0, busy_minutes=0)
    rank = max(1, -(-95 * len(per_minute) // 100))  # ceil(0.95 n): nearest rank
    return MinuteUse(days=days, peak_tpm=per_minute[-1], p95_tpm=per_minute[rank - 1], busy_minutes=len(per_minute))
