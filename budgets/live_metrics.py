"""The pool overview's live numbers (effective capacity, L beside lambda*W,
queue depth per lane, upstream 429s) come from the gateway, which measures
them. budgets/ may not import gateway/ (DESIGN.md, Layout), so the function
is named in settings (SLUICE_POOL_LIVE_METRICS) and looked up here; when it
is missing or fails, the page shows zeros and says the numbers are
unavailable instead of failing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.utils.module_loading import import_string

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


def pool_live_metrics(*, pool_id: int) -> PoolLiveMetrics:
    try:
        provider = import_string(settings.SLUICE_POOL_LIVE_METRICS)
    except ImportError:
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
        )
    except Exception:  # noqa: BLE001 - a dashboard must not fail with the thing it watches
        logger.warning("live metrics of pool %s unavailable", pool_id, exc_info=True)
        return PoolLiveMetrics(available=False)
