"""Month-to-date spend against monthly spend budgets.

Redis holds each tenant's month-to-date spend over all its pools, under the
tenant's own hash tag (budgets/admission/keys.py, ``tenant_spend_month``), in
micro-units of the price table's currency (an integer: 1.25 USD = 1_250_000),
one hash per tenant and UTC month with fields ``T<tenant id>`` and one
``<workload id>`` per workload. Admission holds a request's estimated cost
there before the pool admits it (budgets/admission/spend_holds.py) and
settlement corrects it to the actual cost. Every minute ``spend_reconcile``
rewrites it from the ledger, which is the truth (the month's final days
through their daily rollups), plus the requests still in flight, and pushes
the hard caps beside it.

Keep month-to-date = the ledger's cost of the month + the estimate of every
request admitted and not settled (+ the actual cost of those settled whose
ledger row is on its way): a reconcile that forgot the requests in flight
would lower month-to-date under the cap and let more through."""

from __future__ import annotations

import calendar
import logging
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import ROUND_HALF_UP, Decimal

from django.db import connection, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from tenants.models import Tenant, Workload

from budgets.admission import keys
from budgets.admission.spend_holds import spend_reconcile_call
from budgets.ledger.rollups import rollup_final_through
from budgets.models import UsageRecord
from budgets.selectors.usage import UsageFilters, UsageRow, usage_rows
from budgets.models import Notification, SpendBudget
from budgets.services.notifications import notification_create
from budgets.redis.clients import get_redis, unavailable_note

logger = logging.getLogger(__name__)

MICRO = Decimal(1_000_000)
# Request ids per database query when reconciliation asks which holds the
# ledger already has.
_IDS_PER_QUERY = 5_000

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


def month_of(at: datetime) -> str:
    """The UTC month of ``at`` as month-to-date keys name it: ``YYYY-MM``."""
    return f"{_utc(at):%Y-%m}"


def month_start(month: str) -> datetime:
    """The first instant of a ``YYYY-MM`` month (UTC)."""
    return datetime.strptime(month, "%Y-%m").replace(tzinfo=dt_timezone.utc)


def spend_month_key(*, tenant_id: int, at: datetime) -> str:
    """The Redis hash of a tenant's month-to-date spend for ``at``'s UTC month."""
    return keys.tenant_spend_month(tenant_id, month_of(at))


# The month spend_month answered last: (its first ms, its end ms, YYYY-MM).
_month_known: tuple[float, float, str] = (0.0, 0.0, "")


def spend_month(*, at_ms: float) -> tuple[str, float]:
    """For admission: the month (``YYYY-MM``) of a moment in ms, and when that
    month ends (ms): a request refused for its spend cap may retry then.
    Every admission asks, so the month's bounds are kept until a moment
    falls outside them (working them out was 3% of the web's samples)."""
    global _month_known
    start_ms, end_ms, month = _month_known
    if start_ms <= at_ms < end_ms:
        return month, end_ms
    at = datetime.fromtimestamp(at_ms / 1000, tz=dt_timezone.utc)
    start, end = month_bounds(at)
    _month_known = (start.timestamp() * 1000, end.timestamp() * 1000, month_of(at))
    return _month_known[2], _month_known[1]


def tenant_field(tenant_id: int) -> str:
    return f"T{tenant_id}"


def workload_field(workload_id: int) -> str:
    return str(workload_id)


def overflow_field(workload_id: int) -> str:
    """The workload's spend on overflow slices (routing across pools)."""
    return f"O{workload_id}"


def spend_caps_of_tenants(*, tenant_ids: list[int]) -> dict[int, dict[str, int]]:
    """Hard caps in micro-units by tenant: ``T<tenant id>`` for the tenant's
    own budget and ``<workload id>`` for each of its workloads' budgets."""
    caps: dict[int, dict[str, int]] = {tenant_id: {} for tenant_id in tenant_ids}
    budgets = (SpendBudget.objects.filter(hard_cap=True)
               .filter(Q(tenant_id__in=tenant_ids) | Q(workload__tenant_id__in=tenant_ids))
               .values_list("tenant_id", "workload_id", "workload__tenant_id", "monthly_amount"))
    for tenant_id, workload_id, workload_tenant_id, amount in budgets:
        if tenant_id:
            caps[tenant_id][tenant_field(tenant_id)] = to_micro(amount)
        else:
            caps[workload_tenant_id][workload_field(workload_id)] = to_micro(amount)
    overflow_caps = (Workload.objects.filter(tenant_id__in=tenant_ids, overflow_monthly_cap__isnull=False)
                     .values_list("tenant_id", "id", "overflow_monthly_cap"))
    for tenant_id, workload_id, amount in overflow_caps:
        caps[tenant_id][overflow_field(workload_id)] = to_micro(amount)
    return caps


# --- reading month-to-date ------------------------------------------------------------


def _month_costs(*, at: datetime, tenant_ids=None, workload_ids=None) -> dict[tuple[int, int], UsageRow]:
    """The ledger's sums of ``at``'s month per (tenant, workload) that has
    rows in it, optionally only of some tenants or some workloads.

    Read as the usage pages read it (``usage_rows``): the days the daily
    rollup holds as final from DailyUsage, the rest of the month from the
    ledger. Every minute's reconciliation then reads a day or two of ledger
    rows, not the month's, which grow all month. The rollup rebuilds a day
    that turned final, with every row of that day, and commits it before it
    moves ``final_through`` past it: a read that sees the new
    ``final_through`` sees those rows."""
    start, end = month_bounds(at)
    filters = UsageFilters(
        start=start.date(), end=(end - timedelta(days=1)).date(),
        tenant_ids=frozenset(tenant_ids) if tenant_ids is not None else None,
        workload_ids=frozenset(workload_ids) if workload_ids is not None else None,
    )
    rows = usage_rows(filters=filters, group_by=("tenant", "workload"), final=rollup_final_through())
    return {(row.key["tenant"], row.key["workload"]): row for row in rows}


def _ledger_month_to_date(*, tenant_ids: set[int], workload_ids: set[int], at: datetime) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    if tenant_ids:
        for (tenant_id, _workload_id), cost in _month_costs(at=at, tenant_ids=tenant_ids).items():
            field = tenant_field(tenant_id)
            out[field] = out.get(field, Decimal(0)) + cost.cost
    if workload_ids:
        for (_tenant_id, workload_id), cost in _month_costs(at=at, workload_ids=workload_ids).items():
            out[workload_field(workload_id)] = cost.cost
    return out


def spend_month_to_date_many(*, tenant_ids: set[int] = frozenset(), workload_ids: set[int] = frozenset(),
                             at: datetime | None = None) -> dict[str, Decimal]:
    """Month-to-date spend keyed ``T<tenant id>`` / ``<workload id>``, from
    the tenants' Redis hashes in one round trip (requests in flight at their
    estimate); a field Redis lacks (not spent through admission yet, Redis
    flushed or unreachable) is read from the ledger."""
    if not tenant_ids and not workload_ids:
        return {}
    at = _utc(at)
    month = month_of(at)
    owners = dict(Workload.objects.filter(id__in=workload_ids).values_list("id", "tenant_id")) if workload_ids else {}
    fields_of: dict[int, list[str]] = defaultdict(list)
    for tenant_id in sorted(tenant_ids):
        fields_of[tenant_id].append(tenant_field(tenant_id))
    for workload_id in sorted(workload_ids):
        if workload_id in owners:
            fields_of[owners[workload_id]].append(workload_field(workload_id))
    totals: dict[str, Decimal] = {}
    try:
        pipe = get_redis().pipeline(transaction=False)
        tenants = sorted(fields_of)
        for tenant_id in tenants:
            pipe.hmget(keys.tenant_spend_month(tenant_id, month), fields_of[tenant_id])
        for tenant_id, values in zip(tenants, pipe.execute() if tenants else []):
            for field, value in zip(fields_of[tenant_id], values):
                if value is not None:
                    totals[field] = from_micro(int(float(value)))
    except Exception:  # noqa: BLE001 - Redis away: the ledger answers
        unavailable_note("month-to-date spend")
        totals.clear()
    missing_t = {t for t in tenant_ids if tenant_field(t) not in totals}
    missing_w = {w for w in workload_ids if workload_field(w) not in totals}
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
    return list(
        SpendBudget.objects.filter(Q(tenant=tenant) | Q(workload__tenant=tenant))
        .select_related("tenant", "workload", "workload__tenant").order_by("workload__slug")
    )


# --- writing: reconciliation and threshold notifications -----------------------------


@contextmanager
def _one_snapshot():
    """Every query inside reads the same snapshot of the database (taken at
    the first query): PostgreSQL's REPEATABLE READ; SQLite's read transaction
    is one snapshot already. Inside a caller's transaction, that transaction
    is the snapshot it gets."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        yield


@dataclass(frozen=True)
class SpendSynced:
    tenants: int
    fields: int  # month-to-date fields written
    holds_counted: int  # requests in flight (or settled, their ledger row on its way)
    holds_dropped: int  # confirmed by the ledger, or expired (a leaked estimate repaired)


def spend_tenants_sync(*, tenant_ids: list[int] | None = None, at: datetime | None = None) -> SpendSynced:
    """Rewrite the tenants' spend keys in Redis (every tenant when
    ``tenant_ids`` is None): hard caps from the spend budgets, month-to-date
    of ``at``'s month from the ledger plus the requests in flight.

    The ledger's sums and the question "which held requests are in the ledger
    already" are answered from one database snapshot, and the holds are listed
    after that snapshot was taken: a request is then counted exactly once, by
    the ledger or by its hold, however settlements and ledger writes interleave
    (budgets/admission/spend_reconcile.lua says why)."""
    at = _utc(at)
    month = month_of(at)
    client = get_redis()
    ledger: dict[int, dict[str, int]] = defaultdict(dict)
    with _one_snapshot():
        tenant_costs: dict[int, Decimal] = defaultdict(Decimal)
        for (tenant_id, workload_id), cost in _month_costs(at=at, tenant_ids=tenant_ids).items():
            ledger[tenant_id][workload_field(workload_id)] = to_micro(cost.cost)
            tenant_costs[tenant_id] += cost.cost
            if cost.overflow_requests:
                ledger[tenant_id][overflow_field(workload_id)] = to_micro(cost.overflow_cost)
        for tenant_id, cost in tenant_costs.items():
            ledger[tenant_id][tenant_field(tenant_id)] = to_micro(cost)
        if tenant_ids is None:
            tenants = sorted(set(Tenant.objects.values_list("id", flat=True)) | set(ledger))
        else:
            tenants = sorted(set(tenant_ids))
        caps = spend_caps_of_tenants(tenant_ids=tenants)
        # Listed now, after the snapshot began: see the docstring.
        pipe = client.pipeline(transaction=False)
        for tenant_id in tenants:
            pipe.hkeys(keys.tenant_spend_holds(tenant_id))
        held = dict(zip(tenants, pipe.execute() if tenants else []))
        every_id = [request_id for ids in held.values() for request_id in ids]
        in_ledger: set[str] = set()
        for first in range(0, len(every_id), _IDS_PER_QUERY):
            chunk = every_id[first:first + _IDS_PER_QUERY]
            in_ledger.update(UsageRecord.objects.filter(request_id__in=chunk).values_list("request_id", flat=True))
    fields = counted = dropped = 0
    for tenant_id in tenants:
        result = spend_reconcile_call(
            tenant_id=tenant_id, month=month, caps_micro=caps.get(tenant_id, {}), ledger_micro=ledger.get(tenant_id, {}),
            in_ledger=[request_id for request_id in held[tenant_id] if request_id in in_ledger],
        ).run(client)
        fields += result.fields
        counted += result.holds_counted
        dropped += result.holds_dropped
    return SpendSynced(tenants=len(tenants), fields=fields, holds_counted=counted, holds_dropped=dropped)


def spend_tenant_restore(*, tenant_id: int, month: str) -> None:
    """Admission found the tenant's caps or month-to-date missing from Redis
    (a new month, a flush, a restart): rebuild them before it admits, so a
    lost month-to-date never reads as nothing spent."""
    spend_tenants_sync(tenant_ids=[tenant_id], at=month_start(month))


def spend_tenant_sync_on_commit(*, tenant_id: int) -> None:
    """A spend budget changed: push the tenant's caps once the change commits."""

    def push() -> None:
        try:
            spend_tenants_sync(tenant_ids=[tenant_id])
        except Exception:  # Redis down: the next reconciliation catches up
            logger.warning("could not push the spend caps of tenant %s to Redis", tenant_id, exc_info=True)

    transaction.on_commit(push)


@dataclass(frozen=True)
class ReconcileResult:
    tenants: int
    fields: int
    holds_counted: int
    holds_dropped: int
    notifications: int


def spend_reconcile(*, at: datetime | None = None) -> ReconcileResult:
    """Every tenant's spend keys from the database and the requests in flight
    (``spend_tenants_sync``), then notify budgets that crossed a threshold."""
    at = _utc(at)
    synced = spend_tenants_sync(at=at)
    notified = spend_thresholds_check(at=at)
    return ReconcileResult(tenants=synced.tenants, fields=synced.fields, holds_counted=synced.holds_counted,
                           holds_dropped=synced.holds_dropped, notifications=notified)


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
