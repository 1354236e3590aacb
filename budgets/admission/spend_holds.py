"""Spend caps at the door, across every pool of a tenant: typed calls of
three Lua scripts on the tenant's own keys (hash tag ``{tenant:<id>}``).

A tenant's workloads may sit on several pools, so its month-to-date spend
cannot live beside one pool's buckets: admission is two atomic steps,

1. ``spend_hold_call`` (spend_hold.lua): check the request's estimated cost
   against the tenant's and the workload's hard caps and add it to their
   month-to-date, holding it under the request id;
2. the pool's admission (buckets.admit_call);

and when step 2 refuses, ``spend_settle_call(forget=True)`` takes the hold
back (gateway/core/request/admission.py runs the steps). Month-to-date may briefly
hold an estimate the pool then refuses, never less than what was admitted, so
the cap is never passed. A process that dies between the steps leaves one
estimate held; the hold expires a little after the lease would have, and
reconciliation (spend_reconcile.lua) drops it.

Settlement (``spend_settle_call``) corrects the hold to the actual cost once,
idempotent on the request id. Amounts are integers in micro-units of the price
table's currency (1.25 USD = 1_250_000)."""

from __future__ import annotations

from dataclasses import dataclass

from budgets.admission import keys
from budgets.admission.buckets import REASON_MESSAGES, NotConfigured
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.errors import Rejected

SPEND_HOLD = LuaScript(__package__, "spend_hold.lua")
SPEND_SETTLE = LuaScript(__package__, "spend_settle.lua")
SPEND_RECONCILE = LuaScript(__package__, "spend_reconcile.lua")

# A hold outlives its request's lease by this much, so the lease reaper
# (which settles it) normally goes first and reconciliation drops only holds
# nobody will ever settle.
HOLD_GRACE_MS = 120_000
# How long a settled hold waits for reconciliation to find its ledger row. Far
# above the gap between settlement and the ledger write (milliseconds; minutes
# while the database is away and the worker's task retries).
SETTLED_RETENTION_MS = 3_600_000


@dataclass(frozen=True)
class SpendHold:
    """A request's expected cost, held against its tenant's month-to-date."""

    tenant_id: int
    workload_id: int
    cost_micro: int  # > 0: a request without a price is not held
    month: str  # YYYY-MM (UTC) of the month-to-date it is held against
    month_end_ms: float
    # Admitted on an overflow slice: it also counts against the workload's
    # overflow cap (field O<workload id>).
    overflow: bool = False


def spend_hold_call(hold: SpendHold, *, request_id: str, lease_ttl_ms: int, estimated_tokens: int = 0) -> ScriptCall[bool]:
    """Hold the estimate or raise Rejected(spend_budget); NotConfigured when
    the tenant's caps or month-to-date are missing from Redis. True when held
    now, False for a replay of a request already held."""

    def parse(raw) -> bool:
        status = int(raw[0])
        if status == -1:
            raise NotConfigured(raw[1])
        if status == 0:
            raise Rejected(reason=raw[1], message=REASON_MESSAGES[raw[1]], status=429,
                           retry_after_ms=max(1, int(float(raw[2]))), error_type="rate_limit_error",
                           estimated_tokens=estimated_tokens)
        return status == 1

    return ScriptCall(
        script=SPEND_HOLD,
        keys=[keys.tenant_spend_caps(hold.tenant_id), keys.tenant_spend_month(hold.tenant_id, hold.month),
              keys.tenant_spend_holds(hold.tenant_id)],
        args=[hold.tenant_id, hold.workload_id, request_id, hold.cost_micro, hold.month,
              lease_ttl_ms + HOLD_GRACE_MS, int(hold.month_end_ms), 1 if hold.overflow else 0],
        parse=parse,
    )


def spend_settle_call(*, tenant_id: int, month: str, request_id: str, actual_cost_micro: int = 0,
                      forget: bool = False) -> ScriptCall[bool]:
    """Correct the request's held estimate to ``actual_cost_micro`` (or, with
    ``forget``, take it back: the pool refused the request). True when it
    changed month-to-date now; a replay changes nothing and returns False."""
    return ScriptCall(
        script=SPEND_SETTLE,
        keys=[keys.tenant_spend_holds(tenant_id), keys.tenant_spend_month(tenant_id, month)],
        args=[tenant_id, request_id, max(0, int(actual_cost_micro)), 1 if forget else 0, month, SETTLED_RETENTION_MS],
        parse=lambda raw: int(raw[0]) == 1,
    )


@dataclass(frozen=True)
class SpendReconciled:
    fields: int  # month-to-date fields written
    holds_counted: int  # in flight, or settled and not yet in the ledger
    holds_dropped: int  # confirmed by the ledger, or expired


def spend_reconcile_call(*, tenant_id: int, month: str, caps_micro: dict[str, int], ledger_micro: dict[str, int],
                         in_ledger: list[str]) -> ScriptCall[SpendReconciled]:
    """The tenant's caps := ``caps_micro``; its month-to-date of ``month`` :=
    ``ledger_micro`` (the ledger's sums by field) + the holds of the month
    whose request ids are not in ``in_ledger``."""
    cap_pairs = [part for field, micro in sorted(caps_micro.items()) for part in (field, int(micro))]
    ledger_pairs = [part for field, micro in sorted(ledger_micro.items()) for part in (field, int(micro))]
    return ScriptCall(
        script=SPEND_RECONCILE,
        keys=[keys.tenant_spend_caps(tenant_id), keys.tenant_spend_month(tenant_id, month),
              keys.tenant_spend_holds(tenant_id)],
        args=[tenant_id, month, len(caps_micro), len(ledger_micro), *cap_pairs, *ledger_pairs, *in_ledger],
        parse=lambda raw: SpendReconciled(fields=int(raw[0]), holds_counted=int(raw[1]), holds_dropped=int(raw[2])),
    )
