"""The pool's adaptive admission rate (docs/architecture.md, "Capacity that moves, and retries"):
multiplicative decrease on upstream 429s and sustained latency growth,
additive recovery while calls succeed, upstream Retry-After kept as a floor.
State lives in Redis (``capacity.lua``) so every worker and web process acts
on the same number."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.admission import keys
from budgets.admission.redis_client import LuaScript, ScriptCall, get_redis

CAPACITY = LuaScript(__package__, "capacity.lua")


@dataclass(frozen=True)
class CapacityState:
    factor: float
    blocked_until_ms: float
    throttles: int
    shed: dict[int, float]


def capacity_signal(*, pool_id: int, event: str, latency_per_token_ms: float = 0.0, retry_after_ms: int = 0) -> float:
    """Report what the pool did; returns the pool's effective factor after it."""
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
    ).run()


def capacity_state(*, pool_id: int) -> CapacityState:
    raw = get_redis().hgetall(keys.pool_capacity(pool_id))
    shed = {int(k.split(".")[0]): float(v) for k, v in raw.items() if k.endswith(".shed")}
    return CapacityState(
        factor=float(raw.get("factor", 1.0)),
        blocked_until_ms=float(raw.get("blocked_until_ms", 0)),
        throttles=int(raw.get("throttles", 0)),
        shed=shed,
    )
