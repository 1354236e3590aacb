"""Fail-over: a call that failed before its first output token (the pool
refused the connection, answered 5xx or its provider's 429) moves once to
the next pool of its route that admits it (docs/architecture.md, "Routing
across pools").

Moving is an admission on the next pool (budgets/admission/admit.lua, its
own atomic step under that pool's hash tag, with the request's id), then the
first pool's lease given back with no tokens (its call produced none: I5),
then the record rewritten to name the new pool, its price and its slice, so
the settlement, the ledger row and the caller's ``x-sluice-pool`` all name
the pool that served. The tenant's spend hold is the request's, whichever
pool serves it: its settlement corrects it to the new pool's price. A
stream that has sent tokens is never moved (its attempt is not retryable),
and a request moves at most once (``failed_over``): with the retry
policy's own cap, one operation makes at most two pool calls per pool
failure, never a storm across pools.

A pool of the route that is gone, inactive, no longer holds the workload's
slice, refuses the admission or is failing itself (its circuit holds work)
is skipped; when none admits, the first pool's outcome stands."""

from __future__ import annotations

import logging
from dataclasses import replace

from django.db import DatabaseError
from django.utils import timezone

from budgets.admission.buckets import NotConfigured, admit_call, settle_call
from budgets.admission.pool_config import pool_config_push
from budgets.errors import Rejected
from budgets.ledger.pricing import prices_in_force
from budgets.models import InferencePool, Reservation
from budgets.redis.clients import get_redis, redis_now_ms
from gateway.core import keys
from gateway.core.metrics import arrival_commands
from gateway.core.request.admission import lease_ttl_ms
from gateway.core.request.records import RequestRecord

logger = logging.getLogger(__name__)


def _slice_on(record: RequestRecord, pool_id: int) -> tuple[InferencePool, Reservation, bool] | None:
    """The pool, the workload's slice of it and whether that slice is
    overflow (a rank above the route's primary); None where it cannot serve."""
    pool = InferencePool.objects.filter(pk=pool_id, is_active=True).first()
    if pool is None or record.model not in (pool.served_models or ()):
        return None
    slices = list(Reservation.objects.filter(workload_id=record.workload_id).order_by("rank", "id"))
    found = next((s for s in slices if s.pool_id == pool_id), None)
    if found is None:
        return None
    return pool, found, found.rank > slices[0].rank


def _admitted_on(record: RequestRecord, pool: InferencePool) -> bool | None:
    """Admit the request on ``pool``: its borrowed flag, or None if refused
    (or held there: that pool is failing too)."""
    lease_ms = lease_ttl_ms(queue_s=max(0.0, (record.deadline_ms - redis_now_ms()) / 1000))
    call = admit_call(pool_id=pool.id, workload_id=record.workload_id, request_id=record.request_id,
                      input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
                      lease_ttl_ms=lease_ms)
    try:
        try:
            admission = call.run()
        except NotConfigured:
            pool_config_push(pool=pool)  # Redis lost the pool's config: rebuilt once
            admission = call.run()
    except (Rejected, NotConfigured) as refused:
        logger.info("request %s: %s did not admit its fail-over (%s)", record.request_id, pool.slug,
                    getattr(refused, "reason", refused))
        return None
    if admission.held:
        settle_call(pool_id=pool.id, workload_id=record.workload_id, request_id=record.request_id,
                    actual_input_tokens=0, actual_output_tokens=0, pool_called=False).run()
        return None
    return admission.borrowed


def request_fail_over(record: RequestRecord) -> RequestRecord | None:
    """Move ``record`` to the next pool of its route that admits it (the
    module's docstring). Returns the moved record, stored in Redis, or None
    when it cannot move (moved once already, no pool left, none admits)."""
    if record.failed_over or not record.fallback_pools:
        return None
    remaining = [int(pool_id) for pool_id in record.fallback_pools.split(",") if pool_id]
    for position, pool_id in enumerate(remaining):
        try:
            found = _slice_on(record, pool_id)
        except DatabaseError:
            logger.warning("request %s: no fail-over (database away)", record.request_id, exc_info=True)
            return None
        if found is None:
            continue
        pool, _slice, overflow = found
        borrowed = _admitted_on(record, pool)
        if borrowed is None:
            continue
        price = prices_in_force(models=[record.model], at=timezone.now(), pool_id=pool.id).get(record.model)
        moved = replace(
            record, pool_id=pool.id, pool_base_url=pool.base_url, pool_api_key_env=pool.api_key_env,
            pool_slug=pool.slug, tokenizer=pool.tokenizer, borrowed=borrowed, held=False, overflow=overflow,
            failed_over=True, fallback_pools=",".join(str(p) for p in remaining[position + 1:]),
            price_input_per_million=str(price.input_per_million) if price else "",
            price_output_per_million=str(price.output_per_million) if price else "",
            price_id=(price.price_id or 0) if price else 0,
        )
        # The first pool's call produced nothing: its lease goes back whole.
        settle_call(pool_id=record.pool_id, workload_id=record.workload_id, request_id=record.request_id,
                    actual_input_tokens=0, actual_output_tokens=0, pool_called=True).run()
        client = get_redis()
        pipe = client.pipeline(transaction=False)
        pipe.hset(keys.request_record(record.request_id), mapping=moved.to_redis())
        pipe.zrem(keys.lane_in_flight(record.pool_id, record.lane), record.request_id)
        arrival_commands(pipe, pool_id=pool.id, lane=record.lane, request_id=record.request_id,
                         expires_ms=record.deadline_ms + lease_ttl_ms(queue_s=0))
        pipe.execute()
        logger.info("request %s failed over from pool %s to %s", record.request_id, record.pool_id, pool.slug)
        return moved
    return None
