"""A request's settlement, as both sides run it: correct the pool's buckets to
the tokens it used (or refund them: it never reached the pool) and its
tenant's month-to-date to what it cost, then the caller writes the ledger
row. Two atomic steps on two hash tags (the pool's, the tenant's), each
idempotent on the request id, so a replay after a crash between them
finishes the second and changes nothing else. On a single Redis both go in
one round trip (``Together``). The spend step runs before the
ledger row is written: reconciliation counts on that order
(budgets/admission/spend_reconcile.lua)."""

from __future__ import annotations

from budgets.admission.buckets import Settlement, settle_call
from budgets.admission.redis_client import Plan, ScriptCall, Together, plan_run, plan_run_async
from budgets.admission.spend_holds import spend_settle_call
from gateway.core.records import RequestRecord


# In a guarded composition (``Together``'s guards), the spend's step runs
# after the pool's whenever the pool's step ran, whatever it answered: {1, ...}
# settled now, {0} settled before (a replay finishing the spend's step).
SPEND_AFTER_POOL_GUARD = "0,1"
# A step composed after the whole settlement runs whenever its last step ran:
# the pool's and the spend's both answer {0} or {1, ...}.
SETTLED_GUARD = "0,1"


def settlement_calls(record: RequestRecord, *, input_tokens: int, output_tokens: int,
                     pool_called: bool) -> tuple[ScriptCall, ...]:
    """The pool's step, and the spend's when the request holds spend: to run
    in this order (the first's result is the ``Settlement``)."""
    pool_step = settle_call(
        pool_id=record.pool_id, workload_id=record.workload_id, request_id=record.request_id,
        actual_input_tokens=input_tokens, actual_output_tokens=output_tokens, pool_called=pool_called)
    if not record.spend_month:
        return (pool_step,)
    return pool_step, spend_settle_call(
        tenant_id=record.tenant_id, month=record.spend_month, request_id=record.request_id,
        actual_cost_micro=record.actual_cost_micro(input_tokens=input_tokens, output_tokens=output_tokens))


def settlement_plan(record: RequestRecord, *, input_tokens: int, output_tokens: int,
                    pool_called: bool) -> Plan[Settlement]:
    """The pool's step, then the spend's: in one round trip on a single Redis
    (``Together``), one after the other on a cluster."""
    calls = settlement_calls(record, input_tokens=input_tokens, output_tokens=output_tokens, pool_called=pool_called)
    if len(calls) == 1:
        return (yield calls[0])
    settlement, _ = yield Together(calls)
    return settlement


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
