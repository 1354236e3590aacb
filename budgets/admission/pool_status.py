"""Whether each pool answers, as its background probe last saw it
(gateway/worker/prober.py runs the probes; ``probe.lua`` records them).

What admission needs is one mark in the pool's capacity hash, which
``admit.lua`` reads on every admission anyway: while ``down_until_ms`` is in
the future the pool's workloads get ``503 pool_unavailable`` at once. Other
pools, and the gateway's own health, are unaffected. The details (when, why,
how many failures in a row) live in a hash of their own for the pool pages,
the live metrics and the health endpoints' details."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from budgets.admission import keys
from budgets.redis.clients import get_redis, redis_now_ms
from budgets.redis.scripts import LuaScript, ScriptCall

PROBE = LuaScript(__package__, "probe.lua")

# A down mark outlives this many probe intervals without a new failed probe.
DOWN_MARK_INTERVALS = 3


@dataclass(frozen=True)
class PoolStatus:
    """A pool's reachability. ``probed`` False: never probed (a new pool, or
    probing is off); such a pool admits work (fail open)."""

    available: bool
    probed: bool = False
    last_probe_ok: bool = True
    last_probe_ms: float = 0.0
    latency_ms: int = 0
    failures_in_a_row: int = 0
    detail: str = ""
    down_until_ms: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


NOT_PROBED = PoolStatus(available=True)


def pool_probe_record_call(*, pool_id: int, ok: bool, detail: str, latency_ms: int, interval_s: float,
                           failures_to_down: int) -> ScriptCall[float]:
    """Record one probe; the result is the pool's down mark (0.0: it admits)."""
    interval_ms = int(interval_s * 1000)
    return ScriptCall(
        script=PROBE,
        keys=[keys.pool_probe(pool_id), keys.pool_capacity(pool_id)],
        args=[1 if ok else 0, detail[:300], max(0, int(latency_ms)), interval_ms, max(1, failures_to_down),
              interval_ms * DOWN_MARK_INTERVALS],
        parse=lambda raw: float(raw[1]),
    )


def _status(probe: dict[str, str], down_until_ms: float, now_ms: float) -> PoolStatus:
    if not probe:
        return PoolStatus(available=not now_ms < down_until_ms, down_until_ms=down_until_ms)
    return PoolStatus(
        available=not now_ms < down_until_ms,
        probed=True,
        last_probe_ok=probe.get("ok") == "1",
        last_probe_ms=float(probe.get("at_ms") or 0),
        latency_ms=int(float(probe.get("latency_ms") or 0)),
        failures_in_a_row=int(probe.get("failures") or 0),
        detail=probe.get("detail", ""),
        down_until_ms=down_until_ms if now_ms < down_until_ms else 0.0,
    )


def pool_statuses(*, pool_ids: list[int], client=None) -> dict[int, PoolStatus]:
    """Every listed pool's status in one round trip, plus one for Redis's
    clock (not pipelined: a cluster client refuses TIME in a pipeline)."""
    client = client or get_redis()
    if not pool_ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for pool_id in pool_ids:
        pipe.hgetall(keys.pool_probe(pool_id))
        pipe.hget(keys.pool_capacity(pool_id), "down_until_ms")
    replies = pipe.execute()
    now_ms = redis_now_ms(client)
    return {
        pool_id: _status(replies[2 * i] or {}, float(replies[2 * i + 1] or 0), now_ms)
        for i, pool_id in enumerate(pool_ids)
    }


def pool_status(*, pool_id: int, client=None) -> PoolStatus:
    return pool_statuses(pool_ids=[pool_id], client=client)[pool_id]
