"""The worker's half of a request: decide who owns it, call the pool at most
once per delivery that owns it, settle, write the ledger, hand the outcome to
the waiting web process. Every step is safe to repeat (acks_late redelivers a
task whose worker died)."""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import replace

import openai

from budgets.admission.buckets import settle_call
from budgets.admission.capacity import capacity_signal
from budgets.admission.redis_client import get_redis, redis_now_ms
from budgets.admission import keys as budget_keys
from budgets.ledger.writer import usage_record_write
from gateway.core import keys
from gateway.core.errors import error_body
from gateway.core.jobs import job_complete
from gateway.core.metrics import departure_record
from gateway.core.records import (EXPIRED, GAVE_UP, REDELIVERED, WORKER, Outcome, RequestRecord, claim_call,
                                  ledger_entry, publish_call, ttl_ms)
from gateway.worker.pool_client import pool_client
from gateway.worker.retry import RETRYABLE_STATUSES, RetryPolicy, retry_budget_earn, retry_budget_spend
from gateway.worker.shutdown import CallInterrupted, HandBack, pause, pool_call_within_grace, shutdown_requested

logger = logging.getLogger(__name__)



def _retry_after_ms(exc: openai.APIStatusError) -> int | None:
    headers = exc.response.headers if exc.response is not None else {}
    for name, scale in (("retry-after-ms", 1), ("retry-after", 1000)):
        value = headers.get(name)
        if value:
            try:
                return max(0, int(float(value) * scale))
            except ValueError:
                continue
    return None


def _single_call(record: RequestRecord) -> tuple[Outcome, bool]:
    """One call to the pool with the SDK (its retries are off). Returns the
    outcome and whether another attempt could help."""
    client = pool_client(base_url=record.pool_base_url, api_key_env=record.pool_api_key_env)
    payload = dict(record.payload)
    sim = payload.pop("sim", None)
    started = time.monotonic()
    try:
        # The raw response: the pool's JSON is relayed as it came, and the
        # SDK's model parsing (a fifth of a worker's CPU) is skipped. The call
        # may be cut off when the worker stops (gateway/worker/shutdown.py).
        raw = pool_call_within_grace(lambda: client.chat.completions.with_raw_response.create(
            **payload, extra_body={"sim": sim} if sim is not None else None))
    except openai.APIStatusError as exc:
        upstream_ms = int((time.monotonic() - started) * 1000)
        status = 429 if exc.status_code == 429 else 502
        return Outcome(
            status="upstream_error",
            http_status=status,
            body=error_body(message=f"The inference pool answered {exc.status_code}.", error_type="upstream_error",
                            code="upstream_rate_limited" if status == 429 else "upstream_error"),
            upstream_ms=upstream_ms,
            retry_after_ms=_retry_after_ms(exc),
            attempts=1,
            upstream_status=exc.status_code,
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
            body=error_body(message="The inference pool answered with something that is not a chat completion.",
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
    ), False


def pool_call(record: RequestRecord, *, policy: RetryPolicy | None = None, rng: random.Random | None = None) -> Outcome:
    """Call the pool, retrying only as the policy and the budgets allow, and
    feed every answer to the pool's adaptive capacity."""
    rng = rng or random.Random()
    policy = policy or RetryPolicy.from_settings()
    retry_budget_earn(pool_id=record.pool_id, policy=policy)
    attempts = 0
    upstream_ms = 0
    throttled = 0
    while True:
        outcome, retryable = _single_call(record)
        attempts += 1
        upstream_ms += outcome.upstream_ms
        if outcome.status == "ok":
            per_token = outcome.upstream_ms / (outcome.output_tokens + 1)
            capacity_signal(pool_id=record.pool_id, event="ok", latency_per_token_ms=per_token)
        elif outcome.upstream_status == 429:
            throttled += 1
            capacity_signal(pool_id=record.pool_id, event="throttle", retry_after_ms=outcome.retry_after_ms or 0)
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
    return replace(outcome, attempts=attempts, upstream_ms=upstream_ms, upstream_429s=throttled)


def request_finish(*, record: RequestRecord, outcome: Outcome, pool_called: bool) -> None:
    """Settle the buckets, write the ledger row, publish the outcome. Each step
    is idempotent on the request id, so a replay changes nothing."""
    settle_call(
        pool_id=record.pool_id,
        workload_id=record.workload_id,
        request_id=record.request_id,
        actual_input_tokens=outcome.input_tokens,
        actual_output_tokens=outcome.output_tokens,
        pool_called=pool_called,
        actual_cost_micro=record.actual_cost_micro(input_tokens=outcome.input_tokens,
                                                   output_tokens=outcome.output_tokens),
        spend_month_key=record.spend_month_key,
    ).run()
    total_ms = max(0, int(redis_now_ms() - record.admitted_ms))
    usage_record_write(entry=ledger_entry(
        record, status=outcome.status, actual_input_tokens=outcome.input_tokens,
        actual_output_tokens=outcome.output_tokens, queue_wait_ms=outcome.queue_wait_ms,
        upstream_ms=outcome.upstream_ms, total_ms=total_ms, attempts=outcome.attempts,
        error="" if outcome.status == "ok" else str((outcome.body or {}).get("error", {}).get("code", "")),
    ))
    departure_record(pool_id=record.pool_id, lane=record.lane, request_id=record.request_id,
                     time_in_system_ms=total_ms, upstream_429s=outcome.upstream_429s)
    publish_call(record, outcome).run()
    if record.job_id:
        job_complete(job_id=record.job_id, outcome=outcome)


def interrupted_outcome(record: RequestRecord, *, queue_wait_ms: int) -> Outcome:
    """A call cut off by its worker's stop. Nobody knows what the pool did
    with it, so the estimate is charged (the safe side of I1, as for an
    expired lease); the caller is told to retry."""
    return Outcome(
        status="upstream_error", http_status=503, queue_wait_ms=queue_wait_ms, retry_after_ms=1000,
        input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
        body=error_body(message="The worker running this request stopped before the pool answered; retry it.",
                        error_type="service_unavailable", code="worker_shutdown"),
    )


def _answer_keep(client, request_id: str, outcome: Outcome) -> Outcome:
    """Keep ``outcome`` as the request's answer unless one is kept already
    (first writer wins: a pool's answer and an interruption never both count)."""
    if client.set(keys.request_response(request_id), outcome.to_json(), px=ttl_ms(), nx=True):
        return outcome
    stored = client.get(keys.request_response(request_id))
    return Outcome.from_json(stored) if stored is not None else outcome


def request_execute(*, request_id: str, answered: dict[str, Outcome] | None = None) -> str:
    """Run one admitted request. Returns what happened, for logs and tests.

    ``answered`` carries the pool's answer across the task's own retries
    while Redis is away (gateway/worker/tasks.py): a call whose answer could
    not be stored yet is not made a second time."""
    answered = {} if answered is None else answered
    client = get_redis()
    data = client.hgetall(keys.request_record(request_id))
    if not data:
        logger.warning("request %s has no record (expired?); dropping", request_id)
        return "missing"
    record = RequestRecord.from_redis(data)
    if shutdown_requested() and request_id not in answered:
        # Not claimed yet and the worker is stopping: the next worker runs it.
        raise HandBack(request_id)
    owner = claim_call(WORKER, record).run(client)
    if owner == GAVE_UP:
        return GAVE_UP  # the web side refunded and recorded it
    queue_wait_ms = max(0, int(redis_now_ms(client) - record.admitted_ms))
    if owner == EXPIRED:
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
    stored = client.get(keys.request_response(request_id))
    if stored is not None:
        outcome = Outcome.from_json(stored)  # a redelivery: the pool already answered
    elif request_id in answered:
        outcome = answered[request_id]  # this delivery's own call, before Redis went away
        client.set(keys.request_response(request_id), outcome.to_json(), px=ttl_ms())
    elif owner == REDELIVERED and not record.job_id and redis_now_ms(client) > record.retry_deadline_ms:
        # The worker that started this synchronous call died and its caller
        # has stopped waiting: calling the pool now would be work nobody
        # reads. A provider does not bill a call whose client hung up.
        outcome = Outcome(
            status="upstream_error", http_status=502, queue_wait_ms=queue_wait_ms,
            body=error_body(message="The worker running this request was lost.", error_type="upstream_error",
                            code="worker_lost"),
        )
        request_finish(record=record, outcome=outcome, pool_called=False)
        return "abandoned"
    else:
        try:
            outcome = replace(pool_call(record), queue_wait_ms=queue_wait_ms)
        except CallInterrupted as interrupted:
            if interrupted.started:
                # The redelivery finishes it from this answer, without a call.
                _answer_keep(client, request_id, interrupted_outcome(record, queue_wait_ms=queue_wait_ms))
            raise HandBack(request_id) from interrupted
        outcome = _answer_keep(client, request_id, outcome)
        answered[request_id] = outcome
    request_finish(record=record, outcome=outcome, pool_called=True)
    return outcome.status


def leases_reap(*, pool_ids: list[int]) -> int:
    """Release leases whose worker vanished (killed mid-call, message lost).

    A lease outlives any healthy request (queue timeout + upstream timeout +
    margin), so an expired one means nobody will settle it.

    - With a request record, a task may have called the pool and we cannot
      know what it did, so the estimate stays charged (the safe side of I1),
      the ledger gets a ``lease_expired`` row, and the record is deleted so a
      late redelivery drops the task instead of calling the pool.
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
            lease = client.hgetall(budget_keys.lease(pool_id, request_id))
            workload_id = int(data.get("workload_id") or lease.get("wid") or 0)
            if data:
                k_in, k_out = int(float(lease.get("k_in", 0))), int(float(lease.get("k_out", 0)))
                settle_call(pool_id=pool_id, workload_id=workload_id, request_id=request_id,
                            actual_input_tokens=k_in, actual_output_tokens=k_out, pool_called=True).run(client)
            else:
                settle_call(pool_id=pool_id, workload_id=workload_id, request_id=request_id,
                            actual_input_tokens=0, actual_output_tokens=0, pool_called=False).run(client)
            client.zrem(budget_keys.pool_leases(pool_id), request_id)
            if data:
                record = RequestRecord.from_redis(data)
                usage_record_write(entry=ledger_entry(
                    record, status="lease_expired", total_ms=max(0, int(now_ms - record.admitted_ms)),
                    error="lease_expired"))
                client.delete(keys.request_record(request_id))
            reaped += 1
    return reaped
