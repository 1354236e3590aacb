"""Month-to-date spend against monthly spend budgets.

Redis holds month-to-date spend per pool beside the token buckets, in
micro-units of the price table's currency (an integer: 1.25 USD = 1_250_000),
in one hash per pool and UTC month (``spend_month_key``) with fields
``T<tenant id>`` and ``<workload id>``. The admission script estimates a
request's cost when it admits it and settlement corrects it to the actual
cost; ``spend_reconcile`` overwrites those fields from the ledger, which is
the truth, every minute. Hard caps reach admission through the pool config
(``spend_caps_for_pool``, called by ``pool_config_push``).

A tenant's spend on several pools sits in several hashes; reads sum them."""

from __future__ import annotations

import calendar
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import ROUND_HALF_UP, Decimal

from django.db.models import Sum
from django.dispatch import Signal
from django.utils import timezone

from tenants.models import Tenant, Workload

from budgets.admission import keys
from budgets.models import InferencePool, Reservation, UsageRecord
from budgets.models import Notification, SpendBudget
from budgets.services.notifications import notification_create
from budgets.admission.redis_client import get_redis, unavailable_note

logger = logging.getLogger(__name__)

MICRO = Decimal(1_000_000)

# Sent when month-to-date spend first crosses a budget's soft threshold (or
# reaches its hard cap) in a month; ``budget``, ``month_to_date``, ``kind``.
spend_threshold_crossed = Signal()


def to_micro(amount: Decimal) -> int:
    return int((Decimal(amount) * MICRO).to_integral_value(rounding=ROUND_HALF_UP))


def from_micro(micro: int | str | None) -> Decimal:
    if micro in (None, ""):
        return Decimal(0)
    return (Decimal(str(micro)) / MICRO).quantize(Decimal("0.000001"))


def _utc(at: datetime | None) -> datetime:
    at = at or timezone.now()
    return at.astimezone(dt_timezone.utc) if at.tzinfo else at.replace(tzinfo=dt_timezone.utc)


def month_bounds(at: datetime) -> tuple[datetime, datetime]:
    at = _utc(at)
    start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(at.year, at.month)[1]
    return start, start + timedelta(days=days)


def spend_month_key(*, pool_id: int, at: datetime) -> str:
    """The Redis hash of a pool's month-to-date spend for ``at``'s UTC month."""
    return keys.spend_month(pool_id, f"{_utc(at):%Y-%m}")


def spend_month(*, pool_id: int, at_ms: float) -> tuple[str, float]:
    """For admission: the month-to-date spend hash of a moment (ms, Redis's
    clock) and when that month ends (ms), after which the hash expires."""
    at = datetime.fromtimestamp(at_ms / 1000, tz=dt_timezone.utc)
    return spend_month_key(pool_id=pool_id, at=at), month_bounds(at)[1].timestamp() * 1000


def tenant_field(tenant_id: int) -> str:
    return f"T{tenant_id}"


def workload_field(workload_id: int) -> str:
    return str(workload_id)


def spend_caps_for_pool(*, pool: InferencePool) -> dict[str, str]:
    """Hard caps of the tenants and workloads with a reservation on ``pool``,
    as fields of the pool's config hash: ``T<tenant id>.spend.cap`` and
    ``<workload id>.spend.cap``, in micro-units."""
    reservations = Reservation.objects.filter(pool=pool).values_list("workload_id", "workload__tenant_id")
    workload_ids = {wid for wid, _ in reservations}
    tenant_ids = {tid for _, tid in reservations}
    fields: dict[str, str] = {}
    for budget in SpendBudget.objects.filter(hard_cap=True, tenant_id__in=tenant_ids):
        fields[f"{tenant_field(budget.tenant_id)}.spend.cap"] = str(to_micro(budget.monthly_amount))
    for budget in SpendBudget.objects.filter(hard_cap=True, workload_id__in=workload_ids):
        fields[f"{workload_field(budget.workload_id)}.spend.cap"] = str(to_micro(budget.monthly_amount))
    return fields


# --- reading month-to-date ------------------------------------------------------------


def _ledger_month_to_date(*, tenant_ids: set[int], workload_ids: set[int], at: datetime) -> dict[str, Decimal]:
    start, end = month_bounds(at)
    month = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
    out: dict[str, Decimal] = {}
    if tenant_ids:
        for row in month.filter(tenant_id__in=tenant_ids).order_by().values("tenant_id").annotate(c=Sum("cost")):
            out[tenant_field(row["tenant_id"])] = row["c"] or Decimal(0)
    if workload_ids:
        for row in month.filter(workload_id__in=workload_ids).order_by().values("workload_id").annotate(c=Sum("cost")):
            out[workload_field(row["workload_id"])] = row["c"] or Decimal(0)
    return out


def spend_month_to_date_many(*, tenant_ids: set[int] = frozenset(), workload_ids: set[int] = frozenset(),
                             at: datetime | None = None) -> dict[str, Decimal]:
    """Month-to-date spend keyed ``T<tenant id>`` / ``<workload id>``: summed
    over every pool's Redis hash in one round trip; a field no pool has in
    Redis (not spent through admission yet, Redis flushed or unreachable) is
    read from the ledger."""
    at = _utc(at)
    fields = [tenant_field(t) for t in sorted(tenant_ids)] + [workload_field(w) for w in sorted(workload_ids)]
    if not fields:
        return {}
    totals: dict[str, Decimal] = {}
    seen: set[str] = set()
    try:
        pool_ids = list(InferencePool.objects.values_list("id", flat=True))
        pipe = get_redis().pipeline(transaction=False)
        for pool_id in pool_ids:
            pipe.hmget(spend_month_key(pool_id=pool_id, at=at), fields)
        for values in pipe.execute():
            for field, value in zip(fields, values):
                if value is not None:
                    seen.add(field)
                    totals[field] = totals.get(field, Decimal(0)) + from_micro(int(float(value)))
    except Exception:  # noqa: BLE001 - Redis away: the ledger answers
        unavailable_note("month-to-date spend")
        seen.clear()
        totals.clear()
    missing_t = {t for t in tenant_ids if tenant_field(t) not in seen}
    missing_w = {w for w in workload_ids if workload_field(w) not in seen}
    if missing_t or missing_w:
        from_ledger = _ledger_month_to_date(tenant_ids=missing_t, workload_ids=missing_w, at=at)
        for field in [tenant_field(t) for t in missing_t] + [workload_field(w) for w in missing_w]:
            totals[field] = from_ledger.get(field, Decimal(0))
    return totals


def spend_month_to_date(*, tenant: Tenant | None = None, workload: Workload | None = None,
                        at: datetime | None = None) -> Decimal:
    """Month-to-date spend of one tenant or one workload (Redis, the ledger as fallback)."""
    if (tenant is None) == (workload is None):
        raise ValueError("pass exactly one of tenant or workload")
    if tenant is not None:
        return spend_month_to_date_many(tenant_ids={tenant.id}, at=at)[tenant_field(tenant.id)]
    return spend_month_to_date_many(workload_ids={workload.id}, at=at)[workload_field(workload.id)]


def spend_projected_month_end(*, month_to_date: Decimal, at: datetime | None = None) -> Decimal:
    """Linear projection of month-to-date spend to the month's end. The first
    hour counts as a full hour, so a month that just began does not project
    one early request into a fortune."""
    at = _utc(at)
    start, end = month_bounds(at)
    elapsed = max((at - start).total_seconds(), 3600.0)
    total = (end - start).total_seconds()
    if elapsed >= total:
        return month_to_date
    return (month_to_date * Decimal(total) / Decimal(elapsed)).quantize(Decimal("0.000001"))


@dataclass(frozen=True)
class SpendStatus:
    budget: SpendBudget
    month_to_date: Decimal
    projected: Decimal

    @property
    def fraction(self) -> float:
        return float(self.month_to_date / self.budget.monthly_amount) if self.budget.monthly_amount else 0.0

    @property
    def projected_fraction(self) -> float:
        return float(self.projected / self.budget.monthly_amount) if self.budget.monthly_amount else 0.0

    @property
    def state(self) -> str:
        """``ok``, ``soft`` (past the soft threshold) or ``over`` (budget spent)."""
        if self.month_to_date >= self.budget.monthly_amount:
            return "over"
        if self.fraction >= self.budget.soft_threshold:
            return "soft"
        return "ok"


def spend_statuses(*, budgets: list[SpendBudget], at: datetime | None = None) -> list[SpendStatus]:
    at = _utc(at)
    mtd = spend_month_to_date_many(
        tenant_ids={b.tenant_id for b in budgets if b.tenant_id},
        workload_ids={b.workload_id for b in budgets if b.workload_id},
        at=at,
    )
    statuses = []
    for budget in budgets:
        field = tenant_field(budget.tenant_id) if budget.tenant_id else workload_field(budget.workload_id)
        spent = mtd.get(field, Decimal(0))
        statuses.append(SpendStatus(budget=budget, month_to_date=spent,
                                    projected=spend_projected_month_end(month_to_date=spent, at=at)))
    return statuses


def spend_budgets_of_tenant(*, tenant: Tenant) -> list[SpendBudget]:
    """The tenant's own budget first, then its workloads' budgets."""
    from django.db.models import Q

    return list(
        SpendBudget.objects.filter(Q(tenant=tenant) | Q(workload__tenant=tenant))
        .select_related("tenant", "workload", "workload__tenant").order_by("workload__slug")
    )


# --- writing: reconciliation and threshold notifications -----------------------------


@dataclass(frozen=True)
class ReconcileResult:
    pools: int
    fields: int
    notifications: int


def spend_reconcile(*, at: datetime | None = None) -> ReconcileResult:
    """Overwrite the month's Redis spend fields from the ledger's sums, then
    notify budgets that crossed a threshold. A settlement landing between the
    ledger read and the write is lost from Redis until the next run, which
    reads it from the ledger: the error is bounded and heals itself."""
    at = _utc(at)
    start, end = month_bounds(at)
    month = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end).order_by()
    per_pool: dict[int, dict[str, str]] = defaultdict(dict)
    for row in month.values("pool_id", "tenant_id").annotate(c=Sum("cost")):
        per_pool[row["pool_id"]][tenant_field(row["tenant_id"])] = str(to_micro(row["c"] or 0))
    for row in month.values("pool_id", "workload_id").annotate(c=Sum("cost")):
        per_pool[row["pool_id"]][workload_field(row["workload_id"])] = str(to_micro(row["c"] or 0))
    written = 0
    if per_pool:
        pipe = get_redis().pipeline(transaction=False)
        for pool_id, mapping in per_pool.items():
            pipe.hset(spend_month_key(pool_id=pool_id, at=at), mapping=mapping)
            written += len(mapping)
        pipe.execute()
    notified = spend_thresholds_check(at=at)
    return ReconcileResult(pools=len(per_pool), fields=written, notifications=notified)


def spend_threshold_notify(*, status: SpendStatus, at: datetime) -> Notification | None:
    """Notify once per budget, month and kind; returns the new notification."""
    budget = status.budget
    if status.state == "ok":
        return None
    over = status.state == "over"
    kind = Notification.Kind.SPEND_HARD_CAP if over else Notification.Kind.SPEND_SOFT_THRESHOLD
    scope = f"W{budget.workload_id}" if budget.workload_id else f"T{budget.tenant_id}"
    tenant = budget.tenant if budget.tenant_id else budget.workload.tenant
    if over:
        what = "has spent its monthly budget" + (" and new requests are refused" if budget.hard_cap else "")
    else:
        what = f"passed {budget.soft_threshold:.0%} of its monthly budget"
    message = (f"{budget.scope_label.capitalize()} {what}: {status.month_to_date:.2f} of "
               f"{budget.monthly_amount:.2f} {budget.currency} month to date, projected {status.projected:.2f}.")
    notification = notification_create(
        tenant=tenant, workload=budget.workload if budget.workload_id else None, kind=kind, message=message,
        dedupe_key=f"spend:{kind}:{scope}:{at:%Y-%m}",
    )
    if notification is not None:
        spend_threshold_crossed.send(sender=SpendBudget, budget=budget, month_to_date=status.month_to_date, kind=kind)
    return notification


def spend_thresholds_check(*, at: datetime | None = None) -> int:
    at = _utc(at)
    budgets = list(SpendBudget.objects.select_related("tenant", "workload", "workload__tenant"))
    created = 0
    for status in spend_statuses(budgets=budgets, at=at):
        if spend_threshold_notify(status=status, at=at) is not None:
            created += 1
    return created
