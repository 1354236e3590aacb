"""The end of a request, whoever reaches it: the worker that ran it, or the
process that took it over from a lost worker (the waiting web process, the
reaper: gateway/core/takeover.py). Settle the buckets, write the ledger row,
publish the outcome; each step is idempotent on the request id, so a replay
(a redelivered task, a late worker, a second taker) changes nothing."""

from __future__ import annotations

from budgets.admission.buckets import settle_call
from budgets.admission.redis_client import redis_now_ms
from budgets.ledger.writer import usage_record_write
from gateway.core.jobs import job_complete
from gateway.core.metrics import departure_record
from gateway.core.records import Outcome, RequestRecord, ledger_entry, publish_call


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
