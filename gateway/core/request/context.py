"""Who a request runs for: the workload behind it, with its caps, its slices
(one per pool of its route, each with the prices in force there) and the
pool it is being admitted on. Built from the database by the web side (for
an API key, cached a few seconds) and by the worker side (for a job the
pacer releases, a cron firing)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from django.conf import settings
from django.utils import timezone

from budgets.ledger.pricing import TokenPrice, prices_in_force
from budgets.selectors.reservations import callable_models, slices_of_workload
from tenants.models import Workload


@dataclass(frozen=True)
class PoolSlice:
    """One slice of the workload's route: its pool and its own limits."""

    pool_id: int
    pool_slug: str
    pool_base_url: str
    pool_api_key_env: str
    served_models: tuple[str, ...]
    tokenizer: str
    safety_factor: float
    ceiling_tpm: int
    rpm: int
    reserved_tpm: int
    rank: int
    prices: dict[str, TokenPrice]
    sim_controls: bool


@dataclass(frozen=True)
class CallerContext:
    tenant_id: int
    tenant_slug: str
    workload_id: int
    workload_slug: str
    workload_class: str
    prompt_tokens_cap: int
    max_tokens_cap: int
    max_tokens_default: int
    queue_timeout_s: float
    # Every model some slice of its route serves that it may call.
    served_models: tuple[str, ...]
    # The route: every slice on an active pool, by rank.
    slices: tuple[PoolSlice, ...] = ()
    # The slice being admitted on: the primary until routing moves it
    # (``route``); None without any slice.
    pool: PoolSlice | None = None
    # The API key the request came with (None: a cron firing, a paced job's
    # release); the ledger row records it for the request log and key usage.
    api_key_id: int | None = None
    allowed_models: tuple[str, ...] = ()  # empty: any model its pools serve
    allow_overflow: bool = True
    # Set by ``route``: the rank of the model's primary slice, against which
    # the pool above is overflow or not.
    route_rank: int | None = None

    @property
    def pool_id(self) -> int | None:
        return self.pool.pool_id if self.pool else None

    @property
    def pool_slug(self) -> str:
        return self.pool.pool_slug if self.pool else ""

    @property
    def pool_base_url(self) -> str:
        return self.pool.pool_base_url if self.pool else ""

    @property
    def pool_api_key_env(self) -> str:
        return self.pool.pool_api_key_env if self.pool else ""

    @property
    def tokenizer(self) -> str:
        return self.pool.tokenizer if self.pool else "cl100k_base"

    @property
    def safety_factor(self) -> float:
        return self.pool.safety_factor if self.pool else 1.0

    @property
    def ceiling_tpm(self) -> int:
        return self.pool.ceiling_tpm if self.pool else 0

    @property
    def rpm(self) -> int:
        return self.pool.rpm if self.pool else 0

    @property
    def reserved_tpm(self) -> int:
        return self.pool.reserved_tpm if self.pool else 0

    @property
    def prices(self) -> dict[str, TokenPrice]:
        """Model -> price in force on the pool being admitted on."""
        return self.pool.prices if self.pool else {}

    @property
    def sim_controls(self) -> bool:
        """May the body carry the pool's test switches ("sim")? Only for a
        pool marked is_simulator, and only where SLUICE_SIM_CONTROLS is on."""
        return self.pool.sim_controls if self.pool else False

    @property
    def slice_rank(self) -> int:
        return self.pool.rank if self.pool else 0

    @property
    def overflow(self) -> bool:
        """The pool being admitted on is an overflow slice of the model's
        route (a rank above the model's primary)."""
        return self.pool is not None and self.route_rank is not None and self.pool.rank > self.route_rank

    @property
    def limits(self) -> dict[str, int]:
        """The x-ratelimit-limit-* numbers."""
        return {"tokens": self.ceiling_tpm, "requests": self.rpm}

    def route(self, model: str) -> tuple[CallerContext, ...]:
        """The contexts to admit a request for ``model`` on, in route order:
        every slice whose pool serves it, by rank (equal ranks in slice
        order: gateway/core/request/routing.py orders them by headroom). The
        lowest rank among them is this model's primary; higher ones are its
        overflow, in the route only where the workload allows overflow.
        Empty: no pool of its route serves the model, or the workload may
        not call it."""
        if self.allowed_models and model not in self.allowed_models:
            return ()
        serving = [s for s in self.slices if model in s.served_models]
        if not serving:
            return ()
        primary_rank = serving[0].rank
        return tuple(replace(self, pool=s, route_rank=primary_rank) for s in serving
                     if self.allow_overflow or s.rank == primary_rank)


def _slice(reservation, *, at) -> PoolSlice:
    pool = reservation.pool
    return PoolSlice(
        pool_id=pool.id, pool_slug=pool.slug, pool_base_url=pool.base_url, pool_api_key_env=pool.api_key_env,
        served_models=tuple(pool.served_models or ()), tokenizer=pool.tokenizer,
        safety_factor=pool.estimate_safety_factor, ceiling_tpm=reservation.ceiling_tpm, rpm=reservation.rpm,
        reserved_tpm=reservation.reserved_tpm, rank=reservation.rank,
        prices=prices_in_force(models=pool.served_models or (), at=at, pool_id=pool.id),
        sim_controls=bool(pool.is_simulator and settings.SLUICE_SIM_CONTROLS),
    )


def context_for_workload(workload: Workload) -> CallerContext:
    """The caller context of a workload (API keys, jobs, cron schedules), on
    its primary slice."""
    now = timezone.now()
    reservations = slices_of_workload(workload=workload)
    slices = tuple(_slice(r, at=now) for r in reservations if r.pool.is_active)
    allowed = tuple(workload.allowed_models or ())
    return CallerContext(
        tenant_id=workload.tenant_id,
        tenant_slug=workload.tenant.slug,
        workload_id=workload.id,
        workload_slug=workload.slug,
        workload_class=workload.workload_class,
        prompt_tokens_cap=workload.prompt_tokens_cap,
        max_tokens_cap=workload.max_tokens_cap,
        max_tokens_default=workload.max_tokens_default,
        queue_timeout_s=workload.queue_timeout_s,
        served_models=callable_models(workload=workload, slices=reservations),
        slices=slices, pool=slices[0] if slices else None,
        allowed_models=allowed, allow_overflow=workload.allow_overflow,
    )
