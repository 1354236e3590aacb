"""Child-process side of the concurrency tests: many threads calling the real
admission script at once. Spawned processes set Django up themselves."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable


def _hammer(*, threads: int, attempts: int, barrier_at: float, attempt: Callable[[int], tuple]) -> list[tuple]:
    """``threads`` threads each make ``attempts`` calls ``attempt(n)`` (n: the
    thread's offset plus the attempt's index), all starting at the same
    wall-clock instant; returns every result."""
    results: list[tuple] = []
    lock = threading.Lock()
    # Start together: every process waits for the same wall-clock instant.
    time.sleep(max(0.0, barrier_at - time.time()))

    def run(offset: int) -> None:
        local = [attempt(offset + i) for i in range(attempts)]
        with lock:
            results.extend(local)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def admit_many(args: tuple) -> list[tuple[int, int, bool]]:
    """Run ``threads`` threads, each trying ``attempts`` admissions of
    ``tokens`` output tokens for each workload in ``workload_ids`` in turn.
    Returns (workload id, tokens, admitted) per attempt."""
    pool_id, workload_ids, tokens, threads, attempts, barrier_at = args
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    import django

    django.setup()
    from budgets.admission.buckets import admit
    from budgets.errors import Rejected

    def attempt(n: int) -> tuple[int, int, bool]:
        wid = workload_ids[n % len(workload_ids)]
        try:
            admit(pool_id=pool_id, workload_id=wid, request_id=uuid.uuid4().hex, input_tokens=0,
                  output_tokens=tokens, lease_ttl_ms=600_000)
            return wid, tokens, True
        except Rejected:
            return wid, tokens, False

    return _hammer(threads=threads, attempts=attempts, barrier_at=barrier_at, attempt=attempt)


def request_admit_many(args: tuple) -> list[tuple[int, bool, str]]:
    """The gateway's two-step admission (spend hold, then the pool) from
    ``threads`` threads, each trying ``attempts`` requests over the pickled
    CallerContexts (one per workload; unpickled once Django is set up) in
    turn. Returns (workload id, admitted, refusal reason or '') per attempt."""
    pickled_contexts, model, input_tokens, output_tokens, threads, attempts, barrier_at = args
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    import django

    django.setup()
    import pickle

    from budgets.admission.estimation import Estimate
    from budgets.errors import Rejected
    from gateway.core.request.routing import request_route_admit

    contexts = pickle.loads(pickled_contexts)
    estimate = Estimate(input_tokens=input_tokens, output_tokens=output_tokens, max_tokens_requested=output_tokens,
                        clamped=False)

    def attempt(n: int) -> tuple[int, bool, str]:
        ctx = contexts[n % len(contexts)]
        try:
            request_route_admit(ctx.route(model), request_id=uuid.uuid4().hex, model=model, lease_ms=600_000,
                                estimate_for=lambda _on_pool: estimate)
            return ctx.workload_id, True, ""
        except Rejected as rejected:
            return ctx.workload_id, False, rejected.reason

    return _hammer(threads=threads, attempts=attempts, barrier_at=barrier_at, attempt=attempt)


def slots_take_many(args: tuple) -> list[tuple[str, bool]]:
    """``threads`` threads, each trying ``attempts`` times to take one of a
    lane's pool-call slots (gateway/core/protection/slot_acquire.lua) under a fresh
    holder id. Returns (holder, taken) per attempt."""
    pool_id, lane, threads, attempts, barrier_at = args
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    import django

    django.setup()
    from gateway.core.protection.concurrency import slot_acquire_call

    def attempt(n: int) -> tuple[str, bool]:
        holder = uuid.uuid4().hex
        return holder, slot_acquire_call(pool_id=pool_id, lane=lane, holder=holder, lease_ms=600_000).run().taken

    return _hammer(threads=threads, attempts=attempts, barrier_at=barrier_at, attempt=attempt)
