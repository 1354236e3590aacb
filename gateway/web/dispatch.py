"""The web process's half of a request: estimate, admit, enqueue on its lane,
wait for the outcome without holding a thread, give up at the deadline
(atomically against the worker starting: gateway/core/request/claim.lua), and take
the request over when its worker is lost mid-call (gateway/core/request/takeover.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from django.conf import settings

import llm_tokens

from budgets.admission.buckets import Admission
from budgets.admission.estimation import Estimate
from budgets.redis.clients import REDIS_UNAVAILABLE, get_async_redis
from budgets.redis.composition import Commands
from budgets.errors import BudgetUnavailable, Rejected
from budgets.ledger.writer import usage_record_write
from gateway.core import keys
from gateway.core.db_threads import database_off_loop
from gateway.core.request.admission import lease_ttl_ms
from gateway.core.request.routing import request_route_admit_async
from gateway.core.request.endpoints import ApiRequest
from gateway.core.request.context import CallerContext
from gateway.core.request.enqueue import new_request_id, record_build, record_enqueue_async
from gateway.core.errors import queue_timeout, worker_lost
from gateway.core.log_context import log_annotate
from gateway.core.metrics import departure_record
from gateway.core.observability import settlement_report
from gateway.core.request.records import (EXPIRED, FINISH, GAVE_UP, LOST, PUBLISHED, REQUEUE, RUNNING, Claim, Outcome,
                                          RequestRecord, ledger_entry)
from gateway.core.request.settlement import request_refund_async
from gateway.core.request.streams import CHUNK_FIELD, STREAMING, stream_cancel
from gateway.core.request.takeover import request_take_over
from gateway.web.admission_turns import turn_leave
from gateway.web.claim_looks import claim_look
from gateway.web.stream_reads import STREAM_READ_BATCH, StreamSub, shared_reads, stream_subscribe, stream_wake_key

logger = logging.getLogger(__name__)

# Time a worker needs beyond the queue deadline to finish a started call.
FINISH_GRACE_S = 5.0


@dataclass(frozen=True)
class Dispatched:
    request_id: str
    estimate: Estimate
    admission: Admission
    lane: str
    outcome: Outcome  # for a stream whose first chunk came: status STREAMING (gateway/web/relay.py)
    record: RequestRecord | None = None
    # A stream's entries the wait for its first chunk already read (id,
    # fields): the relay starts from them, not with a second read of the same.
    stream_head: tuple = ()
    # The caller on the pool that admitted it (its route's choice).
    ctx: CallerContext | None = None

    @property
    def pool_slug(self) -> str:
        """The pool that served it: the one it moved to, else the one that admitted it."""
        return self.outcome.pool or (self.record.pool_slug if self.record else "")


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
        (popped,) = await Commands().command("BLPOP", result_key, max(0.01, timeout_s)).run_async(blocking)
    except REDIS_UNAVAILABLE as exc:
        raise _result_unavailable(exc) from exc
    return Outcome.from_json(popped[1]) if popped else None


class _StreamFirstWait:
    """A stream's wait before its first chunk: wake at the first entry of
    its Redis Stream. A chunk: the stream starts (``STREAMING``), and the
    entries this read got are kept in ``head`` for the relay
    (gateway/web/relay.py) to send first, so the first token costs one read,
    not two. The end marker first: the request ended before any chunk (a
    refusal, a timeout), and its outcome is answered as JSON, exactly as an
    unstreamed request's."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.stream_key = keys.request_stream(record.request_id)
        self.result_key = keys.request_result(record.request_id)
        self.head: tuple = ()
        self.pool_slug = record.pool_slug
        self.sub: StreamSub | None = None

    def close(self) -> None:
        """End the subscription (the wait is over, however it ended)."""
        if self.sub is not None:
            self.sub.close()
            self.sub = None

    async def __call__(self, timeout_s: float) -> Outcome | None:
        blocking = get_async_redis(blocking=True)
        try:
            if shared_reads():  # the process's one read of every stream (gateway/web/stream_reads.py)
                # Subscribed once for the whole wait, not per heartbeat
                # interval: each subscription wakes the shared read.
                self.sub = self.sub or stream_subscribe(self.stream_key)
                entries = await self.sub.read(timeout_s)
                if entries:
                    self.close()
                reply = [(self.stream_key, entries)] if entries else None
            else:
                reply = await blocking.xread({self.stream_key: "0-0"}, count=STREAM_READ_BATCH,
                                             block=max(1, int(timeout_s * 1000)))
        except REDIS_UNAVAILABLE as exc:
            raise _result_unavailable(exc) from exc
        if reply and CHUNK_FIELD in reply[0][1][0][1]:
            self.head = tuple(reply[0][1])
            if self.record.fallback_pools:
                # It may have moved to another pool before this first chunk.
                try:
                    served = await blocking.hget(keys.request_record(self.record.request_id), "pool_slug")
                except REDIS_UNAVAILABLE:
                    served = None
                self.pool_slug = served or self.pool_slug
            return Outcome(status=STREAMING, streamed=True, pool=self.pool_slug)
        if reply:  # the end marker: the outcome was published before it
            return await _wait_outcome(self.result_key, timeout_s)
        # Nothing yet. An outcome whose end marker never came (a finish
        # stopped between its publish and the marker) is popped once the
        # claim between waits says it was published (_await_outcome).
        return None


def _stream_cancel_quietly(record: RequestRecord) -> None:
    try:
        stream_cancel(request_id=record.request_id)
    except Exception:  # noqa: BLE001 - Redis away: the stream runs to its end and is charged in full
        logger.warning("request %s: could not cancel the stream", record.request_id, exc_info=True)


def _result_unavailable(exc: BaseException) -> Rejected:
    # The request was admitted and queued; its worker settles it. The
    # caller learns only that we lost sight of it; the log says why.
    logger.warning("lost the result store while waiting: %s: %s", type(exc).__name__, exc)
    return Rejected(reason="result_unavailable", message="Sluice lost its connection to the result store; the request may still complete.",
                    status=503, retry_after_ms=1000, error_type="service_unavailable")


async def _claim(record: RequestRecord) -> Claim:
    try:
        return await claim_look(record)  # with this turn's other looks (gateway/web/claim_looks.py)
    except BudgetUnavailable as exc:
        raise _result_unavailable(exc) from exc


async def _take_over(record: RequestRecord, claim: Claim) -> None:
    try:
        await database_off_loop(request_take_over)(record=record, claim=claim)
    except Exception:  # the database or Redis: the reaper and the lease settle it later
        logger.exception("request %s: taking it over (%s) failed", record.request_id, claim.verdict)


async def _await_outcome(ctx: CallerContext, record: RequestRecord,
                         wait: Callable[[float], Awaitable[Outcome | None]] | None = None) -> Outcome:
    """Wait for the outcome one heartbeat interval at a time. Between waits,
    gateway/core/request/claim.lua says whether the request is still queued or running, gives it
    up at its queue deadline (we refund), or takes it over from a lost worker
    (we redeliver it, finish it with the pool's stored answer, or settle it
    as lost): the caller hears within seconds, not at the broker's
    visibility timeout. ``wait``: how one wait is made (a stream's also
    wakes at its first chunk: gateway/web/relay.py)."""
    result_key = keys.request_result(record.request_id)
    if wait is None:
        async def wait(timeout_s: float) -> Outcome | None:
            return await _wait_outcome(result_key, timeout_s)
    interval_s = settings.SLUICE_HEARTBEAT_INTERVAL_S
    finish_ms = (settings.SLUICE_UPSTREAM_TIMEOUT_S + FINISH_GRACE_S) * 1000
    # The latest a running delivery may have started: past this plus the
    # upstream timeout, the pool is not answering.
    started_by_ms = record.deadline_ms
    now_ms = record.admitted_ms
    while True:
        until_deadline_s = (record.deadline_ms - now_ms) / 1000
        # Wake at the queue deadline, not up to an interval after it.
        wait_s = interval_s if until_deadline_s <= 0 else min(interval_s, until_deadline_s + 0.005)
        outcome = await wait(wait_s)
        if outcome is not None:
            return outcome
        claim = await _claim(record)
        now_ms = claim.now_ms
        if claim.verdict == PUBLISHED:
            # A stream's wait watches its stream, not the result list: an
            # outcome published without its end marker is taken here.
            outcome = await _wait_outcome(result_key, 0.01)
            if outcome is not None:
                return outcome
        if claim.verdict == GAVE_UP:
            if claim.changed:
                # We own the refund: the worker will drop the task unrun.
                await request_refund_async(record)
                await database_off_loop(_record_timeout)(record, int(ctx.queue_timeout_s * 1000))
            raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
        if claim.verdict == EXPIRED:
            # The worker found the deadline passed; it refunds and records.
            raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
        if claim.verdict == LOST:
            if claim.changed:
                await _take_over(record, claim)
            raise worker_lost()
        if claim.verdict in (REQUEUE, FINISH):
            if claim.verdict == REQUEUE:
                redelivery_by_ms = min(record.retry_deadline_ms or record.deadline_ms,
                                       now_ms + settings.SLUICE_REDELIVERY_WAIT_S * 1000)
                started_by_ms = max(started_by_ms, redelivery_by_ms)
            await _take_over(record, claim)
            continue
        if claim.verdict == RUNNING and now_ms > started_by_ms + finish_ms:
            raise Rejected(reason="upstream_timeout", message="The inference pool did not answer in time.",
                           status=504, retry_after_ms=None, error_type="upstream_error")


async def _tokenizers_loaded(pools: list[CallerContext]) -> None:
    """Load on a thread a pool's tokenizer this process has not loaded yet:
    parsing its ranks takes a fraction of a second of CPU, which on the
    event loop would hold every request and stream of this process. The
    default tokenizer is loaded at the process's start (llm_platform/asgi.py)."""
    for name in {pool.tokenizer for pool in pools}:
        if not llm_tokens.encoding_loaded(name):
            await asyncio.to_thread(llm_tokens.get_encoding, name)


async def request_dispatch(*, ctx: CallerContext, request: ApiRequest, session_id: str = "",
                           request_id: str | None = None, body_digest: str = "") -> Dispatched:
    """Admit and run one /v1 request of any endpoint (chat, legacy
    completions, embeddings: gateway/core/request/endpoints.py); raises
    Rejected for every refusal. ``request_id``: the id the API gave the call
    (its logs, its ledger row); ``body_digest``: its body's
    (gateway/core/request/chat.py), which tells a client's retry of a request
    held through an outage (gateway/core/protection/held.py)."""
    estimates: dict[tuple[str, float], Estimate] = {}

    def estimate_for(on_pool: CallerContext) -> Estimate:
        # Each pool counts with its own tokenizer; the same one counts once.
        counted = (on_pool.tokenizer, on_pool.safety_factor)
        if counted not in estimates:
            estimates[counted] = request.estimate(on_pool)
        return estimates[counted]

    route = ctx.route(request.model)
    await _tokenizers_loaded(route or [ctx])
    first_estimate = estimate_for(route[0] if route else ctx)
    request_id = request_id or new_request_id()
    lease_ms = lease_ttl_ms(queue_s=ctx.queue_timeout_s)
    try:
        routed = await request_route_admit_async(route, request_id=request_id, model=request.model,
                                                 estimate_for=estimate_for, lease_ms=lease_ms, body_digest=body_digest)
    except Rejected as rejected:
        rejected.estimated_tokens = rejected.estimated_tokens or first_estimate.total_tokens  # for rejection stats
        raise
    ctx, admission, estimate = routed.ctx, routed.admission, routed.estimate
    record = replace(record_build(
        ctx, request_id=request_id, model=request.model, payload=request.pool_payload(estimate), estimate=estimate,
        admission=admission, deadline_ms=admission.admitted_ms + ctx.queue_timeout_s * 1000, session_id=session_id,
        # Retries must end while the caller still waits for them.
        retry_deadline_ms=admission.admitted_ms + (ctx.queue_timeout_s + settings.SLUICE_UPSTREAM_TIMEOUT_S / 2) * 1000,
        fallback_pool_ids=routed.fallback_pool_ids, endpoint=request.endpoint,
    ), stream=request.stream, stream_usage=request.stream_usage, tokenizer=ctx.tokenizer,
        # Its appends name it on this loop's notice stream (gateway/web/stream_reads.py).
        stream_wake=stream_wake_key() if request.stream and shared_reads() else "")
    log_annotate(lane=record.lane, pool_id=ctx.pool_id)
    await record_enqueue_async(record, lease_ms=lease_ms)
    turn_leave()  # on its lane: the next request's turn at the door

    first_wait = _StreamFirstWait(record) if record.stream else None
    try:
        outcome = await _await_outcome(ctx, record, wait=first_wait)
    except asyncio.CancelledError:
        if record.stream:
            # The caller left before the first chunk: the worker closes the
            # pool call at its first chunk and is charged what was produced.
            _stream_cancel_quietly(record)
        raise
    finally:
        if first_wait is not None:
            first_wait.close()
    log_annotate(queue_ms=outcome.queue_wait_ms, upstream_ms=outcome.upstream_ms, attempts=outcome.attempts,
                 upstream_status=outcome.upstream_status)
    if outcome.status == "queue_timeout":
        raise queue_timeout(queue_timeout_s=ctx.queue_timeout_s)
    if outcome.status == "worker_lost":
        raise worker_lost()
    return Dispatched(request_id=request_id, estimate=estimate, admission=admission, lane=record.lane, outcome=outcome,
                      record=record, stream_head=first_wait.head if first_wait is not None else (), ctx=ctx)
