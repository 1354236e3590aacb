"""The pool's adaptive admission rate (DESIGN.md, "Capacity that moves"):
multiplicative decrease on upstream 429s and sustained latency growth,
additive recovery while calls succeed, upstream Retry-After kept as a floor.
State lives in Redis (``capacity.lua``) so every worker and web process acts
on the same number."""

from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass

from . import keys
from .redis_client import get_redis, lua_script

_SRC = importlib.resources.files(__package__).joinpath("capacity.lua").read_text()

# Halve on a throttle (TCP-style), recover 2% of the configured rate per
# second: a halving is undone in ~25 s of clean calls.
DECREASE_FACTOR = float(os.environ.get("SLUICE_CAPACITY_DECREASE", 0.5))
RECOVERY_PER_S = float(os.environ.get("SLUICE_CAPACITY_RECOVERY_PER_S", 0.02))
MIN_FACTOR = float(os.environ.get("SLUICE_CAPACITY_MIN_FACTOR", 0.05))
# 429s arriving within this window are one signal (they were all sent before
# the first decrease could take effect).
COOLDOWN_MS = int(os.environ.get("SLUICE_CAPACITY_COOLDOWN_MS", 2000))
# Latency per token this many times its slow baseline counts as a throttle.
LATENCY_RATIO = float(os.environ.get("SLUICE_CAPACITY_LATENCY_RATIO", 3.0))
# Latency per token below this is never a throttle signal (ms).
LATENCY_FLOOR_MS = float(os.environ.get("SLUICE_CAPACITY_LATENCY_FLOOR_MS", 5.0))
# How long the factor at the last throttle caps fast recovery.
HINT_MEMORY_MS = int(os.environ.get("SLUICE_CAPACITY_HINT_MEMORY_MS", 60_000))


@dataclass(frozen=True)
class CapacityState:
    factor: float
    blocked_until_ms: float
    throttles: int
    shed: dict[int, float]


def capacity_signal(*, pool_id: int, event: str, latency_per_token_ms: float = 0.0, retry_after_ms: int = 0) -> float:
    """Report what the pool did; returns the pool's effective factor after it."""
    client = get_redis()
    factor, _ = lua_script(client, _SRC)(
        keys=[keys.pool_config(pool_id), keys.pool_workloads(pool_id), keys.pool_capacity(pool_id)],
        args=[event, latency_per_token_ms, retry_after_ms, DECREASE_FACTOR, RECOVERY_PER_S, MIN_FACTOR,
              COOLDOWN_MS, LATENCY_RATIO, HINT_MEMORY_MS, LATENCY_FLOOR_MS],
    )
    return float(factor)


def capacity_state(*, pool_id: int) -> CapacityState:
    raw = get_redis().hgetall(keys.pool_capacity(pool_id))
    shed = {int(k.split(".")[0]): float(v) for k, v in raw.items() if k.endswith(".shed")}
    return CapacityState(
        factor=float(raw.get("factor", 1.0)),
        blocked_until_ms=float(raw.get("blocked_until_ms", 0)),
        throttles=int(raw.get("throttles", 0)),
        shed=shed,
    )
