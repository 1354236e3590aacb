"""What each page shows, gathered from the selectors (read-only). Views turn
these into templates, charts included; the API serializes the same data."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from decimal import Decimal
from datetime import date, datetime, timedelta, timezone as dt_timezone

from django.db.models import Q

from tenants.access import api_keys_of_tenant, workloads_of_tenant
from tenants.models import ApiKey, Tenant, Workload

from budgets.web.live_metrics import PoolLiveMetrics, pool_live_metrics
from budgets.models import InferencePool, Reservation, ReservationVersion
from budgets.models import BudgetRequest
from budgets.models import Notification, SpendBudget
from budgets.services.notifications import notifications_of_tenant
from budgets.selectors.pools import ModelShare, PoolHeadroom, model_shares_of_pool, pool_headroom
from budgets.selectors.rejections import RejectionExample, rejection_examples, rejection_totals, rejections_by_minute
from budgets.selectors.requests import budget_requests_of_tenant
from budgets.selectors.reservations import ReservationAt, reservation_lines
from budgets.selectors.usage import (
    KeyUsage,
    WorkloadSpend,
    minute_tokens_by_workload,
    rolling_minute_tokens,
    spend_by_workload,
    tokens_by_workload_bucket,
    usage_by_api_key,
)
from budgets.web.ranges import BUCKETS, TimeRange
from budgets.ledger.spend import SpendStatus, spend_budgets_of_tenant, spend_statuses

HOUR_MINUTES = 60


def minutes_back(now: datetime, count: int) -> list[datetime]:
    """The last ``count`` whole minutes up to ``now``'s, oldest first."""
    last = now.astimezone(dt_timezone.utc).replace(second=0, microsecond=0)
    return [last - timedelta(minutes=count - 1 - i) for i in range(count)]


def days_back(today: date, count: int) -> list[date]:
    return [today - timedelta(days=count - 1 - i) for i in range(count)]


def reservation_times(time_range: TimeRange, buckets: list[datetime]) -> list[datetime]:
    """When each bucket's reservation line is read: the bucket's end (or
    the range's end, for the last, partial one)."""
    step = BUCKETS[time_range.bucket]
    return [min(b + step, time_range.end) for b in buckets]


@dataclass
class WorkloadPanel:
    workload: Workload
    slices: list[Reservation]  # its route, primary first
    minutes: list[datetime]
    tokens_per_minute: list[int]
    rejections_by_reason: dict[str, int]
    # The chosen range: tokens per bucket and the reservation as it was.
    buckets: list[datetime] = field(default_factory=list)
    tokens_per_bucket: list[int] = field(default_factory=list)
    reservation_per_bucket: list[ReservationAt | None] = field(default_factory=list)
    bucket: str = "minute"
    # Rolling 60 s before now (budgets.selectors.usage.rolling_minute_tokens).
    used_last_minute: int = 0
    range_spend: WorkloadSpend | None = None
    spend: SpendStatus | None = None

    @property
    def reserved_tpm(self) -> int:
        return sum(s.reserved_tpm for s in self.slices)

    @property
    def ceiling_tpm(self) -> int:
        return sum(s.ceiling_tpm for s in self.slices)


@dataclass
class TenantDashboard:
    tenant: Tenant
    panels: list[WorkloadPanel]
    tenant_spend: SpendStatus | None
    rejection_minutes: list[datetime]
    rejections_per_minute: dict[str, list[int]]  # reason -> counts aligned with rejection_minutes
    examples: list[RejectionExample]
    api_keys: list[ApiKey]
    budget_requests: list[BudgetRequest]
    notifications: list[Notification]
    spend_statuses: list[SpendStatus] = field(default_factory=list)
    time_range: TimeRange | None = None
    key_usage: dict[int, KeyUsage] = field(default_factory=dict)
    # Range spend summed over whole UTC days from the rollups (long ranges).
    spend_whole_days: bool = False

    @property
    def range_spend_total(self) -> WorkloadSpend:
        spends = [p.range_spend for p in self.panels if p.range_spend is not None]
        return WorkloadSpend(0, sum(s.requests for s in spends), sum(s.tokens for s in spends),
                             sum((s.cost for s in spends), Decimal(0)))


def tenant_dashboard(*, tenant: Tenant, now: datetime, time_range: TimeRange) -> TenantDashboard:
    workloads = list(workloads_of_tenant(tenant=tenant))
    wids = [w.id for w in workloads]
    reservations: dict[int, list[Reservation]] = {}
    for r in Reservation.objects.filter(workload_id__in=wids).select_related("pool").order_by("rank", "id"):
        reservations.setdefault(r.workload_id, []).append(r)
    minutes = minutes_back(now, HOUR_MINUTES)
    per_minute = minute_tokens_by_workload(workload_ids=wids, since=minutes[0])
    buckets = time_range.buckets()
    per_bucket = tokens_by_workload_bucket(workload_ids=wids, start=time_range.start, end=time_range.end,
                                           bucket=time_range.bucket)
    lines = reservation_lines(workload_ids=wids, times=reservation_times(time_range, buckets), current=reservations)
    rolling = rolling_minute_tokens(now=now, workload_ids=wids)
    whole_days = time_range.bucket == "day"
    range_spend = spend_by_workload(workload_ids=wids, start=time_range.start, end=time_range.end, whole_days=whole_days)
    day_ago = now - timedelta(hours=24)
    totals = rejection_totals(workload_ids=set(wids), since=day_ago) if wids else {}
    statuses = spend_statuses(budgets=spend_budgets_of_tenant(tenant=tenant), at=now)
    by_workload = {s.budget.workload_id: s for s in statuses if s.budget.workload_id}
    tenant_spend = next((s for s in statuses if s.budget.tenant_id), None)
    panels = []
    for workload in workloads:
        reasons: dict[str, int] = {}
        for (wid, reason), count in totals.items():
            if wid == workload.id:
                reasons[reason] = count
        panels.append(WorkloadPanel(
            workload=workload, slices=reservations.get(workload.id, []), minutes=minutes,
            tokens_per_minute=[per_minute.get(workload.id, {}).get(m, 0) for m in minutes],
            rejections_by_reason=dict(sorted(reasons.items())), spend=by_workload.get(workload.id),
            buckets=buckets, tokens_per_bucket=[per_bucket.get(workload.id, {}).get(b, 0) for b in buckets],
            reservation_per_bucket=lines.get(workload.id, []), bucket=time_range.bucket,
            used_last_minute=rolling.get(workload.id, 0), range_spend=range_spend.get(workload.id),
        ))
    by_minute = rejections_by_minute(since=minutes[0], workload_ids=set(wids)) if wids else {}
    reasons = sorted({reason for counts in by_minute.values() for reason in counts})
    return TenantDashboard(
        tenant=tenant, panels=panels, tenant_spend=tenant_spend, rejection_minutes=minutes,
        rejections_per_minute={r: [by_minute.get(m, {}).get(r, 0) for m in minutes] for r in reasons},
        examples=rejection_examples(workload_ids=set(wids), since=day_ago, limit=20) if wids else [],
        api_keys=list(api_keys_of_tenant(tenant=tenant)[:50]),
        budget_requests=list(budget_requests_of_tenant(tenant=tenant)[:20]),
        notifications=notifications_of_tenant(tenant=tenant, limit=8),
        spend_statuses=statuses, time_range=time_range,
        key_usage=usage_by_api_key(tenant_ids=frozenset({tenant.id}), start=time_range.start, end=time_range.end),
        spend_whole_days=whole_days,
    )


@dataclass
class WorkloadOnPool:
    reservation: Reservation
    used_last_minute: int

    @property
    def used_fraction_of_reserved(self) -> float:
        return self.used_last_minute / self.reservation.reserved_tpm if self.reservation.reserved_tpm else 0.0


@dataclass
class PoolOverview:
    pool: InferencePool
    headroom: PoolHeadroom
    live: PoolLiveMetrics
    workloads: list[WorkloadOnPool]
    rejection_minutes: list[datetime]
    rejections_per_minute: dict[str, list[int]]
    pending_requests: int
    model_shares: list[ModelShare] = field(default_factory=list)  # last hour

    @property
    def effective_tpm(self) -> float:
        return self.pool.admission_tpm * self.live.effective_capacity_factor

    @property
    def effective_rpm(self) -> float:
        return self.pool.admission_rpm * self.live.effective_capacity_factor

    @property
    def rejections_last_hour(self) -> int:
        return sum(sum(v) for v in self.rejections_per_minute.values())


# The pool page refreshes its live part every few seconds; each model's
# share of an hour's traffic moves slowly and sums an hour of the ledger, so
# a process keeps it this long.
MODEL_SHARES_KEPT_S = 30.0
_model_shares_kept: dict[int, tuple[float, list[ModelShare]]] = {}


def _model_shares(*, pool: InferencePool, since: datetime) -> list[ModelShare]:
    kept = _model_shares_kept.get(pool.id)
    if kept is not None and time.monotonic() < kept[0]:
        return kept[1]
    shares = model_shares_of_pool(pool=pool, since=since)
    _model_shares_kept[pool.id] = (time.monotonic() + MODEL_SHARES_KEPT_S, shares)
    return shares


def pool_overview(*, pool: InferencePool, now: datetime) -> PoolOverview:
    reservations = list(
        Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant").order_by("-reserved_tpm")
    )
    used = rolling_minute_tokens(now=now, pool=pool)
    minutes = minutes_back(now, HOUR_MINUTES)
    by_minute = rejections_by_minute(since=minutes[0], pool=pool)
    reasons = sorted({reason for counts in by_minute.values() for reason in counts})
    return PoolOverview(
        pool=pool, headroom=pool_headroom(pool=pool), live=pool_live_metrics(pool_id=pool.id),
        workloads=[WorkloadOnPool(reservation=r, used_last_minute=used.get(r.workload_id, 0)) for r in reservations],
        rejection_minutes=minutes,
        rejections_per_minute={r: [by_minute.get(m, {}).get(r, 0) for m in minutes] for r in reasons},
        pending_requests=BudgetRequest.objects.filter(pool=pool, status=BudgetRequest.Status.PENDING).count(),
        model_shares=_model_shares(pool=pool, since=minutes[0]),
    )


def spend_statuses_all(*, tenant_ids: set[int] | None, now: datetime) -> list[SpendStatus]:
    """Every spend budget the caller may see (finance page)."""
    budgets = SpendBudget.objects.select_related("tenant", "workload", "workload__tenant")
    if tenant_ids is not None:
        budgets = budgets.filter(Q(tenant_id__in=tenant_ids) | Q(workload__tenant_id__in=tenant_ids))
    return spend_statuses(budgets=list(budgets), at=now)


@dataclass
class PoolRange:
    """A pool's usage over the chosen range, with the sum of its
    reservations as they were in each bucket."""

    time_range: TimeRange
    buckets: list[datetime]
    tokens_per_bucket: list[int]
    reserved_per_bucket: list[int | None]


def pool_range(*, pool: InferencePool, time_range: TimeRange) -> PoolRange:
    reservations = {r.workload_id: r for r in Reservation.objects.filter(pool=pool)}
    # Workloads that had a reservation on the pool at any time in the range.
    wids = sorted(set(reservations) | set(
        ReservationVersion.objects.filter(pool=pool, valid_from__lt=time_range.end).values_list("workload_id", flat=True)))
    buckets = time_range.buckets()
    per_workload = tokens_by_workload_bucket(workload_ids=wids, start=time_range.start, end=time_range.end,
                                             bucket=time_range.bucket)
    lines = reservation_lines(workload_ids=wids, times=reservation_times(time_range, buckets), current=reservations,
                              pool_id=pool.id)
    reserved: list[int | None] = []
    for i in range(len(buckets)):
        present = [lines[w][i] for w in wids if lines[w][i] is not None]
        reserved.append(sum(p.reserved_tpm for p in present) if present else None)
    return PoolRange(time_range=time_range, buckets=buckets,
                     tokens_per_bucket=[sum(per_workload.get(w, {}).get(b, 0) for w in wids) for b in buckets],
                     reserved_per_bucket=reserved)
