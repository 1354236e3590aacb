"""The worker's retry policy (docs/architecture.md, "Capacity that moves,
and retries"): a per-call attempt cap, full jitter over the whole backoff
window, upstream Retry-After as a floor, a per-session retry budget and a pool-wide retry ratio cap.
Retries happen here only: the SDK's own retries are off, and clients get a
Retry-After instead of a silent re-send."""

from __future__ import annotations

import random
from dataclasses import dataclass

from django.conf import settings

from budgets.redis.scripts import LuaScript, ScriptCall, raw_reply
from gateway.core import keys

RETRY_BUDGET = LuaScript(__package__, "retry_budget.lua")

RETRYABLE_STATUSES = {429, 500, 502, 503, 504}


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    base_ms: float
    cap_ms: float
    pool_ratio: float  # retries stay under this share of first attempts, pool-wide
    pool_burst: float
    session_budget: int
    session_ttl_ms: int

    @classmethod
    def from_settings(cls) -> RetryPolicy:
        return cls(
            max_attempts=settings.SLUICE_RETRY_MAX_ATTEMPTS, base_ms=settings.SLUICE_RETRY_BASE_MS,
            cap_ms=settings.SLUICE_RETRY_CAP_MS, pool_ratio=settings.SLUICE_RETRY_POOL_RATIO,
            pool_burst=settings.SLUICE_RETRY_POOL_BURST, session_budget=settings.SLUICE_RETRY_SESSION_BUDGET,
            session_ttl_ms=settings.SLUICE_RETRY_SESSION_TTL_MS,
        )

    def backoff_window_ms(self, attempt: int) -> float:
        """The window after failed attempt ``attempt`` (1-based): exponential, capped."""
        return min(self.cap_ms, self.base_ms * (2 ** (attempt - 1)))

    def delay_ms(self, attempt: int, *, upstream_retry_after_ms: int | None, rng: random.Random) -> float:
        # Full jitter: uniform over the whole window, so calls that failed
        # together do not come back together. Upstream Retry-After is a floor
        # the window starts from: capping at the floor instead would send
        # every waiting retry at the same instant the pool reopens.
        return float(upstream_retry_after_ms or 0) + rng.uniform(0, self.backoff_window_ms(attempt))


def _budget_call(*, op: str, pool_id: int, session_key: str, policy: RetryPolicy) -> ScriptCall[str]:
    # Without a session the script gets the pool key twice and skips the
    # session budget (KEYS[2] == KEYS[1]): no empty key names, one hash slot.
    return ScriptCall(
        script=RETRY_BUDGET,
        keys=[keys.pool_retry(pool_id), session_key or keys.pool_retry(pool_id)],
        args=[op, policy.pool_ratio, policy.pool_burst, policy.session_budget, policy.session_ttl_ms],
        parse=raw_reply,
    )


def retry_budget_earn(*, pool_id: int, policy: RetryPolicy) -> None:
    """A first attempt earns the pool a fraction of a retry."""
    retry_budget_earn_call(pool_id=pool_id, policy=policy).run()


def retry_budget_earn_call(*, pool_id: int, policy: RetryPolicy) -> ScriptCall[str]:
    return _budget_call(op="earn", pool_id=pool_id, session_key="", policy=policy)


def retry_budget_spend(*, pool_id: int, workload_id: int, session_id: str | None, policy: RetryPolicy,
                       move: bool = False) -> str:
    """'ok' when a retry may go; otherwise which budget refused it.
    ``move``: the retry goes to another pool (a fail-over): only the
    session's budget can refuse it (retry_budget.lua)."""
    session_key = keys.retry_session(pool_id, workload_id, session_id) if session_id else ""
    return _budget_call(op="move" if move else "spend", pool_id=pool_id, session_key=session_key,
                        policy=policy).run()
