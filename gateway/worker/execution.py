"""The worker's half of a request: decide who owns it, call the pool at most
once per delivery that owns it, settle, write the ledger, hand the outcome to
the waiting web process. Every step is safe to repeat (acks_late redelivers a
task whose worker died).

A request that fails in the worker for a reason of its own (anything but
Redis or the database being away, which the task waits out or retries) is
settled and answered at once as ``worker_error``: it must not hold its
in-flight slot, its caller or its job until a lease expires."""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import replace
from functools import partial

import openai
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from budgets.admission.buckets import settle_call
from budgets.admission.capacity import capacity_signal_call
from budgets.admission.provider_limits import SentMark, retry_after_ms
from budgets.redis.clients import get_redis, redis_now_ms
from budgets.redis.composition import RoundTrip, Step, answered
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.admission import keys as budget_keys
from budgets.errors import BudgetUnavailable
from budgets.ledger.writer import usage_record_write
from gateway.core.db_threads import DATABASE_AWAY, on_database
from gateway.core import keys
from gateway.core.request.endpoints import pool_path
from gateway.core.protection.concurrency import lane_limited
from gateway.core.request.enqueue import CallHint
from gateway.core.errors import error_body
from gateway.core.request.finish import finish_steps, request_finish
from gateway.core.log_context import log_annotate
from gateway.core.observability import lease_expiry_report, upstream_answer_observe
from gateway.core.request.records import (EXPIRED, LOST, REAP, REDELIVERED, REQUEUE, RUNNING, WORKER, Claim, Outcome,
                                  RequestRecord, claim_call, ledger_entry, publish_call, record_claim_steps, ttl_ms,
                                  worker_lost_outcome)
from gateway.core.request.settlement import SETTLED, request_settle, settlement_steps
from gateway.core.request.streams import stream_end
from gateway.core.request.takeover import request_take_over
from gateway.worker.failover import request_fail_over
from gateway.worker.heartbeat import HEARTBEATS
from gateway.worker.lane_slot import CircuitOpen, GateAsked, call_gate_steps, lane_signal_steps, lane_slot
from gateway.worker.pool_client import pool_call_inline, pool_client, pool_post, pool_requests_sent
from gateway.worker.pool_errors import pool_error_message
from gateway.worker.retry import RETRYABLE_STATUSES, RetryPolicy, retry_budget_earn_call, retry_budget_spend
from gateway.worker.streaming import pool_stream
from gateway.worker.shutdown import CallInterrupted, HandBack, pause, pool_call_within_grace, shutdown_requested

ANSWER_KEEP = LuaScript(__package__, "answer_keep.lua")
logger = logging.getLogger(__name__)

# Infrastructure away: the request is fine, so the task waits for Redis or
# retries for the database (gateway/worker/tasks.py) instead of failing it.
REDIS_AWAY = (BudgetUnavailable, RedisConnectionError, RedisTimeoutError)
INFRASTRUCTURE_AWAY = (*REDIS_AWAY, *DATABASE_AWAY)

WORKER_ERROR = "worker_error"
# A pool's answer that says the request itself is wrong: the caller's error,
# relayed as it is (not retried, no capacity signal, tokens refunded).
CALLER_ERROR_STATUSES = {400, 404, 413, 422}
_CODE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")

def _answer_label(outcome: Outcome) -> str:
    """The pool's answer to one attempt, as a metric label: its HTTP status,
    or what stood in for one (timeout, unreachable, invalid_response)."""
    if outcome.upstream_status:
        return str(outcome.upstream_status)
    code = str((outcome.body or {}).get("error", {}).get("code", ""))
    return code.removeprefix("upstream_") or "unknown"


def _pool_refusal(exc: openai.APIStatusError, upstream_ms: int) -> Outcome:
    """The pool's 4xx for a malformed request, as the caller's own error."""
    try:
        data = exc.response.json()
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    error = error if isinstance(error, dict) else {}
    message = error.get("message") if isinstance(error.get("message"), str) else exc.response.text
    code = _CODE_CHARS.sub("", error.get("code") or "")[:64] if isinstance(error.get("code"), str) else ""
    param = error.get("param") if isinstance(error.get("param"), str) else None
    return Outcome(
        status="invalid_request",
        http_status=exc.status_code,
        # Kept short and NUL-free: it reaches a job's JSON row in PostgreSQL.
        body=error_body(message=f"The inference pool refused the request: {message[:1000]}".replace("\x00", ""),
                        error_type="invalid_request_error", code=code or "invalid_request",
                        param=param[:200].replace("\x00", "") if param else None),
        upstream_ms=upstream_ms,
        attempts=1,
        upstream_status=exc.status_code,
        upstream_message=pool_error_message(exc),
    )


def _single_call(record: RequestRecord, *, mark: SentMark | None = None) -> tuple[Outcome, bool]:
    """One call to the pool with the SDK (its retries are off). Returns the
    outcome and whether another attempt could help. ``mark``: the call's,
    from its take of the provider's room (gateway/worker/lane_slot.py)."""
    client = pool_client(base_url=record.pool_base_url, api_key_env=record.pool_api_key_env, pool_id=record.pool_id)
    payload = dict(record.payload)
    sim = payload.pop("sim", None)
    started = time.monotonic()
    try:
        if record.stream:
            # Relayed chunk by chunk; from the first chunk on, never retried.
            return pool_stream(client, record, payload=payload, extra_body={"sim": sim} if sim is not None else None,
                               started=started, mark=mark), False
        # The raw response: the pool's JSON is relayed as it came, without
        # the SDK's request building and model parsing (pool_post, the
        # SDK's exceptions). The call may be cut off when the worker stops
        # (gateway/worker/shutdown.py).
        raw = pool_call_within_grace(partial(
            pool_post, client, body={**payload, "sim": sim} if sim is not None else payload,
            pool_id=record.pool_id, mark=mark, path=pool_path(record.endpoint)), inline=pool_call_inline(client))
    except openai.APIStatusError as exc:
        upstream_ms = int((time.monotonic() - started) * 1000)
        if exc.status_code in CALLER_ERROR_STATUSES:
            return _pool_refusal(exc, upstream_ms), False
        status = 429 if exc.status_code == 429 else 502
        return Outcome(
            status="upstream_error",
            http_status=status,
            body=error_body(message=f"The inference pool answered {exc.status_code}.", error_type="upstream_error",
                            code="upstream_rate_limited" if status == 429 else "upstream_error"),
            upstream_ms=upstream_ms,
            retry_after_ms=retry_after_ms(exc.response.headers) if exc.response is not None else None,
            attempts=1,
            upstream_status=exc.status_code,
            upstream_message=pool_error_message(exc),
        ), exc.status_code in RETRYABLE_STATUSES
    except (openai.APITimeoutError, openai.APIConnectionError) as exc:
        upstream_ms = int((time.monotonic() - started) * 1000)
        timed_out = isinstance(exc, openai.APITimeoutError)
        # A timed-out call may still be running upstream: retrying it is how
        # a slowdown becomes a storm. Connection failures never reached it.
        return Outcome(
            status="upstream_error",
            http_status=504 if timed_out else 502,
            body=error_body(message="The inference pool timed out." if timed_out else "The inference pool is unreachable.",
                            error_type="upstream_error",
                            code="upstream_timeout" if timed_out else "upstream_unreachable"),
            upstream_ms=upstream_ms,
            attempts=1,
        ), not timed_out
    upstream_ms = int((time.monotonic() - started) * 1000)
    try:
        body = json.loads(raw.text)
        usage = body.get("usage") or {}
        input_tokens, output_tokens = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return Outcome(
            status="upstream_error", http_status=502, upstream_ms=upstream_ms, attempts=1,
            body=error_body(message="The inference pool answered with something that is not a JSON answer with its usage.",
                            error_type="upstream_error", code="upstream_invalid_response"),
        ), False
    return Outcome(
        status="ok",
        body=body,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        upstream_ms=upstream_ms,
        attempts=1,
        upstream_status=200,
        usage_source="pool",
    ), False


def pool_call(record: RequestRecord, *, policy: RetryPolicy | None = None, rng: random.Random | None = None,
              deferred: list[Step] | None = None, taken: SentMark | None = None,
              asked: GateAsked | None = None) -> tuple[Outcome, RequestRecord]:
    """Call the pool, retrying only as the policy and the budgets allow, and
    feed every answer to the pool's adaptive capacity. A call that failed
    before its first token, or found its pool's circuit open, moves once to
    the next pool of its route, within the retry budget
    (gateway/worker/failover.py): returns the outcome and
    the record as it ends (naming the pool that served). ``deferred``: a list
    the caller runs after (``_answer_keep_settled``'s ``signals``, one round trip
    fewer): an attempt that is surely the last (its answer is not retried, or
    no attempt is left) puts its signals there instead of sending them.
    ``taken``: the provider room its release took for the first attempt
    (a held request: gateway/core/protection/held.py); ``asked``: the first attempt's
    gate and take, asked with the delivery's claim."""
    rng = rng or random.Random()
    policy = policy or RetryPolicy.from_settings()
    attempts = 0
    upstream_ms = 0
    throttled = 0
    stay = False  # no other pool admitted it: wait for this one's circuit
    while True:
        try:
            # A pool whose circuit opened after admission is left for the
            # next of the route, not waited for (gateway/worker/failover.py).
            with lane_slot(record, taken=taken, asked=asked,
                           move_if_open=not stay and bool(record.fallback_pools) and not record.failed_over) as slot:
                outcome, retryable = _single_call(record, mark=slot.mark)
        except CircuitOpen:
            taken = asked = None
            moved = _fail_over(record, policy=policy)
            if moved is not None:
                record = moved
            else:
                stay = True
            continue
        taken = asked = None  # a retry takes its own
        # What the answer tells the circuit, the lane limits and the pool's
        # capacity (and, on the first attempt, the pool's retry budget): one
        # round trip, one script.
        signals = lane_signal_steps(record, outcome, hold=slot)
        if attempts == 0:
            signals.append(Step("retry_budget", retry_budget_earn_call(pool_id=record.pool_id, policy=policy)))
        if outcome.status == "ok":
            per_token = outcome.upstream_ms / (outcome.output_tokens + 1)
            signals.append(Step("capacity", capacity_signal_call(pool_id=record.pool_id, event="ok",
                                                                 latency_per_token_ms=per_token)))
        elif outcome.upstream_status == 429:
            throttled += 1
            signals.append(Step("capacity", capacity_signal_call(pool_id=record.pool_id, event="throttle",
                                                                 retry_after_ms=outcome.retry_after_ms or 0)))
        may_move = retryable and bool(record.fallback_pools) and not record.failed_over
        if deferred is not None and not may_move and (not retryable or attempts + 1 >= policy.max_attempts):
            deferred.extend(signals)
        else:
            RoundTrip(*signals).run()
        upstream_answer_observe(pool_id=record.pool_id, status=_answer_label(outcome))
        attempts += 1
        upstream_ms += outcome.upstream_ms
        if may_move:
            moved = _fail_over(record, policy=policy)
            if moved is not None:
                record = moved
                continue  # another pool: no backoff owed to this one
        if not retryable or attempts >= policy.max_attempts:
            break
        delay_ms = policy.delay_ms(attempts, upstream_retry_after_ms=outcome.retry_after_ms, rng=rng)
        if record.retry_deadline_ms and redis_now_ms() + delay_ms > record.retry_deadline_ms:
            break
        verdict = retry_budget_spend(pool_id=record.pool_id, workload_id=record.workload_id,
                                     session_id=record.session_id, policy=policy)
        if verdict != "ok":
            logger.info("request %s: no retry (%s)", record.request_id, verdict)
            break
        if not pause(delay_ms / 1000):
            break  # the worker is stopping: the last attempt's outcome stands
    if record.failed_over:
        outcome = replace(outcome, pool=record.pool_slug)
    return replace(outcome, attempts=attempts, upstream_ms=upstream_ms, upstream_429s=throttled), record


def _fail_over(record: RequestRecord, *, policy: RetryPolicy) -> RequestRecord | None:
    """The record moved to the next pool of its route, if the session's
    retry budget allows another attempt and a pool admits it."""
    verdict = retry_budget_spend(pool_id=record.pool_id, workload_id=record.workload_id,
                                 session_id=record.session_id, policy=policy, move=True)
    if verdict != "ok":
        logger.info("request %s: no fail-over (%s)", record.request_id, verdict)
        return None
    moved = request_fail_over(record)
    if moved is not None:
        log_annotate(pool_id=moved.pool_id, failed_over=True)
    return moved


def request_fail(*, record: RequestRecord, pool_reached: bool, answer: Outcome | None) -> Outcome:
    """Settle and answer a request the worker failed on for a reason of its
    own (a payload the SDK cannot encode, a bug): at once, not when its lease
    expires minutes later, so it holds no in-flight slot and its caller and
    job hear now. Each step runs even if another fails; only Redis or the
    database being away stops it (the task then tries the request again).

    What it is charged: the pool's answer if this delivery got one; the
    estimate if a call went out and nothing came back (it may have run: the
    safe side of I1, as for an expired lease); nothing if the pool was never
    reached."""
    if answer is not None:
        input_tokens, output_tokens, pool_called = answer.input_tokens, answer.output_tokens, True
        charged = "it is charged what the pool reported"
    elif pool_reached:
        input_tokens, output_tokens, pool_called = record.estimated_input_tokens, record.estimated_output_tokens, True
        charged = "the pool may have run it, so its estimate is charged"
    else:
        input_tokens = output_tokens = 0
        pool_called = False
        charged = "the pool was not called and nothing is charged"
    outcome = Outcome(
        status=WORKER_ERROR, http_status=500,
        body=error_body(message=f"Sluice failed while running this request; {charged}.", error_type="server_error",
                        code=WORKER_ERROR),
        input_tokens=input_tokens, output_tokens=output_tokens, attempts=answer.attempts if answer else int(pool_reached),
        usage_source=(answer.usage_source or "pool") if answer is not None else ("estimate" if pool_reached else ""),
        upstream_ms=answer.upstream_ms if answer else 0,
        queue_wait_ms=max(0, int(redis_now_ms() - record.admitted_ms)),
    )
    for name, step in finish_steps(record=record, outcome=outcome, pool_called=pool_called):
        try:
            step()
        except INFRASTRUCTURE_AWAY:
            raise
        except Exception:  # noqa: BLE001 - the remaining steps (the caller's answer) matter more
            logger.exception("request %s: step %s failed while settling a failed request", record.request_id, name)
    return outcome


def interrupted_outcome(record: RequestRecord, *, queue_wait_ms: int) -> Outcome:
    """A call cut off by its worker's stop. Nobody knows what the pool did
    with it, so the estimate is charged (the safe side of I1, as for an
    expired lease); the caller is told to retry."""
    return Outcome(
        status="upstream_error", http_status=503, queue_wait_ms=queue_wait_ms, retry_after_ms=1000,
        input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
        usage_source="estimate",
        body=error_body(message="The worker running this request stopped before the pool answered; retry it.",
                        error_type="service_unavailable", code="worker_shutdown"),
    )


def _answer_keep(client, record: RequestRecord, outcome: Outcome) -> Outcome:
    """Store the pool's answer once: the first stored wins, so whoever
    finishes the request (this worker, one that took it over, a late one)
    settles and publishes the same answer, and a pool's answer and an
    interruption never both count. A stream's own end replaces the answer
    its first chunk stored (gateway/worker/streaming.py). A delivery's own
    call stores its answer with ``_answer_keep_settled`` instead."""
    kept = _answer_store_call(record, outcome).run(client)
    return outcome if kept else _answer_stored(client, record, outcome)


def _answer_store_call(record: RequestRecord, outcome: Outcome) -> ScriptCall[bool]:
    return ScriptCall(script=ANSWER_KEEP, keys=[keys.request_response(record.request_id)],
                      args=[outcome.to_json(), int(ttl_ms()), "0" if outcome.streamed else "1"],
                      parse=lambda raw: int(raw[0]) == 1)


def _answer_stored(client, record: RequestRecord, outcome: Outcome) -> Outcome:
    """The answer stored first (another's), or ``outcome`` when none is left."""
    stored = client.get(keys.request_response(record.request_id))
    return Outcome.from_json(stored) if stored is not None else outcome


def _answer_keep_settled(client, record: RequestRecord, outcome: Outcome, *,
                         signals: list[Step]) -> tuple[Outcome, bool, bool]:
    """``_answer_keep`` for this delivery's own call, in one round trip:
    ``signals`` first (what the last attempt's answer tells the lane limits
    and the circuit: ``pool_call``'s ``deferred``), then ``answer_keep`` (the
    answer's store), then, only when this answer is the one stored, the
    buckets' and the spend's settlement on it and, for an unstreamed answer,
    ``publish`` to the waiting caller. Returns the answer to finish on,
    whether it is settled already and whether published; when another
    answer was first, the finish settles and publishes that one.

    The caller has its answer before the ledger row and the departure's
    round trip, which it does not wait for. A stream's caller too: its end
    marker follows the publish at once (``stream_end``), so the stream ends
    without waiting for the row, nor for a database that is away."""
    settle = settlement_steps(record, input_tokens=outcome.input_tokens, output_tokens=outcome.output_tokens,
                              pool_called=True, only_if=answered("answer_keep", 1))
    steps = [*signals, Step("answer_keep", _answer_store_call(record, outcome)), *settle,
             Step("publish", publish_call(record, outcome), only_if=answered(settle[-1].name, *SETTLED))]
    answers = RoundTrip(*steps).run(client)
    if not answers["answer_keep"]:
        return _answer_stored(client, record, outcome), False, False
    if record.stream:
        # After the publish: the web process relaying the stream wakes on
        # the marker and ends the caller's stream with the published outcome.
        stream_end(request_id=record.request_id, client=client, wake=record.stream_wake)
    return outcome, True, True


def _first_trip(request_id: str, *, generation: int, taken: SentMark | None,
                call: CallHint | None) -> RoundTrip | None:
    """A delivery's first round trip: ``record`` read and ``claim``ed (the
    claim skipped when there is no record) and, for a first delivery whose
    lane message carries its call's hint, the call's ``gate`` and ``take``,
    only if this delivery owns it then. One it then does not make (an answer
    stored by an earlier delivery of the same message) leaves a half-open
    trial to its lease and a take to its window. None: the record is read
    alone (a stopping worker, or a request this process runs already)."""
    if shutdown_requested() or request_id in HEARTBEATS.running():
        return None
    steps = record_claim_steps(request_id, generation=generation, holder=HEARTBEATS.holder)
    if call is not None and generation == 0 and taken is None and not lane_limited(call.lane):
        steps += call_gate_steps(pool_id=call.pool_id, tokens=call.tokens, lane=call.lane,
                                 borrowed=call.borrowed, holder=request_id, only_if=answered("claim", WORKER))
    return RoundTrip(*steps)


def request_execute(*, request_id: str, generation: int = 0, answered: dict[str, Outcome] | None = None,
                    taken: SentMark | None = None, call: CallHint | None = None) -> str:
    """Run one delivery of an admitted request (``generation`` 0 is the first;
    a request taken over from a lost worker is delivered again as the next).
    Returns what happened, for logs and tests.

    ``answered`` carries the pool's answer across the task's own retries
    while Redis is away (gateway/worker/tasks.py): a call whose answer could
    not be stored yet is not made a second time. A stopping worker hands a
    request back (``HandBack``: gateway/worker/shutdown.py); anything else
    that fails is settled and answered at once (``request_fail``).
    ``taken``: the provider room taken for it when it was released from the
    held set (gateway/core/protection/held.py). ``call``: the lane message's hint
    (gateway/core/request/enqueue.py ``CallHint``): the first delivery asks its
    pool call's gate and take with its claim."""
    answered = {} if answered is None else answered
    client = get_redis()
    claim = asked = None
    trip = _first_trip(request_id, generation=generation, taken=taken, call=call)
    if trip is not None:
        answers = trip.run(client)
        data, claim = answers["record"], answers["claim"]
        if answers.get("gate") is not None:
            asked = GateAsked(verdict=answers["gate"], take=answers["take"])
    else:
        data = client.hgetall(keys.request_record(request_id))
    if not data:
        logger.warning("request %s has no record (expired?); dropping", request_id)
        return "missing"
    record = RequestRecord.from_redis(data)
    log_annotate(lane=record.lane, pool_id=record.pool_id, workload_id=record.workload_id)
    if asked is not None and CallHint.of(record) != call:
        logger.warning("request %s: its lane message's call hint %s is not its record's; asking again",
                       request_id, call)
        asked = None
    if claim is None and shutdown_requested() and request_id not in answered:
        # Not claimed yet and the worker is stopping: the next worker runs it.
        raise HandBack(request_id)
    sent_before = pool_requests_sent()
    try:
        return _request_run(record, generation=generation, client=client, answered=answered, claim=claim,
                            taken=taken, asked=asked)
    except (*INFRASTRUCTURE_AWAY, HandBack):
        raise
    except Exception:  # noqa: BLE001 - whatever it is, the request must not be left holding its slot
        logger.exception("request %s failed in the worker; settling it as %s", request_id, WORKER_ERROR)
        if record.fallback_pools:
            # It may have moved to another pool (gateway/worker/failover.py): settle it there.
            record = RequestRecord.from_redis(client.hgetall(keys.request_record(request_id)) or record.to_redis())
        request_fail(record=record, pool_reached=pool_requests_sent() > sent_before, answer=answered.get(request_id))
        return WORKER_ERROR


def _request_run(record: RequestRecord, *, generation: int, client, answered: dict[str, Outcome],
                 claim: Claim | None = None, taken: SentMark | None = None, asked: GateAsked | None = None) -> str:
    """``claim``: this delivery's claim when it went with the record's read."""
    request_id = record.request_id
    if claim is None:
        if request_id in HEARTBEATS.running():
            return RUNNING  # a duplicate delivery, while this very process runs the request
        claim = claim_call(WORKER, record, generation=generation, holder=HEARTBEATS.holder).run(client)
    claimed = time.monotonic()
    queue_wait_ms = max(0, int(claim.now_ms - record.admitted_ms))

    def redis_now() -> float:
        # The Redis clock read by the claim, moved on by this host's own
        # monotonic clock: the request's total time without another round trip.
        return claim.now_ms + (time.monotonic() - claimed) * 1000
    if claim.verdict == EXPIRED:
        # Deadline passed in the queue: never call the pool, refund everything.
        outcome = Outcome(
            status="queue_timeout",
            http_status=503,
            body=error_body(message="The request waited in its lane past its queue timeout.",
                            error_type="queue_timeout", code="queue_timeout"),
            queue_wait_ms=queue_wait_ms,
        )
        request_finish(record=record, outcome=outcome, pool_called=False)
        return EXPIRED
    if claim.verdict == LOST and claim.changed:
        # A lost worker's call whose new delivery came too late to start:
        # the first may have run, so it is charged on its estimate.
        request_finish(record=record, outcome=worker_lost_outcome(record, queue_wait_ms=queue_wait_ms),
                       pool_called=True)
        return LOST
    if claim.verdict not in (WORKER, REDELIVERED):
        # The web side gave up, a later delivery owns it, or a live worker
        # runs it: drop this one. An answer this delivery already got (before
        # Redis went away) is kept for the one that owns it now.
        if request_id in answered:
            _answer_keep(client, record, answered[request_id])
        logger.info("request %s delivery %s: %s", request_id, generation, claim.verdict)
        return claim.verdict
    with HEARTBEATS.kept(request_id=request_id, generation=claim.generation):
        # Read only when gateway/core/request/claim.lua saw it stored (one round trip fewer on a
        # first delivery); one stored after the claim wins at the answer's store (SET NX).
        stored = client.get(keys.request_response(request_id)) if claim.answered else None
        # Only this delivery's own call settles (and publishes) as it stores its answer.
        settled = published = False
        if stored is not None:
            outcome = Outcome.from_json(stored)  # a redelivery: the pool already answered
        elif request_id in answered:
            # This delivery's own call, before Redis went away.
            outcome = _answer_keep(client, record, answered[request_id])
        else:
            try:
                calling = time.monotonic()
                signals: list[Step] = []
                outcome, record = pool_call(record, deferred=signals, taken=taken, asked=asked)
                outcome = replace(outcome, queue_wait_ms=queue_wait_ms)
                if outcome.ttft_ms is not None:
                    # Earlier attempts and the wait between them count: the
                    # call's time less what followed the last attempt's first chunk.
                    before_first_chunk = int((time.monotonic() - calling) * 1000) - (outcome.upstream_ms - outcome.ttft_ms)
                    outcome = replace(outcome, ttft_ms=queue_wait_ms + max(outcome.ttft_ms, before_first_chunk))
            except CallInterrupted as interrupted:
                if interrupted.started:
                    # The redelivery finishes it from this answer, without a call.
                    _answer_keep(client, record, interrupted_outcome(record, queue_wait_ms=queue_wait_ms))
                raise HandBack(request_id) from interrupted
            answered[request_id] = outcome
            outcome, settled, published = _answer_keep_settled(client, record, outcome, signals=signals)
        request_finish(record=record, outcome=outcome, pool_called=True, now_ms=redis_now(), settled=settled,
                       published=published)
    return outcome.status


def leases_reap(*, pool_ids: list[int]) -> int:
    """Release leases whose worker vanished (killed mid-call, message lost).

    A lease outlives any healthy request (queue timeout + upstream timeout +
    margin), so an expired one means nobody will settle it.

    - With a request record, a task may have called the pool and we cannot
      know what it did, so the estimate stays charged (the safe side of I1),
      the ledger gets a ``lease_expired`` row charged on the estimate, and
      the record is deleted so a late redelivery drops the task instead of
      calling the pool. A call whose worker still beats is not lost (a
      redelivery that started late): it keeps its lease. One whose worker is
      lost is taken over first (gateway/core/request/takeover.py).
    - Without one, nothing could ever run it: an admission whose caller was
      told it failed (Redis answered the admit after the web process had
      timed out, or the enqueue failed and so did its refund). The pool was
      never called: everything is refunded, and there is no ledger row
      because there was no request."""
    client = get_redis()
    reaped = 0
    now_ms = redis_now_ms(client)
    for pool_id in pool_ids:
        expired = client.zrangebyscore(budget_keys.pool_leases(pool_id), "-inf", now_ms, start=0, num=500)
        for request_id in expired:
            data = client.hgetall(keys.request_record(request_id))
            if data:
                record = RequestRecord.from_redis(data)
                claim = claim_call(REAP, record).run(client)
                if claim.verdict == RUNNING:
                    continue
                request_take_over(record=record, claim=claim, client=client)
                if claim.changed and claim.verdict == REQUEUE:
                    continue  # a new delivery runs it
            lease = client.hgetall(budget_keys.lease(pool_id, request_id))
            workload_id = int(data.get("workload_id") or lease.get("wid") or 0)
            if data:
                # The estimate stays charged, tokens and spend alike; the next
                # spend reconciliation reads the lease_expired row instead.
                k_in, k_out = int(float(lease.get("k_in", 0))), int(float(lease.get("k_out", 0)))
                request_settle(record=RequestRecord.from_redis(data), input_tokens=k_in, output_tokens=k_out,
                               pool_called=True, client=client)
            else:
                settle_call(pool_id=pool_id, workload_id=workload_id, request_id=request_id,
                            actual_input_tokens=0, actual_output_tokens=0, pool_called=False).run(client)
            if data:
                # The row before the lease goes: a database away here leaves the
                # lease for the next pass, which settles nothing twice (a replay)
                # and writes the same row (once, on the request id).
                writing = time.monotonic()
                on_database(usage_record_write, entry=ledger_entry(
                    record, status="lease_expired", actual_input_tokens=record.estimated_input_tokens,
                    actual_output_tokens=record.estimated_output_tokens,
                    total_ms=max(0, int(now_ms - record.admitted_ms)), error="lease_expired",
                    usage_source="estimate"))
                lease_expiry_report(record=record, ledger_lag_s=(now_ms - record.admitted_ms) / 1000
                                    + (time.monotonic() - writing))
            client.zrem(budget_keys.pool_leases(pool_id), request_id)
            if data:
                client.delete(keys.request_record(request_id))
            reaped += 1
    return reaped
