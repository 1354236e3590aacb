"""Services that write: bucket config to Redis, settlement, the ledger."""

from __future__ import annotations

import logging

from django.db import transaction

from budgets.admission import keys
from budgets.admission.bucket_config import pool_bucket_fields
from budgets.admission.capacity import capacity_signal
from budgets.models import InferencePool, Reservation
from budgets.redis.clients import get_redis

logger = logging.getLogger(__name__)


def pool_config_push(*, pool: InferencePool) -> None:
    """Write the pool's bucket rates and capacities to Redis in one MULTI, so
    an admission script sees either the old config or the new one, never half.
    Bucket levels are kept: a rate change applies from now on."""
    reservations = list(Reservation.objects.filter(pool=pool).select_related("workload")) if pool.is_active else []
    fields = pool_bucket_fields(pool, reservations) if pool.is_active else {}
    pipe = get_redis().pipeline(transaction=True)
    # The protected sum goes with the config it was built on: the next
    # admission rebuilds it (protected_sum.lua).
    pipe.delete(keys.pool_config(pool.id), keys.pool_workloads(pool.id),
                keys.pool_protected_sum(pool.id), keys.pool_protected_fill(pool.id))
    if fields:
        pipe.hset(keys.pool_config(pool.id), mapping=fields)
    if reservations:
        pipe.sadd(keys.pool_workloads(pool.id), *[r.workload_id for r in reservations])
    pipe.execute()
    # Not in the MULTI: the key is the platform's, not the pool's (another
    # hash slot on a cluster). The lanes size by it (gateway/worker/lane_pool.py).
    if pool.is_active:
        get_redis().hset(keys.POOL_IN_FLIGHT_LIMITS, str(pool.id), pool.max_concurrency)
    else:
        get_redis().hdel(keys.POOL_IN_FLIGHT_LIMITS, str(pool.id))
    # Shed scales depend on the reservations: recompute them at the current factor.
    capacity_signal(pool_id=pool.id, event="recompute")


def pool_config_push_all() -> int:
    pools = list(InferencePool.objects.all())
    for pool in pools:
        pool_config_push(pool=pool)
    # A deleted pool's in-flight limit no longer sizes the lanes.
    client = get_redis()
    gone = set(client.hkeys(keys.POOL_IN_FLIGHT_LIMITS)) - {str(pool.id) for pool in pools}
    if gone:
        client.hdel(keys.POOL_IN_FLIGHT_LIMITS, *gone)
    return len(pools)


def pool_config_push_on_commit(*, pool_id: int) -> None:
    def push() -> None:
        pool = InferencePool.objects.filter(pk=pool_id).first()
        if pool is None:
            return
        try:
            pool_config_push(pool=pool)
        except Exception:  # Redis down: the periodic push catches up
            logger.warning("could not push bucket config of pool %s to Redis", pool_id, exc_info=True)

    transaction.on_commit(push)
