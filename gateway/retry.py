"""The worker's retry policy (BACKGROUND.md, "Retries"): a per-call attempt
cap, full jitter over the whole backoff window, upstream Retry-After as a
floor, a per-session retry budget and a pool-wide retry ratio cap. Retries
happen here only: the SDK's own retries are off, and clients get a
Retry-After instead of a silent re-send."""

from __future__ import annotations

import importlib.resources
import os
import random
from dataclasses import dataclass

from budgets import keys as budget_keys
from budgets.redis_client import get_redis, lua_script

_SRC = importlib.resources.files("budgets").joinpath("retry_budget.lua").read_text()


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = int(os.environ.get("SLUICE_RETRY_MAX_ATTEMPTS", 2))
    base_ms: float = float(os.environ.get("SLUICE_RETRY_BASE_MS", 250))
    cap_ms: float = float(os.environ.get("SLUICE_RETRY_CAP_MS", 8000))
    # Retries stay under this share of first attempts, pool-wide.
    pool_ratio: float = float(os.environ.get("SLUICE_RETRY_POOL_RATIO", 0.1))
    pool_burst: float = float(os.environ.get("SLUICE_RETRY_POOL_BURST", 10))
    session_budget: int = int(os.environ.get("SLUICE_RETRY_SESSION_BUDGET", 3))
    session_ttl_ms: int = int(os.environ.get("SLUICE_RETRY_SESSION_TTL_MS", 600_000))

    def backoff_window_ms(self, attempt: int) -> float:
        """The window after failed attempt ``attempt`` (1-based): exponential, capped."""
        return min(self.cap_ms, self.base_ms * (2 ** (attempt - 1)))

    def delay_ms(self, attempt: int, *, upstream_retry_after_ms: int | None, rng: random.Random) -> float:
        # Full jitter: uniform over the whole window, so calls that failed
        # together do not come back together. Upstream Retry-After is a floor
        # the window starts from: capping at the floor instead would send
        # every waiting retry at the same instant the pool reopens.
        return float(upstream_retry_after_ms or 0) + rng.uniform(0, self.backoff_window_ms(attempt))


RETRYABLE_STATUSES = {429, 500, 502, 503, 504}


def _session_key(pool_id: int, workload_id: int, session_id: str | None) -> str:
    if not session_id:
        return ""
    return f"{budget_keys.pool_retry(pool_id)}:session:{workload_id}:{session_id[:128]}"


def retry_budget_earn(*, pool_id: int, policy: RetryPolicy) -> None:
    lua_script(get_redis(), _SRC)(keys=[budget_keys.pool_retry(pool_id), ""],
                                  args=["earn", policy.pool_ratio, policy.pool_burst, 0, 0])


def retry_budget_spend(*, pool_id: int, workload_id: int, session_id: str | None, policy: RetryPolicy) -> str:
    """'ok' when a retry may go; otherwise which budget refused it."""
    return lua_script(get_redis(), _SRC)(
        keys=[budget_keys.pool_retry(pool_id), _session_key(pool_id, workload_id, session_id)],
        args=["spend", policy.pool_ratio, policy.pool_burst, policy.session_budget, policy.session_ttl_ms],
    )
