"""The gateway's refusals and OpenAI's error shape, shared by both sides: the
web side answers them, the worker side stores them as a request's outcome.
``{"error": {"message", "type", "param", "code"}}``; the code is the
machine-readable reason."""

from __future__ import annotations

from budgets.errors import Rejected


def error_body(*, message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> Rejected:
    return Rejected(reason=code or "invalid_request", message=message, status=status, param=param,
                    error_type="invalid_request_error")


def budget_unavailable() -> Rejected:
    """Redis (the buckets, the queue, the results) did not answer in time."""
    return Rejected(reason="budget_unavailable", message="Sluice cannot reach its budget store right now; retry shortly.",
                    status=503, retry_after_ms=1000, error_type="service_unavailable")


def database_unavailable() -> Rejected:
    """PostgreSQL (keys this process cannot vouch for, jobs, batches) did not answer."""
    return Rejected(reason="database_unavailable", message="Sluice cannot reach its database right now; retry shortly.",
                    status=503, retry_after_ms=1000, error_type="service_unavailable")


def no_reservation(*, on_any_pool: bool = False) -> Rejected:
    where = "any pool" if on_any_pool else "its pool"
    return Rejected(reason="no_reservation", message=f"This workload has no budget on {where}.", status=403,
                    error_type="permission_error")


def queue_timeout(*, queue_timeout_s: float) -> Rejected:
    return Rejected(
        reason="queue_timeout",
        message=f"The request waited in its lane longer than this workload's queue timeout ({queue_timeout_s:g}s).",
        status=503,
        retry_after_ms=max(1000, int(queue_timeout_s * 1000)),
        error_type="service_unavailable",
    )


def worker_lost() -> Rejected:
    """The request's worker was lost mid-call and no other could take it over
    in time (gateway/core/request/claim.lua); the ledger says ``worker_lost``."""
    return Rejected(reason="worker_lost", message="The worker running this request was lost and no other could take "
                    "it over in time. Retry shortly.", status=503, retry_after_ms=1000,
                    error_type="service_unavailable")
