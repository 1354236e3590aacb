"""The Redis key schema, in one place. Everything one admission or settlement
script touches carries the pool's hash tag ``{pool:<id>}`` so Redis Cluster
keeps it on one shard; a tenant's month-to-date spend carries the tenant's own
tag ``{tenant:<id>}`` (a tenant spends on several pools), and no script
touches both (budgets/admission/spend_holds.py)."""

from __future__ import annotations


def pool_tag(pool_id: int) -> str:
    """The prefix of every key of one pool: ``{pool:<id>}`` is the Redis Cluster
    hash tag, so the pool's keys share a shard (gateway/core/keys.py uses it too)."""
    return f"sluice:{{pool:{pool_id}}}"


# pool id -> its in-flight limit (max_concurrency) for every active pool:
# what the lane workers size their threads by (gateway/worker/lane_pool.py).
POOL_IN_FLIGHT_LIMITS = "sluice:pools:in_flight_limits"


def pool_config(pool_id: int) -> str:
    """Hash: bucket rates/capacities of the pool and of every workload on it."""
    return f"{pool_tag(pool_id)}:cfg"


def pool_workloads(pool_id: int) -> str:
    """Set: ids of the workloads with a reservation on the pool."""
    return f"{pool_tag(pool_id)}:wids"


def pool_buckets(pool_id: int) -> str:
    """Hash: level and last-refill time of every bucket of the pool."""
    return f"{pool_tag(pool_id)}:buckets"


def pool_leases(pool_id: int) -> str:
    """Sorted set: in-flight request ids scored by lease expiry (ms)."""
    return f"{pool_tag(pool_id)}:leases"


def workload_leases(pool_id: int, workload_id: int) -> str:
    return f"{pool_tag(pool_id)}:wl:{workload_id}:leases"


def lease(pool_id: int, request_id: str) -> str:
    """Hash: what admission debited for one request, so settlement can undo it."""
    return f"{pool_tag(pool_id)}:lease:{request_id}"


def pool_counters(pool_id: int) -> str:
    """Hash: monotonic counters (tokens debited net of settlement, per workload)."""
    return f"{pool_tag(pool_id)}:counters"


def pool_capacity(pool_id: int) -> str:
    """Hash: adaptive capacity factor of the pool (1.0 = configured limits), and
    whether the prober found it unreachable (``down_until_ms``, ``probe_next_ms``)."""
    return f"{pool_tag(pool_id)}:capacity"


def held_body(pool_id: int, workload_id: int, body_digest: str) -> str:
    """String, expiring: the workload's request with this body (its digest)
    was held (admit.lua), so the same body again, a client's retry, is held too."""
    return f"{pool_tag(pool_id)}:held-body:{workload_id}:{body_digest[:32]}"


def pool_protected_sum(pool_id: int) -> str:
    """Hash: the pool's protected sum S (every workload's protected level added
    up) as an incremental aggregate, per dimension (protected_sum.lua)."""
    return f"{pool_tag(pool_id)}:psum"


def pool_protected_fill(pool_id: int) -> str:
    """Sorted set: protected buckets not yet full ("<wid>.Q.<tok|req>"),
    scored by the ms at which they will be (protected_sum.lua)."""
    return f"{pool_tag(pool_id)}:pfill"


def pool_probe(pool_id: int) -> str:
    """Hash: the pool's last probe (when, answered or not, why, failures in a row)."""
    return f"{pool_tag(pool_id)}:probe"


# --- rejection counters (budgets.ledger.rejections) -----------------------------------
# pool id 0 holds rejections of requests that never reached a pool.


def rejection_minute_counts(pool_id: int, minute_epoch: int) -> str:
    """Hash: rejections in one minute, fields "<wid>|<reason>" and "_n" (total)."""
    return f"{pool_tag(pool_id)}:rej:{minute_epoch}:n"


def rejection_minute_samples(pool_id: int, minute_epoch: int) -> str:
    """List: JSON samples of the minute's first rejections per workload and reason."""
    return f"{pool_tag(pool_id)}:rej:{minute_epoch}:samples"


def rejection_hour_refusals(pool_id: int, hour_epoch: int) -> str:
    """Hash: every refusal of one hour, request id -> its JSON details, kept
    25 hours (a refusal is findable by its id for at least 24)."""
    return f"{pool_tag(pool_id)}:rej:{hour_epoch}:by-id"


def rejection_pending_minutes(pool_id: int) -> str:
    """Sorted set: minutes (epoch seconds) with counts not yet flushed to the database."""
    return f"{pool_tag(pool_id)}:rej:pending"


# --- spend (budgets.admission.spend_holds, budgets.ledger.spend) ------------------------


def tenant_tag(tenant_id: int) -> str:
    """The prefix of every key of one tenant's spend: ``{tenant:<id>}`` is its
    Redis Cluster hash tag, so the spend scripts stay on one shard."""
    return f"sluice:{{tenant:{tenant_id}}}"


def tenant_spend_month(tenant_id: int, year_month: str) -> str:
    """Hash: the tenant's month-to-date spend over every pool in micro-units,
    in-flight estimates included: field "T<tenant id>" (the tenant) and one
    field "<workload id>" per workload of the tenant."""
    return f"{tenant_tag(tenant_id)}:spend:{year_month}"


def tenant_spend_caps(tenant_id: int) -> str:
    """Hash: hard caps in micro-units, "T<tenant id>" and "<workload id>", and
    "pushed" (present even without caps: a missing hash means Redis lost it)."""
    return f"{tenant_tag(tenant_id)}:spend:caps"


def tenant_spend_holds(tenant_id: int) -> str:
    """Hash: request id -> "<workload id>|<micro>|<YYYY-MM>|<expires ms>|<e or s>":
    a request's estimated cost held at admission (e), or its actual cost once
    settled (s) until the ledger row that reconciliation reads is confirmed."""
    return f"{tenant_tag(tenant_id)}:spend:holds"


# Sorted set: "<notification id>:<channel>:<attempt>" -> when it is due (ms,
# Redis clock): alert deliveries waiting for their retry (budgets/services/alerts.py).
ALERT_RETRIES = "sluice:alerts:due"
