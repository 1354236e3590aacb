"""Redis keys of one request's trip through a lane."""


def request_record(request_id: str) -> str:
    """Hash: everything the worker needs (the task itself carries only the id)."""
    return f"sluice:req:{request_id}"


def request_owner(request_id: str) -> str:
    """String: who owns the request's outcome: 'worker', 'gaveup' or 'expired'."""
    return f"sluice:req:{request_id}:owner"


def request_response(request_id: str) -> str:
    """String: the pool's answer, kept so a redelivered task never calls twice."""
    return f"sluice:req:{request_id}:response"


def request_result(request_id: str) -> str:
    """List: the outcome, pushed once for the waiting web process to pop."""
    return f"sluice:req:{request_id}:result"


DELAYED_JOBS = "sluice:jobs:delayed"
"""Sorted set: ids of jobs waiting for budget, scored by release time (ms)."""


def idempotency(workload_id: int, key: str) -> str:
    """Hash: a sync request's Idempotency-Key: body digest, state, stored response."""
    return f"sluice:idem:{workload_id}:{key}"
