"""Fail-over: a call that failed before its first output token (the pool
refused the connection, answered 5xx or its provider's 429), or that finds
its pool's circuit opened since its admission, moves once to the next pool
of its route that admits it (docs/architecture.md, "Routing across pools").

Moving is an admission on the next pool (budgets/admission/admit.lua, its
own atomic step under that pool's hash tag, with the request's id), then the
first pool's lease given back with no tokens (its call produced none: I5),
then the record rewritten to name the new pool, its price and its slice, so
the settlement, the ledger row and the caller's ``x-sluice-pool`` all name
the pool that served. The tenant's spend hold is the request's, whichever
pool serves it: its settlement corrects it to the new pool's price; moved
onto an overflow slice, it also counts against the workload's overflow cap
(budgets/admission/spend_hold.lua), which may refuse the move. The route is read as it
stands now (``CallerContext.route``): a workload that no longer allows
overflow is not moved onto it. A
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

from budgets.admission.buckets import NotConfigured, admit_call, lease_give_back_call, settle_call
from budgets.admission.estimation import Estimate
from budgets.admission.spend_holds import spend_hold_call
from budgets.errors import Rejected
from budgets.models import InferencePool
from budgets.redis.clients import get_redis, redis_now_ms
from gateway.core import keys
from gateway.core.metrics import arrival_commands
from gateway.core.request.admission import lease_ttl_ms, pool_config_rebuild, spend_hold_for
from gateway.core.request.context import CallerContext, context_for_workload
from gateway.core.request.records import RequestRecord
from tenants.models import Workload

logger = logging.getLogger(__name__)


def _route_of(record: RequestRecord) -> dict[int, CallerContext]:
    """The request's route as it stands now (CallerContext.route: its
    workload's slices on active pools serving its model, overflow ones only
    where it may overflow), by pool id."""
    workload = Workload.objects.select_related("tenant").filter(pk=record.workload_id).first()
    if workload is None:
        return {}
    return {ctx.pool_id: ctx for ctx in context_for_workload(workload).route(record.model)}


def _give_back(record: RequestRecord, pool_id: int) -> None:
    lease_give_back_call(pool_id=pool_id, workload_id=record.workload_id, request_id=record.request_id).run()


def _admitted_on(record: RequestRecord, target: CallerContext) -> bool | None:
    """Admit the request on ``target``'s pool: its borrowed flag, or None if
    refused (or held there: that pool is failing too). On an overflow slice
    its spend hold also counts against the overflow cap (budgets/admission/spend_hold.lua),
    or the move is refused."""
    lease_ms = lease_ttl_ms(queue_s=max(0.0, (record.deadline_ms - redis_now_ms()) / 1000))
    call = admit_call(pool_id=target.pool_id, workload_id=record.workload_id, request_id=record.request_id,
                      input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
                      lease_ttl_ms=lease_ms)
    try:
        try:
            admission = call.run()
        except NotConfigured:
            pool_config_rebuild(target.pool_id)  # Redis lost the pool's config: rebuilt once
            admission = call.run()
    except (Rejected, NotConfigured, InferencePool.DoesNotExist) as refused:
        logger.info("request %s: %s did not admit its fail-over (%s)", record.request_id, target.pool_slug,
                    getattr(refused, "reason", refused))
        return None
    if admission.held:
        _give_back(record, target.pool_id)
        return None
    if target.overflow and record.spend_month:
        hold = spend_hold_for(target, model=record.model, estimate=Estimate(
            input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
            max_tokens_requested=record.estimated_output_tokens, clamped=False))
        if hold is not None:
            try:
                spend_hold_call(replace(hold, month=record.spend_month), request_id=record.request_id,
                                lease_ttl_ms=lease_ms).run()
            except (Rejected, NotConfigured) as refused:
                logger.info("request %s: no fail-over to %s (%s)", record.request_id, target.pool_slug,
                            getattr(refused, "reason", refused))
                _give_back(record, target.pool_id)
                return None
    return admission.borrowed


def request_fail_over(record: RequestRecord) -> RequestRecord | None:
    """Move ``record`` to the next pool of its route that admits it (the
    module's docstring). Returns the moved record, stored in Redis, or None
    when it cannot move (moved once already, no pool left, none admits)."""
    if record.failed_over or not record.fallback_pools:
        return None
    remaining = [int(pool_id) for pool_id in record.fallback_pools.split(",") if pool_id]
    try:
        route = _route_of(record)
    except DatabaseError:
        logger.warning("request %s: no fail-over (database away)", record.request_id, exc_info=True)
        return None
    for position, pool_id in enumerate(remaining):
        target = route.get(pool_id)
        if target is None:
            continue  # gone, inactive, no slice of it left, or overflow no longer allowed
        borrowed = _admitted_on(record, target)
        if borrowed is None:
            continue
        price = target.prices.get(record.model)
        moved = replace(
            record, pool_id=target.pool_id, pool_base_url=target.pool_base_url,
            pool_api_key_env=target.pool_api_key_env, pool_slug=target.pool_slug, tokenizer=target.tokenizer,
            borrowed=borrowed, held=False, overflow=target.overflow, failed_over=True,
            fallback_pools=",".join(str(p) for p in remaining[position + 1:]),
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
        arrival_commands(pipe, pool_id=target.pool_id, lane=record.lane, request_id=record.request_id,
                         expires_ms=record.deadline_ms + lease_ttl_ms(queue_s=0))
        pipe.execute()
        logger.info("request %s failed over from pool %s to %s", record.request_id, record.pool_id, target.pool_slug)
        return moved
    return None
