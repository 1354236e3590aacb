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
