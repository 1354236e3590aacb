"""What each page shows, gathered from the selectors (read-only). Views turn
these into templates, charts included; the API serializes the same data."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone as dt_timezone

from django.db.models import Q

from tenants.access import api_keys_of_tenant, workloads_of_tenant
from tenants.models import ApiKey, Tenant, Workload

from budgets.web.live_metrics import PoolLiveMetrics, pool_live_metrics
from budgets.models import InferencePool, Reservation
from budgets.models import BudgetRequest
from budgets.models import Notification, SpendBudget
from budgets.services.notifications import notifications_of_tenant
from budgets.selectors.pools import PoolHeadroom, pool_headroom
from budgets.selectors.rejections import RejectionExample, rejection_examples, rejection_totals, rejections_by_minute
from budgets.selectors.requests import budget_requests_of_tenant
from budgets.selectors.usage import daily_tokens_by_workload, last_minute_tokens, minute_tokens_by_workload
from budgets.ledger.spend import SpendStatus, spend_budgets_of_tenant, spend_statuses

HOUR_MINUTES = 60
DAYS_SHOWN = 30


def minutes_back(now: datetime, count: int) -> list[datetime]:
    """The last ``count`` whole minutes up to ``now``'s, oldest first."""
    last = now.astimezone(dt_timezone.utc).replace(second=0, microsecond=0)
    return [last - timedelta(minutes=count - 1 - i) for i in range(count)]


def days_back(today: date, count: int) -> list[date]:
    return [today - timedelta(days=count - 1 - i) for i in range(count)]


@dataclass
class WorkloadPanel:
    workload: Workload
    reservation: Reservation | None
    minutes: list[datetime]
    tokens_per_minute: list[int]
    days: list[date]
    tokens_per_day: list[int]
    rejections_by_reason: dict[str, int]
    spend: SpendStatus | None = None

    @property
    def used_last_minute(self) -> int:
        return self.tokens_per_minute[-1] if self.tokens_per_minute else 0


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


def tenant_dashboard(*, tenant: Tenant, now: datetime) -> TenantDashboard:
    workloads = list(workloads_of_tenant(tenant=tenant))
    wids = [w.id for w in workloads]
    reservations = {r.workload_id: r for r in Reservation.objects.filter(workload_id__in=wids).select_related("pool")}
    minutes = minutes_back(now, HOUR_MINUTES)
    today = now.astimezone(dt_timezone.utc).date()
    days = days_back(today, DAYS_SHOWN)
    per_minute = minute_tokens_by_workload(workload_ids=wids, since=minutes[0])
    per_day = daily_tokens_by_workload(workload_ids=wids, start=days[0], end=today)
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
            workload=workload, reservation=reservations.get(workload.id), minutes=minutes,
            tokens_per_minute=[per_minute.get(workload.id, {}).get(m, 0) for m in minutes],
            days=days, tokens_per_day=[per_day.get(workload.id, {}).get(d, 0) for d in days],
            rejections_by_reason=dict(sorted(reasons.items())), spend=by_workload.get(workload.id),
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
        spend_statuses=statuses,
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

    @property
    def effective_tpm(self) -> float:
        return self.pool.admission_tpm * self.live.effective_capacity_factor

    @property
    def effective_rpm(self) -> float:
        return self.pool.admission_rpm * self.live.effective_capacity_factor

    @property
    def rejections_last_hour(self) -> int:
        return sum(sum(v) for v in self.rejections_per_minute.values())


def pool_overview(*, pool: InferencePool, now: datetime) -> PoolOverview:
    reservations = list(
        Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant").order_by("-reserved_tpm")
    )
    used = last_minute_tokens(pool=pool, now=now)
    minutes = minutes_back(now, HOUR_MINUTES)
    by_minute = rejections_by_minute(since=minutes[0], pool=pool)
    reasons = sorted({reason for counts in by_minute.values() for reason in counts})
    return PoolOverview(
        pool=pool, headroom=pool_headroom(pool=pool), live=pool_live_metrics(pool_id=pool.id),
        workloads=[WorkloadOnPool(reservation=r, used_last_minute=used.get(r.workload_id, 0)) for r in reservations],
        rejection_minutes=minutes,
        rejections_per_minute={r: [by_minute.get(m, {}).get(r, 0) for m in minutes] for r in reasons},
        pending_requests=BudgetRequest.objects.filter(pool=pool, status=BudgetRequest.Status.PENDING).count(),
    )


def spend_statuses_all(*, tenant_ids: set[int] | None, now: datetime) -> list[SpendStatus]:
    """Every spend budget the caller may see (finance page)."""
    budgets = SpendBudget.objects.select_related("tenant", "workload", "workload__tenant")
    if tenant_ids is not None:
        budgets = budgets.filter(Q(tenant_id__in=tenant_ids) | Q(workload__tenant_id__in=tenant_ids))
    return spend_statuses(budgets=list(budgets), at=now)
