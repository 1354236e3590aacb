"""Token-bucket admission and settlement: typed calls of two Lua scripts
(``admit.lua``, ``settle.lua``) that run atomically inside Redis on Redis's
own clock. Each call is built once (``admit_call``, ``settle_call``) and run
by a sync caller (``.run()``) or an async one (``await .run_async()``).

The buckets' rates and capacities live in Redis too (``pool_config.py``),
written from the Django models whenever a pool or reservation changes and
re-pushed periodically, so every gateway process admits against the same
numbers within moments of an edit, without a restart."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.admission import keys
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.errors import RateLimitSnapshot, Rejected

# Both keep the pool's protected sum (protected_sum.lua, a shared library).
ADMIT = LuaScript(__package__, "admit.lua", library="protected_sum.lua")
SETTLE = LuaScript(__package__, "settle.lua", library="protected_sum.lua")

REASON_MESSAGES = {
    "workload_tpm": "This workload's tokens-per-minute budget is used up.",
    "workload_rpm": "This workload's requests-per-minute budget is used up.",
    "pool_tpm": "The pool has no free token capacity beyond this workload's reservation right now.",
    "pool_rpm": "The pool has no free request capacity beyond this workload's reservation right now.",
    "pool_input_tpm": "The pool's input tokens-per-minute budget is used up.",
    "pool_output_tpm": "The pool's output tokens-per-minute budget is used up.",
    "pool_saturated": "The pool is at its in-flight request limit.",
    "provider_tpm": "The provider reported its tokens-per-minute limit used up; retry after its reset.",
    "provider_rpm": "The provider reported its requests-per-minute limit used up; retry after its reset.",
    "workload_concurrency": "This workload is at its in-flight request limit.",
    "spend_budget": "This month's spend budget is used up; it renews at the start of next month.",
    "overflow_spend_budget": "This month's overflow spend cap is used up; the workload's own slices still serve "
                             "it, and the cap renews at the start of next month.",
    "pool_backoff": "The pool asked us to back off; sheddable and borrowed work waits until it recovers.",
    "pool_unavailable": "The inference pool of this workload is not answering; retry after its next health probe.",
    "request_too_large": "This request is larger than the workload's budget can ever admit at once; lower max_tokens or the prompt.",
}


@dataclass(frozen=True)
class Admission:
    request_id: str
    pool_id: int
    workload_id: int
    input_tokens: int
    output_tokens: int
    borrowed: bool
    rate_limits: RateLimitSnapshot
    admitted_ms: float  # Redis's clock: deadlines are measured on it too
    # YYYY-MM of the tenant's month-to-date its estimated cost is held against
    # ('' when it has no price): settlement corrects that month (spend_holds.py).
    spend_month: str = ""
    # Held outside its lane until the provider has room for it (admit.lua:
    # the pool's circuit is open, or its body was held before).
    held: bool = False


@dataclass(frozen=True)
class Settlement:
    settled: bool  # False: already settled (a replay) or never admitted
    estimated_tokens: int = 0
    borrowed: bool = False


class NotConfigured(Exception):
    """What a script needs is missing from Redis (fresh, flushed, a new month):
    the pool's bucket config, or a tenant's spend caps or month-to-date. The
    caller rebuilds it from the database and calls again."""


def _snapshot(raw, first: int) -> RateLimitSnapshot:
    remaining_tokens, remaining_requests, tokens_reset_ms, requests_reset_ms = raw[first:first + 4]
    return RateLimitSnapshot(
        remaining_tokens=max(0, int(float(remaining_tokens))),
        remaining_requests=max(0, int(float(remaining_requests))),
        tokens_reset_ms=max(0, int(float(tokens_reset_ms))),
        requests_reset_ms=max(0, int(float(requests_reset_ms))),
    )


def _lease_keys(*, pool_id: int, workload_id: int, request_id: str) -> list[str]:
    """What admission debits and settlement undoes, in the order both scripts
    name them (after the config hash, and for admit.lua the workload set)."""
    return [
        keys.pool_buckets(pool_id),
        keys.pool_leases(pool_id),
        keys.workload_leases(pool_id, workload_id),
        keys.lease(pool_id, request_id),
        keys.pool_counters(pool_id),
        keys.pool_capacity(pool_id),
        keys.pool_protected_sum(pool_id),
        keys.pool_protected_fill(pool_id),
    ]


def admit_call(*, pool_id: int, workload_id: int, request_id: str, input_tokens: int, output_tokens: int,
               lease_ttl_ms: int, body_digest: str = "") -> ScriptCall[Admission]:
    """Admit or raise Rejected (NotConfigured when Redis lost the pool's
    config); one atomic Redis round trip. Spend caps are a separate step on
    the tenant's keys (spend_holds.py). ``body_digest``: the request body's
    (gateway/core/request/chat.py), so a client's retry of a held request is held too."""

    def parse(raw) -> Admission:
        status = int(raw[0])
        if status == -1:
            raise NotConfigured(raw[1])
        if status in (1, 2):
            return Admission(request_id=request_id, pool_id=pool_id, workload_id=workload_id,
                             input_tokens=input_tokens, output_tokens=output_tokens, borrowed=bool(int(raw[1])),
                             rate_limits=_snapshot(raw, 2), admitted_ms=float(raw[6]),
                             held=len(raw) > 7 and raw[7] == "1")
        reason = raw[1]
        wait_ms = int(float(raw[2]))
        too_large = reason == "request_too_large"
        # A pool that does not answer is not a budget the caller used up.
        unavailable = reason == "pool_unavailable"
        raise Rejected(
            reason=reason,
            message=REASON_MESSAGES.get(reason, reason),
            status=413 if too_large else 503 if unavailable else 429,
            retry_after_ms=None if wait_ms < 0 else max(1, wait_ms),
            error_type=("invalid_request_error" if too_large else "service_unavailable" if unavailable
                        else "rate_limit_error"),
            rate_limits=_snapshot(raw, 3),
            estimated_tokens=input_tokens + output_tokens,
        )

    return ScriptCall(
        script=ADMIT,
        keys=[keys.pool_config(pool_id), keys.pool_workloads(pool_id),
              *_lease_keys(pool_id=pool_id, workload_id=workload_id, request_id=request_id),
              keys.held_body(pool_id, workload_id, body_digest or "-")],
        args=[workload_id, request_id, input_tokens, output_tokens, lease_ttl_ms, "1" if body_digest else "0",
              int(settings.SLUICE_HELD_PACE_S * 1000)],
        parse=parse,
    )


def _settlement(raw) -> Settlement:
    if int(raw[0]) == 0:
        return Settlement(settled=False)
    return Settlement(settled=True, estimated_tokens=int(raw[2]) + int(raw[3]), borrowed=bool(int(raw[4])))


def settle_call(*, pool_id: int, workload_id: int, request_id: str, actual_input_tokens: int,
                actual_output_tokens: int, pool_called: bool = True) -> ScriptCall[Settlement]:
    """Refund or charge the estimate's difference from actual usage and
    release the lease. Safe to run again: the second run changes nothing.
    (Spend: spend_holds.spend_settle_call.)"""
    return ScriptCall(
        script=SETTLE,
        keys=[keys.pool_config(pool_id), *_lease_keys(pool_id=pool_id, workload_id=workload_id, request_id=request_id)],
        args=[request_id, actual_input_tokens, actual_output_tokens, 0 if pool_called else 1],
        parse=_settlement,
    )


def lease_give_back_call(*, pool_id: int, workload_id: int, request_id: str) -> ScriptCall[Settlement]:
    """Give an admission's lease back whole: the pool was never called with
    it (its spend refused, or routing moved the request to another pool)."""
    return settle_call(pool_id=pool_id, workload_id=workload_id, request_id=request_id, actual_input_tokens=0,
                       actual_output_tokens=0, pool_called=False)


def admit(**kwargs) -> Admission:
    """``admit_call(...).run()``: for synchronous callers and tests."""
    return admit_call(**kwargs).run()


def settle(**kwargs) -> Settlement:
    """``settle_call(...).run()``: for synchronous callers and tests."""
    return settle_call(**kwargs).run()
