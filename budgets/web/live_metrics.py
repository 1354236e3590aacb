"""The pool overview's live numbers (effective capacity, L beside lambda*W,
queue depth per lane, upstream 429s) come from the gateway, which measures
them. Dependencies point gateway -> budgets, so budgets does not reach for
them: the gateway registers its provider here when it loads
(gateway/apps.py). With no provider, or one that fails, the page shows zeros
and says the numbers are unavailable instead of failing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from budgets.admission.pool_status import NOT_PROBED, PoolStatus
from budgets.redis.clients import unavailable_note

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLiveMetrics:
    available: bool
    effective_capacity_factor: float = 1.0
    in_flight: int = 0
    arrival_rate_per_s: float = 0.0
    mean_time_in_system_s: float = 0.0
    littles_l: float = 0.0
    queue_depth: dict[str, int] = field(default_factory=dict)
    upstream_429_per_min: float = 0.0
    window_s: int = 0
    lanes: dict[str, dict] = field(default_factory=dict)  # the same numbers per lane, where the gateway gives them
    pool_status: PoolStatus = NOT_PROBED  # whether the pool answers its probes
    capacity_reason: str = ""  # why the effective factor is what it is
    # What the provider's x-ratelimit-* headers last said (None: never said).
    provider_remaining_tokens: float | None = None
    provider_remaining_requests: float | None = None
    # The adaptive concurrency limit per limited lane: {lane: {"limit", "in_use"}}.
    lane_limits: dict[str, dict] = field(default_factory=dict)
    lane_limit_reason: str = ""  # the last decrease's reason
    circuit_state: str = "closed"
    circuit_why: str = ""
    held: int = 0  # requests admitted through an outage, not yet released to the pool


LiveMetricsProvider = Callable[..., dict]  # provider(pool_id=...) -> the gateway's numbers
_provider: LiveMetricsProvider | None = None


def live_metrics_provider_set(provider: LiveMetricsProvider | None) -> None:
    global _provider
    _provider = provider


def pool_live_metrics(*, pool_id: int) -> PoolLiveMetrics:
    provider = _provider
    if provider is None:
        return PoolLiveMetrics(available=False)
    try:
        raw = provider(pool_id=pool_id) or {}
        return PoolLiveMetrics(
            available=True,
            effective_capacity_factor=float(raw.get("effective_capacity_factor", 1.0)),
            in_flight=int(raw.get("in_flight", 0)),
            arrival_rate_per_s=float(raw.get("arrival_rate_per_s", 0.0)),
            mean_time_in_system_s=float(raw.get("mean_time_in_system_s", 0.0)),
            littles_l=float(raw.get("littles_l", 0.0)),
            queue_depth={str(k): int(v) for k, v in (raw.get("queue_depth") or {}).items()},
            upstream_429_per_min=float(raw.get("upstream_429_per_min", 0.0)),
            window_s=int(raw.get("window_s") or 0),
            lanes={str(k): dict(v) for k, v in (raw.get("lanes") or {}).items()},
            pool_status=PoolStatus(**raw["pool_status"]) if raw.get("pool_status") else NOT_PROBED,
            capacity_reason=str(raw.get("capacity_reason") or ""),
            provider_remaining_tokens=(raw.get("provider") or {}).get("remaining_tokens"),
            provider_remaining_requests=(raw.get("provider") or {}).get("remaining_requests"),
            lane_limits={str(k): dict(v) for k, v in (raw.get("lane_limits") or {}).items()},
            lane_limit_reason=str(raw.get("lane_limit_reason") or ""),
            circuit_state=str((raw.get("circuit") or {}).get("state") or "closed"),
            circuit_why=str((raw.get("circuit") or {}).get("why") or ""),
            held=int((raw.get("circuit") or {}).get("held") or 0),
        )
    except Exception:  # noqa: BLE001 - a dashboard must not fail with the thing it watches
        unavailable_note(f"live metrics of pool {pool_id}")
        return PoolLiveMetrics(available=False)
