"""A request's admission on one pool, as the gateway asks for it: its
expected spend held against its tenant's month-to-date (across every pool of
the tenant), its lease on the pool's buckets, each config rebuilt once if
Redis lost it. Routing across a workload's pools
(gateway/core/request/routing.py) runs it on each pool of the route and
turns Redis being away into a clear 503.

Two atomic steps, because a tenant's spend and a pool's buckets carry
different Redis Cluster hash tags and no script may touch both
(budgets/admission/spend_holds.py): admit on the pool, then hold the spend,
and give the lease back when the spend refuses. Both go in one round trip
(``RoundTrip``: one script on a single Redis), the hold only if the pool
admitted. The flow is written once (``admission_plan``); the routing's sync
caller (jobs: the API and the pacer) and async one (the /v1 API) run it and
differ only in the await."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from django.conf import settings

from budgets.admission.buckets import Admission, NotConfigured, admit_call, lease_give_back_call
from budgets.admission.estimation import Estimate
from budgets.admission.pool_config import pool_config_push
from budgets.redis.clients import REDIS_UNAVAILABLE
from budgets.redis.composition import Plan, RoundTrip, Step, answered
from budgets.redis.scripts import ScriptCall, raw_reply
from budgets.admission.spend_holds import SpendHold, spend_hold_call
from budgets.errors import BudgetUnavailable, Rejected
from budgets.ledger.spend import spend_month, spend_tenant_restore
from budgets.models import InferencePool
from gateway.core.request.context import CallerContext
from gateway.core.errors import no_reservation

logger = logging.getLogger(__name__)


def lease_ttl_ms(*, queue_s: float) -> int:
    """Outlives any healthy request: queueing, the upstream call, its retries."""
    return int((queue_s + settings.SLUICE_UPSTREAM_TIMEOUT_S + 30) * 1000)


def spend_hold_for(ctx: CallerContext, *, model: str, estimate: Estimate) -> SpendHold | None:
    """The request's expected cost for the spend caps (None without a price)."""
    price = ctx.prices.get(model)
    if price is None:
        return None
    cost_micro = price.cost_micro(input_tokens=estimate.input_tokens, output_tokens=estimate.output_tokens)
    if cost_micro <= 0:
        return None
    month, month_end_ms = spend_month(at_ms=time.time() * 1000)
    return SpendHold(tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, cost_micro=cost_micro, month=month,
                     month_end_ms=month_end_ms, overflow=ctx.overflow)


def pool_config_rebuild(pool_id: int) -> None:
    """Redis lost the bucket config (restart, flush): rebuild it from the database."""
    try:
        pool_config_push(pool=InferencePool.objects.get(pk=pool_id))
    except REDIS_UNAVAILABLE as exc:
        raise BudgetUnavailable(str(exc)) from exc


def spend_rebuild(hold: SpendHold) -> None:
    """Redis lacks the tenant's caps or its month-to-date (a new month, a
    flush): rebuild both from the database and the requests in flight."""
    try:
        spend_tenant_restore(tenant_id=hold.tenant_id, month=hold.month)
    except REDIS_UNAVAILABLE as exc:
        raise BudgetUnavailable(str(exc)) from exc


def _configured(call: ScriptCall, rebuild) -> Plan:
    """Run ``call``; if Redis lacks what it needs, rebuild that once and run it again."""
    try:
        return (yield call)
    except NotConfigured:
        yield rebuild
    return (yield call)


def admission_call(ctx: CallerContext, *, request_id: str, estimate: Estimate, lease_ms: int,
                   body_digest: str = "") -> ScriptCall[Admission]:
    return admit_call(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id,
                      input_tokens=estimate.input_tokens, output_tokens=estimate.output_tokens, lease_ttl_ms=lease_ms,
                      body_digest=body_digest)


def _raw(call: ScriptCall) -> ScriptCall:
    return ScriptCall(script=call.script, keys=call.keys, args=call.args, parse=raw_reply)


def _spend_held(hold: SpendHold, call: ScriptCall[bool], given: object = None) -> Plan[bool]:
    """The spend hold, read from the answer it already gave (``given``)
    or asked for now; the tenant's spend rebuilt once if Redis lacks it."""
    try:
        if given is not None:
            try:
                return call.parse(given)
            except NotConfigured:
                yield partial(spend_rebuild, hold)
                return (yield call)
        return (yield from _configured(call, partial(spend_rebuild, hold)))
    except NotConfigured as exc:  # rebuilt, and gone again: Redis is not keeping what it is given
        raise BudgetUnavailable(f"spend of tenant {hold.tenant_id}: {exc}") from exc


# A workload a pool refused in the last second (in this process) is asked
# the old way on that pool, admission alone, the hold after it only if
# admitted: a storm of refusals pays one plain script each, not the composed
# pair. Per pool: a workload its primary refuses goes on to its overflow,
# which admits it, composed. Bounded by the number of slices.
REFUSED_RECENTLY_S = 1.0
_refused_at: dict[tuple[int, int | None], float] = {}


def refused_recently(workload_id: int, pool_id: int | None) -> bool:
    """Whether the pool refused this workload in this process within
    ``REFUSED_RECENTLY_S``: its next admission there goes alone."""
    return time.monotonic() - _refused_at.get((workload_id, pool_id), -REFUSED_RECENTLY_S) < REFUSED_RECENTLY_S


# budgets/admission/admit.lua's first answer when the request may go: admitted now (1), or admitted
# already (2: a replay of the same request id).
ADMITTED = (1, 2)


def admission_plan(ctx: CallerContext, *, request_id: str, model: str, estimate: Estimate,
                   lease_ms: int, body_digest: str = "") -> Plan[Admission]:
    """Admit on the pool, then hold the spend, and give the pool's lease back
    if the spend refuses. Raises Rejected (the pool's reasons, spend_budget,
    no_reservation) or BudgetUnavailable. The pool goes first because it is
    what refuses most (a workload over its rate): such a refusal costs one
    script, not a hold, the admission and the hold taken back. Both go in
    one round trip, the hold run only if the pool admitted (``ADMITTED``:
    budgets/admission/admit.lua's answers), unless the pool
    refused this workload within ``REFUSED_RECENTLY_S``; a config to rebuild
    takes them apart again. ``body_digest``: the request body's, which tells
    a client's retry of a held request (budgets/admission/admit.lua)."""
    admit = admission_call(ctx, request_id=request_id, estimate=estimate, lease_ms=lease_ms, body_digest=body_digest)
    together = not refused_recently(ctx.workload_id, ctx.pool_id)
    hold = spend_hold_for(ctx, model=model, estimate=estimate) if together else None
    hold_call = None if hold is None else spend_hold_call(hold, request_id=request_id, lease_ttl_ms=lease_ms,
                                                          estimated_tokens=estimate.total_tokens)
    held = None
    try:
        try:
            if hold_call is None:
                admission = yield from _configured(admit, partial(pool_config_rebuild, ctx.pool_id))
            else:
                answers = yield RoundTrip(
                    Step("admit", _raw(admit)),
                    Step("spend_hold", _raw(hold_call), only_if=answered("admit", *ADMITTED)))
                raw_admission, held = answers["admit"], answers["spend_hold"]
                try:
                    admission = admit.parse(raw_admission)  # a refusal raises here: the hold did not run
                except NotConfigured:
                    yield partial(pool_config_rebuild, ctx.pool_id)
                    admission = yield admit
                    held = None  # the hold did not run: it is asked below
        except Rejected:
            _refused_at[(ctx.workload_id, ctx.pool_id)] = time.monotonic()
            raise
    except NotConfigured as exc:
        raise no_reservation() from exc
    if not together:
        # Admitted alone: its spend is worked out and held now.
        hold = spend_hold_for(ctx, model=model, estimate=estimate)
        if hold is not None:
            hold_call = spend_hold_call(hold, request_id=request_id, lease_ttl_ms=lease_ms,
                                        estimated_tokens=estimate.total_tokens)
    if hold is None:
        return admission
    try:
        yield from _spend_held(hold, hold_call, held)
    except Exception:
        # The spend refused (or could not be asked): the request does not
        # exist, so neither does its lease. If Redis is away this fails too,
        # and the lease expires by itself.
        try:
            yield lease_give_back_call(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id)
        except Exception:  # noqa: BLE001 - the refusal is what the caller must hear
            logger.warning("could not give back the pool lease of %s", request_id, exc_info=True)
        raise
    return replace(admission, spend_month=hold.month)
