"""Who a request runs for: the workload behind it, with its caps, its pool and
the prices in force. Built from the database by the web side (for an API
key, cached a few seconds) and by the worker side (for a job the pacer
releases, a cron firing)."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings
from django.utils import timezone

from budgets.ledger.pricing import TokenPrice, prices_in_force
from budgets.selectors.reservations import reservation_of_workload
from tenants.models import Workload


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
    pool_id: int | None
    pool_base_url: str
    pool_api_key_env: str
    served_models: tuple[str, ...]
    tokenizer: str
    safety_factor: float
    ceiling_tpm: int
    rpm: int
    reserved_tpm: int = 0
    prices: dict[str, TokenPrice] = field(default_factory=dict)  # model -> price in force
    # May the body carry the pool's test switches ("sim")? Only for a pool
    # marked is_simulator, and only where SLUICE_SIM_CONTROLS is on.
    sim_controls: bool = False
    # The API key the request came with (None: a cron firing, a paced job's
    # release); the ledger row records it for the request log and key usage.
    api_key_id: int | None = None

    @property
    def limits(self) -> dict[str, int]:
        """The x-ratelimit-limit-* numbers."""
        return {"tokens": self.ceiling_tpm, "requests": self.rpm}


def context_for_workload(workload: Workload) -> CallerContext:
    """The caller context of a workload (API keys, jobs, cron schedules)."""
    reservation = reservation_of_workload(workload=workload)
    pool = reservation.pool if reservation is not None and reservation.pool.is_active else None
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
        pool_id=pool.id if pool else None,
        pool_base_url=pool.base_url if pool else "",
        pool_api_key_env=pool.api_key_env if pool else "",
        served_models=tuple(pool.served_models or ()) if pool else (),
        tokenizer=pool.tokenizer if pool else "cl100k_base",
        safety_factor=pool.estimate_safety_factor if pool else 1.0,
        ceiling_tpm=reservation.ceiling_tpm if reservation else 0,
        rpm=reservation.rpm if reservation else 0,
        reserved_tpm=reservation.reserved_tpm if reservation else 0,
        prices=prices_in_force(models=pool.served_models or (), at=timezone.now()) if pool else {},
        sim_controls=bool(pool and pool.is_simulator and settings.SLUICE_SIM_CONTROLS),
    )
