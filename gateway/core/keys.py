"""The gateway's Redis keys, in one place: a request's trip through its lane,
the lanes' own counters, retry budgets, pacing, idempotency. Per-pool keys
carry the pool's hash tag (budgets.admission.keys.pool_tag) so a script that
touches them and the pool's buckets stays on one Redis Cluster shard."""

from __future__ import annotations

from budgets.admission.keys import pool_tag

# --- one request --------------------------------------------------------------------
# A request's own keys share its hash tag ``{<request id>}``: request/claim.lua and
# request/publish.lua touch several of them at once, never a pool's keys (the pool's
# lease and buckets are settled by budgets/admission/settle.lua on the pool's
# shard, and every finishing step is idempotent on its own). Tagged by the
# request rather than the pool, they spread over the cluster, and a worker
# that has only the id from its Celery message can name them.


def request_tag(request_id: str) -> str:
    return f"sluice:req:{{{request_id}}}"


def request_record(request_id: str) -> str:
    """Hash: everything the worker needs (the task itself carries only the id)."""
    return request_tag(request_id)


def request_owner(request_id: str) -> str:
    """String: who owns the request's outcome (request/claim.lua lists the states)."""
    return f"{request_tag(request_id)}:owner"


def request_heartbeat(request_id: str) -> str:
    """String ``<generation>|<worker>``, expiring within seconds unless the
    worker running that delivery renews it (gateway/worker/heartbeat.py)."""
    return f"{request_tag(request_id)}:hb"


def request_response(request_id: str) -> str:
    """String: the pool's answer, kept so a redelivered task never calls twice."""
    return f"{request_tag(request_id)}:response"


def request_result(request_id: str) -> str:
    """List: the outcome, pushed once for the waiting web process to pop."""
    return f"{request_tag(request_id)}:result"


def request_result_published(request_id: str) -> str:
    """String: set when the outcome was pushed, so a replay pushes nothing."""
    return f"{request_result(request_id)}:published"


def request_stream(request_id: str) -> str:
    """Stream: a streamed request's chunks, XADDed by the worker and read by
    the waiting web process, then its end marker (gateway/core/request/streams.py)."""
    return f"{request_tag(request_id)}:stream"


def request_stream_cancel(request_id: str) -> str:
    """String: set when a streamed request's caller went away; the worker
    closes the pool call when it sees it."""
    return f"{request_tag(request_id)}:cancel"


def idempotency(workload_id: int, key: str) -> str:
    """String: a sync request's Idempotency-Key: body digest, state, stored
    response. Only single-key commands touch it (SET NX, GET, DEL), so any
    slot serves it on a cluster; no tag, and the name stays what stored keys
    (kept 24 h) are called."""
    return f"sluice:idem:{workload_id}:{key}"


# --- jobs ----------------------------------------------------------------------------

DELAYED_JOBS = "sluice:jobs:delayed"
"""Sorted set: ids of jobs waiting for budget, scored by release time (ms).
One key that only single-key commands touch (ZADD, ZRANGEBYSCORE, ZREM): it
needs no hash tag on a cluster, and keeping its name keeps parked jobs
across an upgrade."""


def pool_pacer(pool_id: int) -> str:
    """Hash: per scheduled workload, when its leaky bucket next lets a job out."""
    return f"{pool_tag(pool_id)}:pace"


def pool_held(pool_id: int) -> str:
    """Sorted set: 'request_id|lane|tokens' of requests held through an outage
    (gateway/core/protection/held.py), scored by their queue deadline (ms)."""
    return f"{pool_tag(pool_id)}:held"


HELD_POOLS = "sluice:held:pools"
"""Set: ids of pools that may have held requests, for the pacer to look at
(gateway/core/protection/held.py; single-key commands only, no hash tag needed)."""


CALLBACK_RETRIES = "sluice:jobs:callbacks:due"
"""Sorted set: '<job id>:<attempt>' of job callbacks waiting to be tried
again, scored by when (ms); the pacer puts due ones on the housekeeping lane."""


PACER_WAKE = "sluice:pacer:wake"
"""List of at most one element: pushed by a write that adds work for the
pacer (a delayed job, a callback retry); a pacer waiting in BLPOP on it
wakes at once (gateway/core/pacer_wake.py). Single-key commands only, no
hash tag needed."""


HELD_WAKE = "sluice:held:wake"
"""As ``PACER_WAKE``, for the pacer's held-release thread: pushed by a
write that holds a request (gateway/core/protection/held.py)."""


def web_stream_wake(reader: str) -> str:
    """A web process's shared stream read's wake stream (gateway/web/stream_reads.py:
    an XADD here ends the read that names it). Named in that read beside the
    requests' streams, so never on a Redis Cluster."""
    return f"sluice:web:{reader}:wake"


def batch_task(batch_id: str, step: str) -> str:
    """String, set NX with a TTL when a batch's validation or finalization
    task is published: the pacer publishes it again only once it expires (a
    lost task, gateway/core/batches/lifecycle.py)."""
    return f"sluice:batch:{batch_id}:{step}"


# --- attempt throttles ------------------------------------------------------------------


def attempts(kind: str, subject_digest: str) -> str:
    """String: failed attempts (sign-ins, API keys) of one user or client
    address in the current window; expires with the window."""
    return f"sluice:attempts:{kind}:{subject_digest}"


# --- lanes and the pool's answers ---------------------------------------------------------


def pool_metrics(pool_id: int, lane: str) -> str:
    """Hash: arrivals, departures and time in system per 10 s slot, per lane."""
    return f"{pool_tag(pool_id)}:metrics:{lane}"


def lane_in_flight(pool_id: int, lane: str) -> str:
    """Sorted set: admitted requests of a lane not yet finished, by expiry."""
    return f"{pool_tag(pool_id)}:lane:{lane}:inflight"


def lane_slots(pool_id: int, lane: str) -> str:
    """Sorted set: request ids holding one of the lane's pool-call slots on
    the pool, scored by when the slot's lease ends (ms; gateway/core/protection/concurrency.py)."""
    return f"{pool_tag(pool_id)}:lane:{lane}:slots"


def lane_slot_waiters(pool_id: int, lane: str) -> tuple[str, str]:
    """Sorted sets: request ids waiting for one of the lane's slots, scored
    by their first ask (the order they are served in), and by when a waiter
    that stopped asking counts as gone (protection/slot_acquire.lua)."""
    return f"{pool_tag(pool_id)}:lane:{lane}:waiters", f"{pool_tag(pool_id)}:lane:{lane}:waiters_expiry"


def lane_limits(pool_id: int) -> str:
    """Hash: the adaptive concurrency limit of each limited lane on the pool
    (``<lane>.limit``) and the short-latency signal that moves it
    (``base``, ``fast``, ``samples``, ``cooldown_until_ms``, ``decreases``)."""
    return f"{pool_tag(pool_id)}:lane-limits"


def pool_circuit(pool_id: int) -> str:
    """Hash: the pool's circuit breaker (gateway/core/protection/circuit.lua lists the fields)."""
    return f"{pool_tag(pool_id)}:circuit"


def pool_retry(pool_id: int) -> str:
    """Hash: the pool's retry token bucket and retry counters."""
    return f"{pool_tag(pool_id)}:retry"


def retry_session(pool_id: int, workload_id: int, session_id: str) -> str:
    """Hash: one client session's retry budget (X-Session-Id)."""
    return f"{pool_retry(pool_id)}:session:{workload_id}:{session_id[:128]}"


# --- processes -------------------------------------------------------------------------

# Sorted set: API key id -> unix seconds it was last used (ZADD GT keeps the
# latest); beat renames it to the second key and writes that to the database.
KEY_LAST_USED = "sluice:{keys}:last-used"
KEY_LAST_USED_FLUSHING = "sluice:{keys}:last-used:flushing"
WORKERS_READY = "sluice:workers:ready"  # single-key commands only
"""Hash: lane worker hostname -> pid, set when a worker is ready to consume
(`make run` and the test harness wait on it) and removed at shutdown."""

POOL_PROBE_ROUND = "sluice:pools:probe-round"
"""String: held for one probe interval by the pacer whose prober runs this
round, so N pacers (one per host) probe each pool once per interval."""
