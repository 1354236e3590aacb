"""Services for budget-slice requests: submit, approve against the pool's
real headroom, reject, and lapse at the end date.

Approval can never oversubscribe a pool: it locks the pool's row
(``SELECT ... FOR UPDATE``) before re-reading the reservations, so two
approvals on one pool run one after the other and the second sees the first's
reservation. Every approval path takes the pool lock first, then the request,
so they cannot deadlock; the reservation itself is written by
budgets/services/reservations.py, under that same lock, like every other
write (Django admin included). The saved Reservation reaches admission
through the on-commit push in budgets/signals.py, within moments of the
commit."""

from __future__ import annotations

from dataclasses import asdict
from datetime import date
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Max
from django.utils import timezone
from django.utils.text import slugify

from tenants.models import Tenant, Workload

from budgets.models import InferencePool, Reservation
from budgets.models import BudgetRequest, BudgetRequestEvent
from budgets.models import Notification, SpendBudget
from budgets.services.notifications import notification_create
from budgets.selectors.pools import budget_request_preview
from budgets.services.reservations import reservation_delete, reservation_save


def _event(*, request: BudgetRequest, action: str, actor=None, comment: str = "", details: dict | None = None) -> None:
    BudgetRequestEvent.objects.create(
        request=request, action=action, actor=actor, actor_name=getattr(actor, "username", "") or "",
        comment=comment, details=details or {},
    )


def budget_request_submit(
    *, tenant: Tenant, user, pool: InferencePool, reserved_tpm: int, ceiling_tpm: int, rpm: int, justification: str,
    workload: Workload | None = None, new_workload_name: str = "", new_workload_class: str = "",
    lend_fraction: float = 0.0, ends_on: date | None = None, monthly_spend_budget: Decimal | None = None,
    spend_soft_threshold: float = 0.8, spend_hard_cap: bool = False,
) -> BudgetRequest:
    """Record a member's request; raises ValidationError with field errors."""
    errors: dict[str, str] = {}
    new_workload_name = (new_workload_name or "").strip()
    if workload is None and not new_workload_name:
        errors["workload"] = "Choose a workload, or name a new one."
    if workload is not None and new_workload_name:
        errors["new_workload_name"] = "Either choose an existing workload or name a new one, not both."
    if workload is not None and workload.tenant_id != tenant.id:
        errors["workload"] = "Unknown workload."
    if workload is None and new_workload_name:
        if new_workload_class not in Workload.WorkloadClass.values:
            errors["new_workload_class"] = "Choose the new workload's class."
        if not slugify(new_workload_name):
            errors["new_workload_name"] = "Use letters or digits in the name."
    if not pool.is_active:
        errors["pool"] = "This pool is not active."
    elif workload is not None and workload.allowed_models and not set(pool.served_models or ()) & set(
            workload.allowed_models):
        # A slice there could never serve it: its route would hold a pool it cannot use.
        errors["pool"] = (f"{pool} serves none of the models this workload may call "
                          f"({', '.join(sorted(workload.allowed_models))}).")
    elif not pool.served_models:
        errors["pool"] = f"{pool} serves no model."
    if ceiling_tpm < reserved_tpm:
        errors["ceiling_tpm"] = "The ceiling must be at least the reserved rate."
    elif ceiling_tpm > pool.admission_tpm + 1e-9:
        errors["ceiling_tpm"] = f"The ceiling cannot exceed the pool's admission budget ({pool.admission_tpm:,.0f} TPM)."
    if reserved_tpm > pool.admission_tpm + 1e-9:
        errors["reserved_tpm"] = f"The pool's whole admission budget is {pool.admission_tpm:,.0f} TPM."
    if rpm > pool.admission_rpm + 1e-9:
        errors["rpm"] = f"The pool's whole admission budget is {pool.admission_rpm:,.0f} RPM."
    if not (justification or "").strip():
        errors["justification"] = "Say why the slice is needed."
    if ends_on is not None and ends_on <= timezone.now().date():
        errors["ends_on"] = "The end date must be in the future."
    if workload is not None and BudgetRequest.objects.filter(workload=workload, status=BudgetRequest.Status.PENDING).exists():
        errors["workload"] = "This workload already has a pending request."
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        request = BudgetRequest(
            tenant=tenant, requested_by=user, pool=pool, workload=workload,
            new_workload_name="" if workload else new_workload_name,
            new_workload_class="" if workload else new_workload_class,
            reserved_tpm=reserved_tpm, ceiling_tpm=ceiling_tpm, rpm=rpm, lend_fraction=lend_fraction,
            justification=justification.strip(), ends_on=ends_on, monthly_spend_budget=monthly_spend_budget,
            spend_soft_threshold=spend_soft_threshold, spend_hard_cap=spend_hard_cap,
        )
        request.full_clean(exclude=["tenant", "requested_by", "pool", "workload"])
        request.save()
        _event(request=request, action=BudgetRequestEvent.Action.SUBMITTED, actor=user)
    return request


def _unique_workload_slug(tenant: Tenant, name: str) -> str:
    base = slugify(f"{tenant.slug}-{name}")[:90] or f"{tenant.slug}-workload"
    slug, n = base, 2
    while Workload.objects.filter(slug=slug).exists():
        slug, n = f"{base}-{n}", n + 1
    return slug


def _new_workload_for(request: BudgetRequest, pool: InferencePool) -> Workload:
    """A workload for an approved request that named a new one. Its request
    caps follow the defaults, shrunk where needed so its largest request fits
    the ceiling's burst (Reservation.clean's rule)."""
    workload = Workload(tenant=request.tenant, name=request.new_workload_name,
                        slug=_unique_workload_slug(request.tenant, request.new_workload_name),
                        workload_class=request.new_workload_class or Workload.WorkloadClass.INTERACTIVE)
    largest = int(request.ceiling_tpm * pool.burst_seconds / 60.0)
    if workload.prompt_tokens_cap + workload.max_tokens_cap > largest:
        workload.max_tokens_cap = max(1, min(workload.max_tokens_cap, largest // 4))
        workload.max_tokens_default = max(1, min(workload.max_tokens_default, workload.max_tokens_cap))
        workload.prompt_tokens_cap = max(1, largest - workload.max_tokens_cap)
    workload.full_clean()
    workload.save()
    return workload


def _reservation_snapshot(reservation: Reservation | None) -> dict | None:
    if reservation is None or reservation.pk is None:
        return None
    return {"pool_id": reservation.pool_id, "reserved_tpm": reservation.reserved_tpm,
            "ceiling_tpm": reservation.ceiling_tpm, "rpm": reservation.rpm, "lend_fraction": reservation.lend_fraction}


def budget_request_approve(*, request_id: int, approver, comment: str = "",
                           reserved_tpm: int | None = None) -> BudgetRequest:
    """Approve a pending request: reserve its slice, create its workload if it
    named a new one, set its spend budget. ``reserved_tpm`` grants less than
    was asked (at least 1, at most the request's own figure): the request
    keeps what was asked (its contents are an audit record), the reservation
    and the approval event hold what was granted.
    Raises ValidationError (field errors) when the pool lacks the headroom,
    the amount is out of bounds or the request is not pending."""
    pool_id = BudgetRequest.objects.values_list("pool_id", flat=True).get(pk=request_id)
    with transaction.atomic():
        pool = InferencePool.objects.select_for_update().get(pk=pool_id)
        request = BudgetRequest.objects.select_for_update(of=("self",)).select_related("workload", "tenant").get(pk=request_id)
        if not request.is_pending:
            raise ValidationError({"status": f"This request is already {request.status}."})
        request.pool = pool
        asked_tpm = request.reserved_tpm
        granted_tpm = asked_tpm if reserved_tpm is None else reserved_tpm
        if not 1 <= granted_tpm <= asked_tpm:
            raise ValidationError({"reserved_tpm": f"Approve between 1 and the {asked_tpm:,} TPM asked for."})
        preview = budget_request_preview(request=request, reserved_tpm=granted_tpm)
        if not preview.fits:
            raise ValidationError(preview.problems)
        workload = request.workload if request.workload_id else _new_workload_for(request, pool)
        # The workload's slice of this pool: changed if it holds one, else a
        # new one, last in its route (an overflow behind its other slices;
        # an admin may rank it as a replica instead).
        reservation = Reservation.objects.select_for_update().filter(workload=workload, pool=pool).first()
        previous = _reservation_snapshot(reservation)
        if reservation is None:
            last_rank = Reservation.objects.filter(workload=workload).aggregate(last=Max("rank"))["last"]
            reservation = Reservation(workload=workload, rank=0 if last_rank is None else last_rank + 1)
        reservation.pool = pool
        reservation.reserved_tpm = granted_tpm
        reservation.ceiling_tpm = request.ceiling_tpm
        reservation.rpm = request.rpm
        reservation.lend_fraction = request.lend_fraction
        reservation_save(reservation=reservation)
        if request.monthly_spend_budget is not None:
            SpendBudget.objects.update_or_create(
                workload=workload,
                defaults={"monthly_amount": request.monthly_spend_budget, "soft_threshold": request.spend_soft_threshold,
                          "hard_cap": request.spend_hard_cap},
            )
        request.workload = workload
        request.status = BudgetRequest.Status.APPROVED
        request.decided_by = approver
        request.decided_at = timezone.now()
        request.decision_comment = comment.strip()
        request.save()
        _event(request=request, action=BudgetRequestEvent.Action.APPROVED, actor=approver, comment=comment.strip(),
               details={"headroom_before": asdict(preview.headroom), "headroom_after": asdict(preview.after),
                        "previous_reservation": previous, "workload_id": workload.id,
                        "requested_reserved_tpm": asked_tpm, "approved_reserved_tpm": granted_tpm})
        notification_create(
            tenant=request.tenant, workload=workload, kind=Notification.Kind.REQUEST_APPROVED,
            dedupe_key=f"request:{request.pk}:approved",
            message=(f"Budget request #{request.pk} for {workload.slug} was approved: {granted_tpm:,} TPM reserved"
                     + (f" (of {asked_tpm:,} asked)" if granted_tpm != asked_tpm else "") + ", "
                     f"ceiling {request.ceiling_tpm:,} TPM, {request.rpm:,} RPM on {pool}."
                     + (f" Comment: {comment.strip()}" if comment.strip() else "")),
        )
    return request


def budget_request_reject(*, request_id: int, reviewer, comment: str) -> BudgetRequest:
    if not (comment or "").strip():
        raise ValidationError({"comment": "Say why the request is rejected."})
    with transaction.atomic():
        request = BudgetRequest.objects.select_for_update(of=("self",)).select_related("workload", "tenant").get(pk=request_id)
        if not request.is_pending:
            raise ValidationError({"status": f"This request is already {request.status}."})
        request.status = BudgetRequest.Status.REJECTED
        request.decided_by = reviewer
        request.decided_at = timezone.now()
        request.decision_comment = comment.strip()
        request.save()
        _event(request=request, action=BudgetRequestEvent.Action.REJECTED, actor=reviewer, comment=comment.strip())
        notification_create(
            tenant=request.tenant, workload=request.workload, kind=Notification.Kind.REQUEST_REJECTED,
            dedupe_key=f"request:{request.pk}:rejected",
            message=f"Budget request #{request.pk} for {request.workload_label} was rejected: {comment.strip()}",
        )
    return request


def budget_request_withdraw(*, request_id: int, tenant: Tenant, user) -> BudgetRequest:
    """A member takes back their tenant's pending request (the view checks
    that ``user`` may change ``tenant``). Raises DoesNotExist for another
    tenant's request, ValidationError when it is no longer pending (an
    approval that locked it first wins)."""
    with transaction.atomic():
        request = BudgetRequest.objects.select_for_update(of=("self",)).select_related("workload", "tenant").get(
            pk=request_id, tenant=tenant)
        if not request.is_pending:
            raise ValidationError({"status": f"This request is already {request.status}."})
        request.status = BudgetRequest.Status.WITHDRAWN
        request.decided_at = timezone.now()
        request.save(update_fields=["status", "decided_at"])
        _event(request=request, action=BudgetRequestEvent.Action.WITHDRAWN, actor=user)
    return request


def _reservation_restore(*, reservation: Reservation, previous: dict) -> str:
    """Put back the reservation an approval replaced (its pool is locked). It
    may no longer fit: the approval shrank it and others took the freed
    headroom since. Then the slice stays as approved, and the outcome says so."""
    for name in ("reserved_tpm", "ceiling_tpm", "rpm", "lend_fraction"):
        setattr(reservation, name, previous[name])
    try:
        reservation_save(reservation=reservation)
    except ValidationError as exc:
        reservation.refresh_from_db()
        problems = " ".join(message for messages in exc.message_dict.values() for message in messages)
        return f"the previous reservation no longer fits the pool ({problems}); left as approved"
    return "previous reservation restored"


def budget_requests_expire(*, today: date | None = None) -> int:
    """Lapse approved slices whose end date has passed: restore the workload's
    reservation from before the approval (or remove it, if the approval
    created it), unless a later change superseded the slice. Returns how many
    requests expired."""
    today = today or timezone.now().date()
    expired = 0
    due = BudgetRequest.objects.filter(status=BudgetRequest.Status.APPROVED, ends_on__lt=today).values_list("id", "pool_id")
    for request_id, pool_id in list(due):
        with transaction.atomic():
            InferencePool.objects.select_for_update().get(pk=pool_id)
            request = BudgetRequest.objects.select_for_update(of=("self",)).select_related("workload", "tenant").get(pk=request_id)
            if request.status != BudgetRequest.Status.APPROVED:
                continue
            approval = request.events.filter(action=BudgetRequestEvent.Action.APPROVED).last()
            previous = (approval.details or {}).get("previous_reservation") if approval else None
            reservation = Reservation.objects.select_for_update().filter(workload=request.workload,
                                                                          pool_id=request.pool_id).first()
            # What the approval granted (a smaller amount than asked, maybe).
            granted_tpm = ((approval.details or {}).get("approved_reserved_tpm") if approval else None) \
                or request.reserved_tpm
            unchanged = reservation is not None and (
                reservation.reserved_tpm, reservation.ceiling_tpm, reservation.rpm
            ) == (granted_tpm, request.ceiling_tpm, request.rpm)
            outcome = "superseded by a later change; left as is"
            if unchanged and previous is None:
                reservation_delete(reservation=reservation)
                outcome = "reservation removed"
            elif unchanged:
                # The slice of this same pool as it was before (slices are per pool).
                outcome = _reservation_restore(reservation=reservation, previous=previous)
            request.status = BudgetRequest.Status.EXPIRED
            request.save()
            _event(request=request, action=BudgetRequestEvent.Action.EXPIRED, details={"outcome": outcome})
            notification_create(
                tenant=request.tenant, workload=request.workload, kind=Notification.Kind.REQUEST_EXPIRED,
                dedupe_key=f"request:{request.pk}:expired",
                message=f"The slice of budget request #{request.pk} for {request.workload_label} ended on "
                        f"{request.ends_on:%Y-%m-%d}: {outcome}.",
            )
            expired += 1
    return expired
