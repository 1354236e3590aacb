"""A request's settlement, as both sides run it: correct the pool's buckets to
the tokens it used (or refund them: it never reached the pool) and its
tenant's month-to-date to what it cost, then the caller writes the ledger
row. Two atomic steps on two hash tags (the pool's, the tenant's), each
idempotent on the request id, so a replay after a crash between them
finishes the second and changes nothing else. Both go in one round trip
(``RoundTrip``). The spend step runs before the ledger row is written:
reconciliation counts on that order (budgets/admission/spend_reconcile.lua)."""

from __future__ import annotations

from budgets.admission.buckets import Settlement, settle_call
from budgets.admission.spend_holds import spend_settle_call
from budgets.redis.composition import Condition, Plan, RoundTrip, Step, answered, plan_run, plan_run_async
from gateway.core.request.records import RequestRecord


# Both settlement steps answer {0} (settled before: a replay) or {1, ...}
# (settled now): a step that must follow a settlement step whenever it ran
# waits for one of these.
SETTLED = ("0", "1")


def settlement_steps(record: RequestRecord, *, input_tokens: int, output_tokens: int, pool_called: bool,
                     only_if: Condition | None = None) -> tuple[Step, ...]:
    """``settle`` (the pool's buckets; its answer is the ``Settlement``) and,
    when the request holds spend, ``spend_settle`` after it whenever it ran.
    ``only_if``: the condition of the first step, in a longer round trip."""
    steps = [Step("settle", settle_call(
        pool_id=record.pool_id, workload_id=record.workload_id, request_id=record.request_id,
        actual_input_tokens=input_tokens, actual_output_tokens=output_tokens, pool_called=pool_called),
        only_if=only_if)]
    if record.spend_month:
        steps.append(Step("spend_settle", spend_settle_call(
            tenant_id=record.tenant_id, month=record.spend_month, request_id=record.request_id,
            actual_cost_micro=record.actual_cost_micro(input_tokens=input_tokens, output_tokens=output_tokens)),
            only_if=answered("settle", *SETTLED)))
    return tuple(steps)


def settlement_plan(record: RequestRecord, *, input_tokens: int, output_tokens: int,
                    pool_called: bool) -> Plan[Settlement]:
    """The pool's step, then the spend's, in one round trip."""
    answers = yield RoundTrip(*settlement_steps(record, input_tokens=input_tokens, output_tokens=output_tokens,
                                                pool_called=pool_called))
    return answers["settle"]


def request_settle(*, record: RequestRecord, input_tokens: int, output_tokens: int, pool_called: bool,
                   client=None) -> Settlement:
    return plan_run(settlement_plan(record, input_tokens=input_tokens, output_tokens=output_tokens,
                                    pool_called=pool_called), client)


def request_refund(record: RequestRecord) -> Settlement:
    """Settle a request that never reached the pool: everything back."""
    return request_settle(record=record, input_tokens=0, output_tokens=0, pool_called=False)


async def request_refund_async(record: RequestRecord) -> Settlement:
    """``request_refund`` for the async web side."""
    return await plan_run_async(settlement_plan(record, input_tokens=0, output_tokens=0, pool_called=False))
