"""Token-bucket admission and settlement: thin typed wrappers around two Lua
scripts (``admit.lua``, ``settle.lua``) that run atomically inside Redis on
Redis's own clock.

The buckets' rates and capacities live in Redis too (``pool_config_push``),
written from the Django models whenever a pool or reservation changes and
re-pushed periodically, so every gateway process admits against the same
numbers within moments of an edit, without a restart."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import redis

from . import keys
from .errors import BudgetUnavailable, Rejected
from .redis_client import get_async_redis, get_redis, lua_script

_ADMIT_SRC = importlib.resources.files(__package__).joinpath("admit.lua").read_text()
_SETTLE_SRC = importlib.resources.files(__package__).joinpath("settle.lua").read_text()

REASON_MESSAGES = {
    "workload_tpm": "This workload's tokens-per-minute budget is used up.",
    "workload_rpm": "This workload's requests-per-minute budget is used up.",
    "pool_tpm": "The pool has no free token capacity beyond this workload's reservation right now.",
    "pool_rpm": "The pool has no free request capacity beyond this workload's reservation right now.",
    "pool_input_tpm": "The pool's input tokens-per-minute budget is used up.",
    "pool_output_tpm": "The pool's output tokens-per-minute budget is used up.",
    "pool_saturated": "The pool is at its in-flight request limit.",
    "workload_concurrency": "This workload is at its in-flight request limit.",
    "spend_budget": "This month's spend budget is used up; it renews at the start of next month.",
    "pool_backoff": "The pool asked us to back off; sheddable and borrowed work waits until it recovers.",
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
    remaining_tokens: int
    remaining_requests: int
    tokens_reset_ms: int
    requests_reset_ms: int
    admitted_ms: float  # Redis's clock: deadlines are measured on it too


@dataclass(frozen=True)
class Settlement:
    settled: bool  # False: already settled (a replay) or never admitted
    estimated_tokens: int = 0
    borrowed: bool = False


def _admit_keys(pool_id: int, workload_id: int, request_id: str, spend: SpendCharge) -> list[str]:
    return [
        keys.pool_config(pool_id),
        keys.pool_workloads(pool_id),
        keys.pool_buckets(pool_id),
        keys.pool_leases(pool_id),
        keys.workload_leases(pool_id, workload_id),
        keys.lease(pool_id, request_id),
        keys.pool_counters(pool_id),
        keys.pool_capacity(pool_id),
        spend.month_key if spend.cost_micro > 0 else "",
    ]


def _admit_args(workload_id: int, request_id: str, input_tokens: int, output_tokens: int, lease_ttl_ms: int,
                spend: SpendCharge) -> list:
    return [workload_id, request_id, input_tokens, output_tokens, lease_ttl_ms, spend.cost_micro, spend.tenant_id,
            spend.month_end_ms]


def _settle_keys(pool_id: int, workload_id: int, request_id: str, spend_month_key: str) -> list[str]:
    return [
        keys.pool_config(pool_id),
        keys.pool_buckets(pool_id),
        keys.pool_leases(pool_id),
        keys.workload_leases(pool_id, workload_id),
        keys.lease(pool_id, request_id),
        keys.pool_counters(pool_id),
        keys.pool_capacity(pool_id),
        spend_month_key,
    ]


@dataclass(frozen=True)
class SpendCharge:
    """What a request is expected to cost, for the month-to-date spend caps."""

    tenant_id: int
    cost_micro: int  # currency x 1,000,000
    month_key: str  # budgets.spend.spend_month_key of the admission's month
    month_end_ms: float


NO_SPEND = SpendCharge(tenant_id=0, cost_micro=0, month_key="", month_end_ms=0)


class NotConfigured(Exception):
    """The pool's bucket config is missing from Redis (fresh or flushed)."""


def _admission_result(raw, *, pool_id: int, workload_id: int, request_id: str, input_tokens: int, output_tokens: int) -> Admission:
    status = int(raw[0])
    if status == -1:
        raise NotConfigured(raw[1])
    if status in (1, 2):
        return Admission(
            request_id=request_id,
            pool_id=pool_id,
            workload_id=workload_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            borrowed=bool(int(raw[1])),
            remaining_tokens=int(float(raw[2])),
            remaining_requests=int(float(raw[3])),
            tokens_reset_ms=max(0, int(float(raw[4]))),
            requests_reset_ms=max(0, int(float(raw[5]))),
            admitted_ms=float(raw[6]),
        )
    reason = raw[1]
    wait_ms = int(float(raw[2]))
    rejected = Rejected(
        reason=reason,
        message=REASON_MESSAGES.get(reason, reason),
        status=413 if reason == "request_too_large" else 429,
        retry_after_ms=None if wait_ms < 0 else max(1, wait_ms),
        error_type="invalid_request_error" if reason == "request_too_large" else "rate_limit_error",
    )
    rejected.remaining_tokens = max(0, int(float(raw[3])))  # type: ignore[attr-defined]
    rejected.remaining_requests = max(0, int(float(raw[4])))  # type: ignore[attr-defined]
    rejected.tokens_reset_ms = max(0, int(float(raw[5])))  # type: ignore[attr-defined]
    rejected.requests_reset_ms = max(0, int(float(raw[6])))  # type: ignore[attr-defined]
    raise rejected


def admit(*, pool_id: int, workload_id: int, request_id: str, input_tokens: int, output_tokens: int, lease_ttl_ms: int,
          spend: SpendCharge = NO_SPEND) -> Admission:
    """Admit or raise Rejected; one atomic Redis round trip."""
    client = get_redis()
    args = _admit_args(workload_id, request_id, input_tokens, output_tokens, lease_ttl_ms, spend)
    try:
        raw = lua_script(client, _ADMIT_SRC)(keys=_admit_keys(pool_id, workload_id, request_id, spend), args=args)
    except redis.exceptions.ConnectionError as exc:  # includes timeouts
        raise BudgetUnavailable(str(exc)) from exc
    return _admission_result(raw, pool_id=pool_id, workload_id=workload_id, request_id=request_id,
                             input_tokens=input_tokens, output_tokens=output_tokens)


async def admit_async(*, pool_id: int, workload_id: int, request_id: str, input_tokens: int, output_tokens: int,
                      lease_ttl_ms: int, spend: SpendCharge = NO_SPEND) -> Admission:
    client = get_async_redis()
    args = _admit_args(workload_id, request_id, input_tokens, output_tokens, lease_ttl_ms, spend)
    try:
        raw = await lua_script(client, _ADMIT_SRC)(keys=_admit_keys(pool_id, workload_id, request_id, spend), args=args)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise BudgetUnavailable(str(exc)) from exc
    return _admission_result(raw, pool_id=pool_id, workload_id=workload_id, request_id=request_id,
                             input_tokens=input_tokens, output_tokens=output_tokens)


def _settlement_result(raw) -> Settlement:
    if int(raw[0]) == 0:
        return Settlement(settled=False)
    return Settlement(settled=True, estimated_tokens=int(raw[2]) + int(raw[3]), borrowed=bool(int(raw[4])))


def settle(*, pool_id: int, workload_id: int, request_id: str, actual_input_tokens: int, actual_output_tokens: int,
           pool_called: bool = True, actual_cost_micro: int = 0, spend_month_key: str = "") -> Settlement:
    """Refund or charge the estimate's difference from actual usage (tokens and
    spend) and release the lease. Safe to call again: the second call changes
    nothing."""
    client = get_redis()
    raw = lua_script(client, _SETTLE_SRC)(
        keys=_settle_keys(pool_id, workload_id, request_id, spend_month_key),
        args=[request_id, actual_input_tokens, actual_output_tokens, 0 if pool_called else 1, actual_cost_micro],
    )
    return _settlement_result(raw)


async def settle_async(*, pool_id: int, workload_id: int, request_id: str, actual_input_tokens: int,
                       actual_output_tokens: int, pool_called: bool = True, actual_cost_micro: int = 0,
                       spend_month_key: str = "") -> Settlement:
    client = get_async_redis()
    raw = await lua_script(client, _SETTLE_SRC)(
        keys=_settle_keys(pool_id, workload_id, request_id, spend_month_key),
        args=[request_id, actual_input_tokens, actual_output_tokens, 0 if pool_called else 1, actual_cost_micro],
    )
    return _settlement_result(raw)
