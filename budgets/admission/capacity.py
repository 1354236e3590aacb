"""The pool's adaptive admission rate (docs/architecture.md, "Capacity that moves, and retries"):
multiplicative decrease on upstream 429s and sustained latency growth,
additive recovery while calls succeed, upstream Retry-After kept as a floor.
State lives in Redis (``capacity.lua``) so every worker and web process acts
on the same number."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.admission import keys
from budgets.redis.clients import get_redis
from budgets.redis.scripts import LuaScript, ScriptCall

CAPACITY = LuaScript(__package__, "capacity.lua")


@dataclass(frozen=True)
class CapacityState:
    factor: float
    blocked_until_ms: float
    throttles: int
    shed: dict[int, float]
    # What the provider's x-ratelimit-* headers last said (provider_limits.lua);
    # None where it never said.
    provider_factor: float | None = None
    provider_until_ms: float = 0.0
    provider_limit_tokens: float | None = None
    provider_limit_requests: float | None = None
    provider_remaining_tokens: float | None = None
    provider_remaining_requests: float | None = None
    last_decrease_ms: float = 0.0

    def effective_factor(self, *, now_ms: float) -> float:
        """What admission runs the pool's buckets at (admit.lua): the
        provider's stated limit over the configured one while it states one,
        else the factor inferred from 429s and latency."""
        if self.provider_factor is not None and now_ms < self.provider_until_ms:
            return self.provider_factor
        return self.factor

    def reason(self, *, now_ms: float) -> str:
        """Why the factor is what it is, in a sentence for the pool page."""
        if self.provider_factor is not None and now_ms < self.provider_until_ms:
            limit = f"{self.provider_limit_tokens:,.0f} tokens" if self.provider_limit_tokens is not None else \
                f"{self.provider_limit_requests:,.0f} requests"
            return (f"the provider states a limit of {limit} per minute in its x-ratelimit headers: "
                    f"{self.provider_factor:.0%} of the configured limits")
        if self.factor >= 1.0:
            return "the configured limits: no upstream 429 or latency growth to act on"
        if now_ms < self.blocked_until_ms:
            return (f"lowered after upstream 429s ({self.throttles} so far); the pool's Retry-After holds "
                    "sheddable work back until it passes")
        return (f"lowered after upstream 429s or latency growth ({self.throttles} 429s so far); "
                "recovering while calls succeed")


def capacity_signal(*, pool_id: int, event: str, latency_per_token_ms: float = 0.0, retry_after_ms: int = 0) -> float:
    """Report what the pool did; returns the pool's effective factor after it."""
    return capacity_signal_call(pool_id=pool_id, event=event, latency_per_token_ms=latency_per_token_ms,
                                retry_after_ms=retry_after_ms).run()


def capacity_signal_call(*, pool_id: int, event: str, latency_per_token_ms: float = 0.0,
                         retry_after_ms: int = 0) -> ScriptCall[float]:
    # Halve on a throttle (TCP-style), recover a share of the configured rate
    # per second; 429s inside the cooldown are one signal (all were sent
    # before the first decrease could take effect). llm_platform/settings.py
    # explains each knob.
    return ScriptCall(
        script=CAPACITY,
        keys=[keys.pool_config(pool_id), keys.pool_workloads(pool_id), keys.pool_capacity(pool_id),
              keys.pool_protected_sum(pool_id), keys.pool_protected_fill(pool_id)],
        args=[event, latency_per_token_ms, retry_after_ms, settings.SLUICE_CAPACITY_DECREASE,
              settings.SLUICE_CAPACITY_RECOVERY_PER_S, settings.SLUICE_CAPACITY_MIN_FACTOR,
              settings.SLUICE_CAPACITY_COOLDOWN_MS, settings.SLUICE_CAPACITY_LATENCY_RATIO,
              settings.SLUICE_CAPACITY_HINT_MEMORY_MS, settings.SLUICE_CAPACITY_LATENCY_FLOOR_MS],
        parse=lambda raw: float(raw[0]),
    )


def capacity_state(*, pool_id: int) -> CapacityState:
    raw = get_redis().hgetall(keys.pool_capacity(pool_id))
    shed = {int(k.split(".")[0]): float(v) for k, v in raw.items() if k.endswith(".shed")}
    def number(name: str) -> float | None:
        return float(raw[name]) if raw.get(name) not in (None, "") else None

    return CapacityState(
        factor=float(raw.get("factor", 1.0)),
        blocked_until_ms=float(raw.get("blocked_until_ms", 0)),
        throttles=int(raw.get("throttles", 0)),
        shed=shed,
        provider_factor=number("prov_factor"),
        provider_until_ms=number("prov_until_ms") or 0.0,
        provider_limit_tokens=number("prov_limit_tok"),
        provider_limit_requests=number("prov_limit_req"),
        provider_remaining_tokens=number("prov_rem_tok"),
        provider_remaining_requests=number("prov_rem_req"),
        last_decrease_ms=number("last_decrease_ms") or 0.0,
    )
