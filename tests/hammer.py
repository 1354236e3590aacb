"""Child-process side of the concurrency tests: many threads calling the real
admission script at once. Spawned processes set Django up themselves."""

from __future__ import annotations

import os
import threading
import uuid


def admit_many(args: tuple) -> list[tuple[int, int, bool]]:
    """Run ``threads`` threads, each trying ``attempts`` admissions of
    ``tokens`` output tokens for each workload in ``workload_ids`` in turn.
    Returns (workload id, tokens, admitted) per attempt."""
    pool_id, workload_ids, tokens, threads, attempts, barrier_at = args
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
    import django

    django.setup()
    import time

    from budgets.admission.buckets import admit
    from budgets.errors import Rejected

    results: list[tuple[int, int, bool]] = []
    lock = threading.Lock()
    # Start together: every process waits for the same wall-clock instant.
    time.sleep(max(0.0, barrier_at - time.time()))

    def run(offset: int) -> None:
        local = []
        for i in range(attempts):
            wid = workload_ids[(offset + i) % len(workload_ids)]
            try:
                admit(pool_id=pool_id, workload_id=wid, request_id=uuid.uuid4().hex, input_tokens=0,
                      output_tokens=tokens, lease_ttl_ms=600_000)
                local.append((wid, tokens, True))
            except Rejected:
                local.append((wid, tokens, False))
        with lock:
            results.extend(local)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


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
    import time

    from budgets.admission.estimation import Estimate
    from budgets.errors import Rejected
    from gateway.core.admission import request_admit

    contexts = pickle.loads(pickled_contexts)
    estimate = Estimate(input_tokens=input_tokens, output_tokens=output_tokens, max_tokens_requested=output_tokens,
                        clamped=False)
    results: list[tuple[int, bool, str]] = []
    lock = threading.Lock()
    time.sleep(max(0.0, barrier_at - time.time()))

    def run(offset: int) -> None:
        local = []
        for i in range(attempts):
            ctx = contexts[(offset + i) % len(contexts)]
            try:
                request_admit(ctx, request_id=uuid.uuid4().hex, model=model, estimate=estimate, lease_ms=600_000)
                local.append((ctx.workload_id, True, ""))
            except Rejected as rejected:
                local.append((ctx.workload_id, False, rejected.reason))
        with lock:
            results.extend(local)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results
