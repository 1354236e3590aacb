"""Admission and enqueueing shared by the synchronous API (gateway.dispatch,
async) and asynchronous jobs (gateway.jobs, sync: the API view and the
pacer): build a request's record, put it in Redis, enqueue its id on the
lane, and refund if that fails."""

from __future__ import annotations

import logging

from django.conf import settings

import time

from budgets.admission import NO_SPEND, Admission, NotConfigured, SpendCharge, admit, settle
from budgets.errors import BudgetUnavailable, Rejected
from budgets.estimation import Estimate
from budgets.models import InferencePool
from budgets.pricing import spend_month
from budgets.redis_client import get_redis
from budgets.services import pool_config_push
from llm_platform.celery import queue_for_lane

from . import keys
from .auth import CallerContext
from .lanes import lane_for
from .metrics import arrival_commands
from .records import RequestRecord, ttl_ms
from .tasks import execute_request

logger = logging.getLogger(__name__)


def budget_unavailable() -> Rejected:
    return Rejected(reason="budget_unavailable", message="Sluice cannot reach its budget store right now; retry shortly.",
                    status=503, retry_after_ms=1000, error_type="service_unavailable")


def no_reservation() -> Rejected:
    return Rejected(reason="no_reservation", message="This workload has no budget on its pool.", status=403,
                    error_type="permission_error")


def lease_ttl_ms(*, queue_s: float) -> int:
    """Outlives any healthy request: queueing, the upstream call, its retries."""
    return int((queue_s + settings.SLUICE_UPSTREAM_TIMEOUT_S + 30) * 1000)


def pool_config_rebuild(pool_id: int) -> None:
    """Redis lost the bucket config (restart, flush): rebuild it from the database."""
    pool_config_push(pool=InferencePool.objects.get(pk=pool_id))


def spend_charge(ctx: CallerContext, *, model: str, estimate: Estimate) -> SpendCharge:
    """The request's expected cost for the spend caps (none without a price)."""
    price = ctx.prices.get(model)
    if price is None:
        return NO_SPEND
    month_key, month_end_ms = spend_month(pool_id=ctx.pool_id, at_ms=time.time() * 1000)
    return SpendCharge(tenant_id=ctx.tenant_id, month_key=month_key, month_end_ms=month_end_ms,
                       cost_micro=price.cost_micro(input_tokens=estimate.input_tokens,
                                                   output_tokens=estimate.output_tokens))


def admit_sync(ctx: CallerContext, *, request_id: str, model: str, estimate: Estimate, lease_ms: int) -> Admission:
    kwargs = dict(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id,
                  input_tokens=estimate.input_tokens, output_tokens=estimate.output_tokens, lease_ttl_ms=lease_ms,
                  spend=spend_charge(ctx, model=model, estimate=estimate))
    try:
        try:
            return admit(**kwargs)
        except NotConfigured:
            pool_config_rebuild(ctx.pool_id)
            try:
                return admit(**kwargs)
            except NotConfigured as exc:
                raise no_reservation() from exc
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc


def record_build(ctx: CallerContext, *, request_id: str, model: str, payload: dict, estimate: Estimate,
                 admission: Admission, deadline_ms: float, retry_deadline_ms: float, session_id: str = "",
                 job_id: str = "") -> RequestRecord:
    lane = lane_for(workload_class=ctx.workload_class, estimated_tokens=estimate.total_tokens, borrowed=admission.borrowed)
    price = ctx.prices.get(model)
    return RequestRecord(
        request_id=request_id, tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, pool_id=ctx.pool_id,
        pool_base_url=ctx.pool_base_url, pool_api_key_env=ctx.pool_api_key_env, model=model, lane=lane,
        borrowed=admission.borrowed, estimated_input_tokens=estimate.input_tokens,
        estimated_output_tokens=estimate.output_tokens, admitted_ms=admission.admitted_ms,
        deadline_ms=deadline_ms, payload=payload, session_id=session_id, job_id=job_id,
        retry_deadline_ms=retry_deadline_ms,
        price_input_per_million=str(price.input_per_million) if price else "",
        price_output_per_million=str(price.output_per_million) if price else "",
        price_id=(price.price_id or 0) if price else 0,
        spend_month_key=spend_month(pool_id=ctx.pool_id, at_ms=admission.admitted_ms)[0] if price else "",
    )


def record_enqueue(record: RequestRecord, *, lease_ms: int) -> None:
    """Store the record and enqueue its id on its lane, or refund and raise a
    503: nothing may run without its record, nothing admitted may leak."""
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.hset(keys.request_record(record.request_id), mapping=record.to_redis())
        pipe.pexpire(keys.request_record(record.request_id), max(ttl_ms(), lease_ms))
        arrival_commands(pipe, pool_id=record.pool_id, lane=record.lane, request_id=record.request_id,
                         expires_ms=record.admitted_ms + lease_ms)
        pipe.execute()
        execute_request.apply_async(args=[record.request_id], queue=queue_for_lane(record.lane),
                                    task_id=record.request_id)
    except Exception as exc:  # Redis or the broker
        logger.warning("could not enqueue %s: %s", record.request_id, exc)
        try:
            settle(pool_id=record.pool_id, workload_id=record.workload_id, request_id=record.request_id,
                   actual_input_tokens=0, actual_output_tokens=0, pool_called=False,
                   spend_month_key=record.spend_month_key)
        except Exception:  # the lease expires by itself
            logger.warning("could not refund %s", record.request_id, exc_info=True)
        raise budget_unavailable() from exc
