"""Selectors that read a pool: which pools a user may see, its headroom for
new reservations and what a budget request's approval would leave."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db.models import QuerySet, Sum

from tenants.roles import user_is_platform_admin

from budgets.models import InferencePool, Reservation, UsageRecord
from budgets.models import BudgetRequest


@dataclass(frozen=True)
class PoolHeadroom:
    """Approved reservations against the pool's admission budget
    (headroom x provider limits): what is left to hand out."""

    admission_tpm: int
    admission_rpm: int
    reserved_tpm: int
    reserved_rpm: int

    @property
    def free_tpm(self) -> int:
        return self.admission_tpm - self.reserved_tpm

    @property
    def free_rpm(self) -> int:
        return self.admission_rpm - self.reserved_rpm

    @property
    def reserved_fraction(self) -> float:
        return self.reserved_tpm / self.admission_tpm if self.admission_tpm else 0.0


def pool_headroom(*, pool: InferencePool) -> PoolHeadroom:
    sums = Reservation.objects.filter(pool=pool).aggregate(t=Sum("reserved_tpm"), r=Sum("rpm"))
    return PoolHeadroom(
        # Floors: Reservation.clean allows a sum up to the (fractional) budget.
        admission_tpm=int(pool.admission_tpm + 1e-9),
        admission_rpm=int(pool.admission_rpm + 1e-9),
        reserved_tpm=sums["t"] or 0,
        reserved_rpm=sums["r"] or 0,
    )


@dataclass(frozen=True)
class ApprovalPreview:
    headroom: PoolHeadroom  # now
    current_reserved_tpm: int  # the workload's reservation on this pool now (0: none)
    current_rpm: int
    after: PoolHeadroom  # if the request were approved
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems


def budget_request_candidate(*, request: BudgetRequest, reserved_tpm: int | None = None) -> Reservation:
    """The reservation approval would save (not saved); ``reserved_tpm``: a
    smaller figure the reviewer grants instead of the one asked."""
    workload = request.workload if request.workload_id else None
    reservation = Reservation.objects.filter(workload=workload, pool=request.pool).first() if workload else None
    if reservation is None:
        reservation = Reservation(workload=workload) if workload else Reservation()
    reservation.pool = request.pool
    reservation.reserved_tpm = request.reserved_tpm if reserved_tpm is None else reserved_tpm
    reservation.ceiling_tpm = request.ceiling_tpm
    reservation.rpm = request.rpm
    reservation.lend_fraction = request.lend_fraction
    return reservation


def budget_request_preview(*, request: BudgetRequest, reserved_tpm: int | None = None) -> ApprovalPreview:
    """What approving ``request`` (with ``reserved_tpm`` instead of the
    figure asked, when given) would do to its pool, and why it cannot be
    approved if it cannot (the same rules Reservation.clean enforces)."""
    pool = request.pool
    granted_tpm = request.reserved_tpm if reserved_tpm is None else reserved_tpm
    headroom = pool_headroom(pool=pool)
    current = (
        Reservation.objects.filter(pool=pool, workload_id=request.workload_id).first() if request.workload_id else None
    )
    cur_tpm = current.reserved_tpm if current else 0
    cur_rpm = current.rpm if current else 0
    after = PoolHeadroom(
        admission_tpm=headroom.admission_tpm, admission_rpm=headroom.admission_rpm,
        reserved_tpm=headroom.reserved_tpm - cur_tpm + granted_tpm,
        reserved_rpm=headroom.reserved_rpm - cur_rpm + request.rpm,
    )
    problems: dict[str, str] = {}
    if not pool.is_active:
        problems["pool"] = f"The pool {pool} is not active."
    if request.workload_id and not request.workload.is_active:
        problems["workload"] = f"The workload {request.workload.slug} is not active."
    if after.free_tpm < 0:
        problems["reserved_tpm"] = (
            f"Approval would reserve {after.reserved_tpm:,} TPM on {pool}, {-after.free_tpm:,} above its admission "
            f"budget of {headroom.admission_tpm:,} TPM (free now: {headroom.free_tpm:,})."
        )
    if after.free_rpm < 0:
        problems["rpm"] = (
            f"Approval would reserve {after.reserved_rpm:,} RPM on {pool}, {-after.free_rpm:,} above its admission "
            f"budget of {headroom.admission_rpm:,} RPM (free now: {headroom.free_rpm:,})."
        )
    candidate = budget_request_candidate(request=request, reserved_tpm=reserved_tpm)
    try:
        candidate.clean()
    except ValidationError as exc:
        for name, messages in exc.message_dict.items():
            problems.setdefault(name, " ".join(messages))
    return ApprovalPreview(headroom=headroom, current_reserved_tpm=cur_tpm, current_rpm=cur_rpm, after=after,
                           problems=problems)


def pool_headrooms(*, pools: list[InferencePool]) -> dict[int, PoolHeadroom]:
    """Each pool's headroom, by pool id."""
    return {pool.id: pool_headroom(pool=pool) for pool in pools}


def pools_active() -> list[InferencePool]:
    return list(InferencePool.objects.filter(is_active=True).order_by("slug"))


def pool_by_slug(*, slug: str) -> InferencePool:
    return InferencePool.objects.get(slug=slug)


def pool_active_by_slug(*, slug: str) -> InferencePool:
    """An active pool (one a budget request may ask for); else DoesNotExist."""
    return InferencePool.objects.get(slug=slug, is_active=True)


def pools_for_user(*, user) -> QuerySet[InferencePool]:
    """Platform admins see every pool; everyone else the active ones."""
    pools = InferencePool.objects.order_by("slug")
    if not user_is_platform_admin(user):
        pools = pools.filter(is_active=True)
    return pools


def pool_for_user(*, user, slug: str) -> InferencePool:
    """A pool the user may see; an inactive one raises DoesNotExist for
    anyone but a platform admin, exactly like a missing one."""
    return pools_for_user(user=user).get(slug=slug)


@dataclass(frozen=True)
class ModelShare:
    """How much of one model's traffic a pool served (routing across pools)."""

    model: str
    pool_tokens: int  # actual tokens this pool served
    all_tokens: int  # actual tokens every pool served for the model

    @property
    def share(self) -> float:
        return self.pool_tokens / self.all_tokens if self.all_tokens else 0.0


def model_shares_of_pool(*, pool: InferencePool, since) -> list[ModelShare]:
    """For each model the pool serves, its share of that model's tokens since
    ``since`` across every pool (platform admins only; views check the role)."""
    models = list(pool.served_models or ())
    if not models:
        return []
    tokens = Sum("actual_input_tokens") + Sum("actual_output_tokens")
    rows = (UsageRecord.objects.filter(created_at__gte=since, model__in=models).order_by()
            .values("model", "pool_id").annotate(tokens=tokens))
    mine: dict[str, int] = {}
    every: dict[str, int] = {}
    for row in rows:
        every[row["model"]] = every.get(row["model"], 0) + (row["tokens"] or 0)
        if row["pool_id"] == pool.id:
            mine[row["model"]] = row["tokens"] or 0
    return [ModelShare(model=m, pool_tokens=mine.get(m, 0), all_tokens=every.get(m, 0)) for m in models]

