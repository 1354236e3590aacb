"""The end of a request, whoever reaches it: the worker that ran it, or the
process that took it over from a lost worker (the waiting web process, the
reaper: gateway/core/request/takeover.py). Settle the buckets, write the ledger row,
publish the outcome; each step is idempotent on the request id, so a replay
(a redelivered task, a late worker, a second taker) changes nothing.

A delivery's own answer is settled and published in the round trip that
stores it (gateway/worker/execution.py ``_answer_keep_settled``), a stream's
end marker just after, so its caller does not wait for the ledger row: the
row follows, written by the same worker, or by whoever finishes the request
if that worker is lost first (claim.lua's reaper does not stop at the
published marker)."""

from __future__ import annotations

import time
from collections.abc import Callable

from budgets.redis.clients import redis_now_ms
from budgets.redis.composition import RoundTrip, Step
from budgets.redis.scripts import ScriptCall
from budgets.ledger.writer import usage_record_write
from gateway.core.db_threads import on_database
from gateway.core.jobs.lifecycle import job_complete
from gateway.core.metrics import departure_call
from gateway.core.observability import settlement_report
from gateway.core.request.records import Outcome, RequestRecord, ledger_entry, publish_call
from gateway.core.request.settlement import request_settle
from gateway.core.request.streams import stream_end


def finish_steps(*, record: RequestRecord, outcome: Outcome, pool_called: bool,
                 now_ms: float | None = None, together: bool = False,
                 settled: bool = False, published: bool = False) -> list[tuple[str, Callable[[], object]]]:
    """Settle the buckets and the spend, write the ledger row, publish the
    outcome, finish the job. Each step is idempotent on the request id, and
    built lazily so a failed request's settlement (request_fail in
    gateway/worker/execution.py) can run each one on its own. ``now_ms``:
    the Redis clock now, when the caller knows it (read here otherwise).
    ``together``: the departure and the publish as one step, in one round
    trip (``RoundTrip``); a failed request keeps them apart,
    so each runs even if the other fails. ``settled``: the buckets and the
    spend were settled on this outcome already, in the round trip that
    stored it (gateway/worker/execution.py ``_answer_keep_settled``).
    ``published``: and published in that round trip too (a delivery's own
    answer), a stream's end marker just after it: the departure goes alone."""
    total_ms = max(0, int((redis_now_ms() if now_ms is None else now_ms) - record.admitted_ms))
    written = {"s": 0.0}

    def ledger() -> None:
        writing = time.monotonic()
        on_database(usage_record_write, entry=ledger_entry(
            record, status=outcome.status, actual_input_tokens=outcome.input_tokens,
            actual_output_tokens=outcome.output_tokens, queue_wait_ms=outcome.queue_wait_ms,
            upstream_ms=outcome.upstream_ms, total_ms=total_ms, ttft_ms=outcome.ttft_ms, attempts=outcome.attempts,
            error=outcome.ledger_error,
            usage_source=outcome.usage_source or ("pool" if outcome.input_tokens or outcome.output_tokens else ""),
            completion_id=outcome.answer_id,
        ))
        written["s"] = time.monotonic() - writing

    def departure_call_() -> ScriptCall[bool]:
        return departure_call(pool_id=record.pool_id, lane=record.lane, request_id=record.request_id,
                              time_in_system_ms=total_ms, upstream_429s=outcome.upstream_429s,
                              output_tokens=outcome.output_tokens)

    def departed(first: bool) -> None:
        if first:
            # Reported by the first finish only: a redelivery replaying it counts nothing twice.
            settlement_report(record=record, outcome=outcome, pool_called=pool_called, total_ms=total_ms,
                              ledger_lag_s=total_ms / 1000 + written["s"])

    def departure_and_publish() -> None:
        answers = RoundTrip(Step("departure", departure_call_()), Step("publish", publish_call(record, outcome))).run()
        departed(answers["departure"])

    steps: list[tuple[str, Callable[[], object]]] = [] if settled else [
        ("settle", lambda: request_settle(record=record, input_tokens=outcome.input_tokens,
                                          output_tokens=outcome.output_tokens, pool_called=pool_called)),
    ]
    steps.append(("ledger", ledger))
    if published:
        steps.append(("departure", lambda: departed(departure_call_().run())))
    elif together:
        steps.append(("departure+publish", departure_and_publish))
    else:
        steps += [("departure", lambda: departed(departure_call_().run())),
                  ("publish", lambda: publish_call(record, outcome).run())]
    if record.stream and not published:
        # After the publish: the web process relaying the stream wakes on it
        # and ends the caller's stream with the published outcome. (One
        # published with its settlement had its end marker then too.)
        steps.append(("stream_end", lambda: stream_end(request_id=record.request_id, wake=record.stream_wake)))
    if record.job_id:
        steps.append(("job", lambda: on_database(job_complete, job_id=record.job_id, outcome=outcome)))
    return steps


def request_finish(*, record: RequestRecord, outcome: Outcome, pool_called: bool,
                   now_ms: float | None = None, settled: bool = False, published: bool = False) -> None:
    """Settle the buckets and the spend (unless ``settled``: done already on
    this outcome), write the ledger row, publish the outcome (unless
    ``published``: done with the settlement). Each step is idempotent on the
    request id, so a replay changes nothing."""
    for _, step in finish_steps(record=record, outcome=outcome, pool_called=pool_called, now_ms=now_ms,
                                together=True, settled=settled, published=published):
        step()
