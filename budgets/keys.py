"""The Redis key schema, in one place. Everything one admission or settlement
script touches carries the pool's hash tag ``{pool:<id>}`` so Redis Cluster
keeps it on one shard."""

from __future__ import annotations


def _tag(pool_id: int) -> str:
    return f"sluice:{{pool:{pool_id}}}"


def pool_config(pool_id: int) -> str:
    """Hash: bucket rates/capacities of the pool and of every workload on it."""
    return f"{_tag(pool_id)}:cfg"


def pool_workloads(pool_id: int) -> str:
    """Set: ids of the workloads with a reservation on the pool."""
    return f"{_tag(pool_id)}:wids"


def pool_buckets(pool_id: int) -> str:
    """Hash: level and last-refill time of every bucket of the pool."""
    return f"{_tag(pool_id)}:buckets"


def pool_leases(pool_id: int) -> str:
    """Sorted set: in-flight request ids scored by lease expiry (ms)."""
    return f"{_tag(pool_id)}:leases"


def workload_leases(pool_id: int, workload_id: int) -> str:
    return f"{_tag(pool_id)}:wl:{workload_id}:leases"


def lease(pool_id: int, request_id: str) -> str:
    """Hash: what admission debited for one request, so settlement can undo it."""
    return f"{_tag(pool_id)}:lease:{request_id}"


def pool_counters(pool_id: int) -> str:
    """Hash: monotonic counters (tokens debited net of settlement, per workload)."""
    return f"{_tag(pool_id)}:counters"


def pool_capacity(pool_id: int) -> str:
    """Hash: adaptive capacity factor of the pool (1.0 = configured limits)."""
    return f"{_tag(pool_id)}:capacity"


def pool_retry(pool_id: int) -> str:
    """Hash: the pool's retry token bucket and retry counters."""
    return f"{_tag(pool_id)}:retry"


def pool_metrics(pool_id: int, lane: str) -> str:
    """Hash: arrivals, departures and time in system per 10 s slot, per lane."""
    return f"{_tag(pool_id)}:metrics:{lane}"


def lane_in_flight(pool_id: int, lane: str) -> str:
    """Sorted set: admitted requests of a lane not yet finished, by expiry."""
    return f"{_tag(pool_id)}:lane:{lane}:inflight"


# --- rejection counters (budgets.rejections) -----------------------------------
# pool id 0 holds rejections of requests that never reached a pool.


def rejection_minute_counts(pool_id: int, minute_epoch: int) -> str:
    """Hash: rejections in one minute, fields "<wid>|<reason>" and "_n" (total)."""
    return f"{_tag(pool_id)}:rej:{minute_epoch}:n"


def rejection_minute_samples(pool_id: int, minute_epoch: int) -> str:
    """List: JSON samples of the minute's first rejections per workload and reason."""
    return f"{_tag(pool_id)}:rej:{minute_epoch}:samples"


def rejection_pending_minutes(pool_id: int) -> str:
    """Sorted set: minutes (epoch seconds) with counts not yet flushed to the database."""
    return f"{_tag(pool_id)}:rej:pending"


# --- spend (budgets.spend) --------------------------------------------------------


def spend_month(pool_id: int, year_month: str) -> str:
    """Hash: month-to-date spend in micro-units, fields "T<tenant id>" and "<workload id>"."""
    return f"{_tag(pool_id)}:spend:{year_month}"


def pool_pacer(pool_id: int) -> str:
    """Hash: per scheduled workload, when its leaky bucket next lets a job out."""
    return f"{_tag(pool_id)}:pace"
