"""The web process's half of a request: estimate, admit, enqueue on its lane,
wait for the outcome without holding a thread, and give up at the deadline
(atomically against the worker starting)."""

from __future__ import annotations

import logging
import uuid

import redis
from dataclasses import dataclass
from datetime import datetime, timezone

from asgiref.sync import sync_to_async
from django.conf import settings

from budgets.admission import Admission, NotConfigured, admit_async, settle_async
from budgets.errors import BudgetUnavailable, Rejected
from budgets.estimation import Estimate, request_estimate
from budgets.ledger import LedgerEntry, usage_record_write
from budgets.redis_client import get_async_redis, lua_script

from . import keys
from .auth import CallerContext
from .enqueue import (budget_unavailable, lease_ttl_ms, no_reservation, pool_config_rebuild, record_build, record_enqueue,
                      spend_charge)
from .metrics import departure_record
from .records import CLAIM_SRC, EXPIRED, GAVE_UP, Outcome, RequestRecord, claim_args
from .validation import ChatRequest

logger = logging.getLogger(__name__)

# Time a worker needs beyond the queue deadline to finish a started call.
FINISH_GRACE_S = 5.0


@dataclass(frozen=True)
class Dispatched:
    request_id: str
    estimate: Estimate
    admission: Admission
    lane: str
    outcome: Outcome


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


async def _admit(ctx: CallerContext, request_id: str, model: str, estimate: Estimate) -> Admission:
    kwargs = dict(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id,
                  input_tokens=estimate.input_tokens, output_tokens=estimate.output_tokens,
                  lease_ttl_ms=lease_ttl_ms(queue_s=ctx.queue_timeout_s),
                  spend=spend_charge(ctx, model=model, estimate=estimate))
    try:
        try:
            return await admit_async(**kwargs)
        except NotConfigured:
            await sync_to_async(pool_config_rebuild, thread_sensitive=False)(ctx.pool_id)
            try:
                return await admit_async(**kwargs)
            except NotConfigured as exc:
                raise no_reservation() from exc
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc


async def _refund_and_record_timeout(record: RequestRecord, queue_wait_ms: int) -> None:
    await settle_async(pool_id=record.pool_id, workload_id=record.workload_id, request_id=record.request_id,
                       actual_input_tokens=0, actual_output_tokens=0, pool_called=False,
                       spend_month_key=record.spend_month_key)
    entry = LedgerEntry(
        request_id=record.request_id,
        created_at=datetime.fromtimestamp(record.admitted_ms / 1000, tz=timezone.utc),
        tenant_id=record.tenant_id, workload_id=record.workload_id, pool_id=record.pool_id,
        model=record.model, lane=record.lane, status="queue_timeout", borrowed=record.borrowed,
        estimated_input_tokens=record.estimated_input_tokens, estimated_output_tokens=record.estimated_output_tokens,
        queue_wait_ms=queue_wait_ms, total_ms=queue_wait_ms, error="queue_timeout", price=record.ledger_price,
    )
    await sync_to_async(usage_record_write, thread_sensitive=False)(entry=entry)
    await sync_to_async(departure_record, thread_sensitive=False)(
        pool_id=record.pool_id, lane=record.lane, request_id=record.request_id, time_in_system_ms=queue_wait_ms)


def _queue_timeout(ctx: CallerContext) -> Rejected:
    return Rejected(
        reason="queue_timeout",
        message=f"The request waited in its lane longer than this workload's queue timeout ({ctx.queue_timeout_s:g}s).",
        status=503,
        retry_after_ms=max(1000, int(ctx.queue_timeout_s * 1000)),
        error_type="service_unavailable",
    )


async def _wait_outcome(result_key: str, timeout_s: float) -> Outcome | None:
    blocking = get_async_redis(blocking=True)
    try:
        popped = await blocking.blpop([result_key], timeout=max(0.01, timeout_s))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        # The request was admitted and queued; its worker settles it. The
        # caller learns only that we lost sight of it.
        raise Rejected(reason="result_unavailable", message="Sluice lost its connection to the result store; the request may still complete.",
                       status=503, retry_after_ms=1000, error_type="service_unavailable") from exc
    return Outcome.from_json(popped[1]) if popped else None


async def chat_completion(*, ctx: CallerContext, chat: ChatRequest, session_id: str = "") -> Dispatched:
    """Admit and run one chat completion; raises Rejected for every refusal."""
    estimate = request_estimate(
        messages=chat.messages, max_tokens=chat.max_tokens, prompt_tokens_cap=ctx.prompt_tokens_cap,
        max_tokens_cap=ctx.max_tokens_cap, max_tokens_default=ctx.max_tokens_default,
        encoding_name=ctx.tokenizer, safety_factor=ctx.safety_factor,
    )
    request_id = new_request_id()
    try:
        admission = await _admit(ctx, request_id, chat.model, estimate)
    except Rejected as rejected:
        rejected.estimated_tokens = estimate.total_tokens  # type: ignore[attr-defined]  (rejection stats)
        raise
    payload = {"model": chat.model, "messages": chat.messages, "max_tokens": estimate.output_tokens, **chat.passthrough}
    record = record_build(
        ctx, request_id=request_id, model=chat.model, payload=payload, estimate=estimate, admission=admission,
        deadline_ms=admission.admitted_ms + ctx.queue_timeout_s * 1000, session_id=session_id,
        # Retries must end while the caller still waits for them.
        retry_deadline_ms=admission.admitted_ms + (ctx.queue_timeout_s + settings.SLUICE_UPSTREAM_TIMEOUT_S / 2) * 1000,
    )
    lane = record.lane
    await sync_to_async(record_enqueue, thread_sensitive=False)(record, lease_ms=lease_ttl_ms(queue_s=ctx.queue_timeout_s))

    result_key = keys.request_result(request_id)
    outcome = await _wait_outcome(result_key, ctx.queue_timeout_s)
    if outcome is None:
        claim_keys, claim_argv = claim_args(GAVE_UP, record)
        owner = await lua_script(get_async_redis(), CLAIM_SRC)(keys=claim_keys, args=claim_argv)
        if owner == GAVE_UP:
            await _refund_and_record_timeout(record, int(ctx.queue_timeout_s * 1000))
            raise _queue_timeout(ctx)
        if owner == EXPIRED:
            # The worker found the deadline passed; it refunds and records.
            raise _queue_timeout(ctx)
        outcome = await _wait_outcome(result_key, settings.SLUICE_UPSTREAM_TIMEOUT_S + FINISH_GRACE_S)
        if outcome is None:
            raise Rejected(reason="upstream_timeout", message="The inference pool did not answer in time.",
                           status=504, retry_after_ms=None, error_type="upstream_error")
    if outcome.status == "queue_timeout":
        raise _queue_timeout(ctx)
    return Dispatched(request_id=request_id, estimate=estimate, admission=admission, lane=lane, outcome=outcome)
