"""A request's admission, as the gateway asks for it: its expected spend, its
lease, one atomic Redis call (budgets.admission.buckets), the pool's config
rebuilt once if Redis lost it, and Redis being away turned into a clear 503.
The sync caller (jobs: the API and the pacer) and the async one (the chat
API) share the call and its translation; they differ only in the await."""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.conf import settings

from budgets.admission.buckets import NO_SPEND, Admission, NotConfigured, SpendCharge, admit_call
from budgets.admission.estimation import Estimate
from budgets.admission.pool_config import pool_config_push
from budgets.admission.redis_client import REDIS_UNAVAILABLE, ScriptCall
from budgets.errors import BudgetUnavailable
from budgets.ledger.spend import spend_month
from budgets.models import InferencePool
from gateway.core.context import CallerContext
from gateway.core.errors import budget_unavailable, no_reservation


def lease_ttl_ms(*, queue_s: float) -> int:
    """Outlives any healthy request: queueing, the upstream call, its retries."""
    return int((queue_s + settings.SLUICE_UPSTREAM_TIMEOUT_S + 30) * 1000)


def spend_charge(ctx: CallerContext, *, model: str, estimate: Estimate) -> SpendCharge:
    """The request's expected cost for the spend caps (none without a price)."""
    price = ctx.prices.get(model)
    if price is None:
        return NO_SPEND
    month_key, month_end_ms = spend_month(pool_id=ctx.pool_id, at_ms=time.time() * 1000)
    return SpendCharge(tenant_id=ctx.tenant_id, month_key=month_key, month_end_ms=month_end_ms,
                       cost_micro=price.cost_micro(input_tokens=estimate.input_tokens,
                                                   output_tokens=estimate.output_tokens))


def pool_config_rebuild(pool_id: int) -> None:
    """Redis lost the bucket config (restart, flush): rebuild it from the database."""
    try:
        pool_config_push(pool=InferencePool.objects.get(pk=pool_id))
    except REDIS_UNAVAILABLE as exc:
        raise BudgetUnavailable(str(exc)) from exc


def admission_call(ctx: CallerContext, *, request_id: str, model: str, estimate: Estimate,
                   lease_ms: int) -> ScriptCall[Admission]:
    return admit_call(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id,
                      input_tokens=estimate.input_tokens, output_tokens=estimate.output_tokens, lease_ttl_ms=lease_ms,
                      spend=spend_charge(ctx, model=model, estimate=estimate))


def request_admit(ctx: CallerContext, *, request_id: str, model: str, estimate: Estimate, lease_ms: int) -> Admission:
    """Admit or raise Rejected (budget refusals, no_reservation, budget_unavailable)."""
    call = admission_call(ctx, request_id=request_id, model=model, estimate=estimate, lease_ms=lease_ms)
    try:
        try:
            return call.run()
        except NotConfigured:
            pool_config_rebuild(ctx.pool_id)
        try:
            return call.run()
        except NotConfigured as exc:
            raise no_reservation() from exc
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc


async def request_admit_async(ctx: CallerContext, *, request_id: str, model: str, estimate: Estimate,
                              lease_ms: int) -> Admission:
    """``request_admit`` for the async API views."""
    call = admission_call(ctx, request_id=request_id, model=model, estimate=estimate, lease_ms=lease_ms)
    try:
        try:
            return await call.run_async()
        except NotConfigured:
            await sync_to_async(pool_config_rebuild, thread_sensitive=False)(ctx.pool_id)
        try:
            return await call.run_async()
        except NotConfigured as exc:
            raise no_reservation() from exc
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc
