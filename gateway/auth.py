"""Who is calling: the workload behind a bearer key, with its caps and its
pool. Looked up in the database, then cached per process for a few seconds
(the admission path must not hit the database on every call). Revoking a key
or changing caps takes effect within SLUICE_AUTH_CACHE_S; budgets take effect
at once, since they live in Redis."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from budgets.pricing import prices_in_force
from budgets.selectors import reservation_of_workload
from tenants.selectors import api_key_lookup


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
    prices: dict = field(default_factory=dict)  # model -> budgets.pricing.TokenPrice

    @property
    def limits(self) -> dict[str, int]:
        return {"tokens": self.ceiling_tpm, "requests": self.rpm}


_cache: dict[str, tuple[float, CallerContext | None]] = {}
_cache_lock = threading.Lock()


def _load_context(raw_key: str) -> CallerContext | None:
    key = api_key_lookup(raw_key=raw_key)
    if key is None:
        return None
    return context_for_workload(key.workload)


def context_for_workload(workload) -> CallerContext:
    """The caller context of a workload (API keys, cron schedules)."""
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
    )


async def caller_context(raw_key: str) -> CallerContext | None:
    # Cache by digest so raw keys never sit in process memory longer than a request.
    digest = hashlib.sha256(raw_key.encode()).hexdigest()
    now = time.monotonic()
    cached = _cache.get(digest)
    if cached is not None and cached[0] > now:
        return cached[1]
    context = await sync_to_async(_load_context, thread_sensitive=False)(raw_key)
    with _cache_lock:
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[digest] = (now + settings.SLUICE_AUTH_CACHE_S, context)
    return context


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
