"""The web process's half of a request: estimate, admit, enqueue on its lane,
wait for the outcome without holding a thread, and give up at the deadline
(atomically against the worker starting: gateway/core/claim.lua)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings

from budgets.admission.buckets import Admission
from budgets.admission.estimation import Estimate
from budgets.admission.redis_client import REDIS_UNAVAILABLE, get_async_redis
from budgets.errors import Rejected
from budgets.ledger.writer import usage_record_write
from gateway.core import keys
from gateway.core.admission import lease_ttl_ms, request_admit_async
from gateway.core.chat import ChatRequest, chat_estimate, pool_payload
from gateway.core.context import CallerContext
from gateway.core.enqueue import new_request_id, record_build, record_enqueue
from gateway.core.errors import queue_timeout
from gateway.core.log_context import log_annotate
from gateway.core.metrics import departure_record
from gateway.core.observability import settlement_report
from gateway.core.records import EXPIRED, GAVE_UP, Outcome, RequestRecord, claim_call, ledger_entry
from gateway.core.settlement import request_refund_async

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


def _record_timeout(record: RequestRecord, queue_wait_ms: int) -> None:
    writing = time.monotonic()
    usage_record_write(entry=ledger_entry(record, status="queue_timeout", queue_wait_ms=queue_wait_ms,
                                          total_ms=queue_wait_ms, error="queue_timeout"))
    written_s = time.monotonic() - writing
    if departure_record(pool_id=record.pool_id, lane=record.lane, request_id=record.request_id,
                        time_in_system_ms=queue_wait_ms):
        outcome = Outcome(status="queue_timeout", http_status=503, queue_wait_ms=queue_wait_ms,
                          body={"error": {"code": "queue_timeout"}})
        settlement_report(record=record, outcome=outcome, pool_called=False, total_ms=queue_wait_ms,
                          ledger_lag_s=queue_wait_ms / 1000 + written_s)


async def _wait_outcome(result_key: str, timeout_s: float) -> Outcome | None:
    blocking = get_async_redis(blocking=True)
    try:
        popped = await blocking.blpop([result_key], timeout=max(0.01, timeout_s))
    except REDIS_UNAVAILABLE as exc:
        # The request was admitted and queued; its worker settles it. The
        # caller learns only that we lost sight of it.
        raise Rejected(reason="result_unavailable", message="Sluice lost its connection to the result store; the request may still complete.",
                       status=503, retry_after_ms=1000, error_type="service_unavailable") from exc
    return Outcome.from_json(popped[1]) if popped else None


async def chat_completion(*, ctx: CallerContext, chat: ChatRequest, session_id: str = "",
                          request_id: str | None = None) -> Dispatched:
    """Admit and run one chat completion; raises Rejected for every refusal.
    ``request_id``: the id the API gave the call (its logs, its ledger row)."""
    estimate = chat_estimate(ctx, chat)
    request_id = request_id or new_request_id()
    lease_ms = lease_ttl_ms(queue_s=ctx.queue_timeout_s)
    try:
        admission = await request_admit_async(ctx, request_id=request_id, model=chat.model, estimate=estimate,
                                              lease_ms=lease_ms)
    except Rejected as rejected:
        rejected.estimated_tokens = rejected.estimated_tokens or estimate.total_tokens  # for rejection stats
        raise
    record = record_build(
        ctx, request_id=request_id, model=chat.model, payload=pool_payload(chat, estimate), estimate=estimate,
        admission=admission, deadline_ms=admission.admitted_ms + ctx.queue_timeout_s * 1000, session_id=session_id,
        # Retries must end while the caller still waits for them.
        retry_deadline_ms=admission.admitted_ms + (ctx.queue_timeout_s + settings.SLUICE_UPSTREAM_TIMEOUT_S / 2) * 1000,
    )
    log_annotate(lane=record.lane)
    await sync_to_async(record_enqueue, thread_sensitive=False)(record, lease_ms=lease_ms)

    result_key = keys.request_result(request_id)
    outcome = await _wait_outcome(result_key, ctx.queue_timeout_s)
    if outcome is None:
        owner = await claim_call(GAVE_UP, record).run_async()
        if owner == GAVE_UP:
            # We own the refund: the worker will drop the task unrun.
            await request_refund_async(record)
            await sync_to_async(_record_timeout, thread_sensitive=False)(record, int(ctx.queue_timeout_s * 1000))
            raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
        if owner == EXPIRED:
            # The worker found the deadline passed; it refunds and records.
            raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
        outcome = await _wait_outcome(result_key, settings.SLUICE_UPSTREAM_TIMEOUT_S + FINISH_GRACE_S)
        if outcome is None:
            raise Rejected(reason="upstream_timeout", message="The inference pool did not answer in time.",
                           status=504, retry_after_ms=None, error_type="upstream_error")
    log_annotate(queue_ms=outcome.queue_wait_ms, upstream_ms=outcome.upstream_ms, attempts=outcome.attempts,
                 upstream_status=outcome.upstream_status)
    if outcome.status == "queue_timeout":
        raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
    return Dispatched(request_id=request_id, estimate=estimate, admission=admission, lane=record.lane, outcome=outcome)
