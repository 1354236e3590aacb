"""Little's law per pool and lane (docs/architecture.md, "Lanes"): arrival rate λ, mean time
in system W, their product λ·W beside the measured in-flight L. A gap
between the two, or L growing, says the pool slowed before any error does.

Counters live in Redis in 10 s slots (HINCRBY on a per-lane hash), written in
the same round trip as the work they describe."""

from __future__ import annotations

import time

from celery import current_app

from budgets.admission import keys as budget_keys
from budgets.admission.capacity import capacity_state
from budgets.admission.pool_status import pool_status
from budgets.redis.clients import get_redis
from budgets.redis.scripts import LuaScript, ScriptCall
from gateway.core import keys
from gateway.core.protection.circuit import circuit_state
from gateway.core.protection.concurrency import lane_limits_read
from gateway.core.lanes import LANE_NAMES, queue_for_lane

SLOT_S = 10
WINDOW_S = 60
KEEP_S = 600

DEPARTURE = LuaScript(__package__, "departure.lua")


def slot(now_s: float | None = None) -> int:
    return int((now_s if now_s is not None else time.time()) // SLOT_S) * SLOT_S


def arrival_keys(*, pool_id: int, lane: str) -> tuple[str, str, str]:
    """Where an arrival is counted: the lane's metrics hash and this slot's
    field in it (HINCRBY 1), and the lane's in-flight set (ZADD the request,
    scored by when it expires), written by ``arrival_commands``."""
    return keys.pool_metrics(pool_id, lane), f"a:{slot()}", keys.lane_in_flight(pool_id, lane)


def arrival_commands(pipe, *, pool_id: int, lane: str, request_id: str, expires_ms: float) -> None:
    """Queue the arrival's writes on an existing pipeline (no extra round trip)."""
    metrics, field, in_flight = arrival_keys(pool_id=pool_id, lane=lane)
    pipe.hincrby(metrics, field, 1)
    pipe.zadd(in_flight, {request_id: expires_ms})


def departure_call(*, pool_id: int, lane: str, request_id: str, time_in_system_ms: int,
                   upstream_429s: int = 0, output_tokens: int = 0) -> ScriptCall[bool]:
    """Count the departure once (departure.lua): True when counted, False when
    an earlier finish of the same request (a redelivered task) did.
    ``output_tokens``: what the caller was relayed (the lane's tokens/s)."""
    return ScriptCall(
        script=DEPARTURE,
        keys=[keys.lane_in_flight(pool_id, lane), keys.pool_metrics(pool_id, lane)],
        args=[request_id, slot(), max(0, int(time_in_system_ms)), max(0, int(upstream_429s)),
              max(0, int(output_tokens))],
        parse=lambda raw: bool(int(raw)),
    )


def departure_record(*, pool_id: int, lane: str, request_id: str, time_in_system_ms: int,
                     upstream_429s: int = 0, output_tokens: int = 0) -> bool:
    return departure_call(pool_id=pool_id, lane=lane, request_id=request_id, time_in_system_ms=time_in_system_ms,
                          upstream_429s=upstream_429s, output_tokens=output_tokens).run()


def _window_sums(raw: dict[str, str], now_s: float) -> dict[str, int]:
    oldest = slot(now_s) - WINDOW_S
    sums = {"a": 0, "d": 0, "w": 0, "u429": 0, "t": 0}
    for field, value in raw.items():
        kind, _, at = field.partition(":")
        if kind in sums and at.isdigit() and int(at) >= oldest:
            sums[kind] += int(value)
    return sums


def _prune(client, key: str, raw: dict[str, str], now_s: float) -> None:
    stale = [f for f in raw if f.partition(":")[2].isdigit() and int(f.partition(":")[2]) < slot(now_s) - KEEP_S]
    if stale:
        client.hdel(key, *stale)


def queue_depths() -> dict[str, int]:
    """Messages waiting in each lane's Celery queue (on the broker)."""
    depths: dict[str, int] = {}
    with current_app.connection_for_read() as connection:
        client = connection.default_channel.client
        for lane in LANE_NAMES:
            depths[lane] = int(client.llen(queue_for_lane(lane)))
    return depths


def pool_live_metrics(*, pool_id: int) -> dict:
    client = get_redis()
    now_s = time.time()
    now_ms = now_s * 1000
    lanes: dict[str, dict] = {}
    total_arrivals = total_departures = total_w = total_429 = 0
    total_in_flight = 0
    for lane in LANE_NAMES:
        key = keys.pool_metrics(pool_id, lane)
        raw = client.hgetall(key)
        _prune(client, key, raw, now_s)
        sums = _window_sums(raw, now_s)
        # Calls held: admitted on this pool and lane, not finished (queued or in a worker).
        in_flight = client.zcount(keys.lane_in_flight(pool_id, lane), now_ms, "+inf")
        arrival_rate = sums["a"] / WINDOW_S
        mean_w = (sums["w"] / sums["d"] / 1000) if sums["d"] else 0.0
        lanes[lane] = {
            "arrival_rate_per_s": round(arrival_rate, 3),
            "mean_time_in_system_s": round(mean_w, 3),
            "littles_l": round(arrival_rate * mean_w, 3),
            "in_flight": in_flight,
            "upstream_429_per_min": sums["u429"] * 60 / WINDOW_S,
            # Output tokens relayed to callers, of the requests that finished in the window.
            "relay_tokens_per_s": round(sums["t"] / WINDOW_S, 1),
        }
        total_arrivals += sums["a"]
        total_departures += sums["d"]
        total_w += sums["w"]
        total_429 += sums["u429"]
        total_in_flight += in_flight
    try:
        depths = queue_depths()
    except Exception:  # the broker may be elsewhere and down; metrics must still answer
        depths = {lane: -1 for lane in LANE_NAMES}
    for lane, depth in depths.items():
        # Admitted calls no worker has taken yet (the lane's queue, shared by
        # its pools): zero below the pools' limits, the lanes being sized by them.
        lanes[lane]["queue_depth"] = depth
    arrival_rate = total_arrivals / WINDOW_S
    mean_w = (total_w / total_departures / 1000) if total_departures else 0.0
    state = capacity_state(pool_id=pool_id)
    lane_limits = lane_limits_read(pool_id=pool_id, client=client)
    circuit = circuit_state(pool_id=pool_id, client=client)
    return {
        "pool_id": pool_id,
        # Whether the pool answers its probes (gateway/worker/prober.py); while
        # "available" is false its workloads get 503 pool_unavailable.
        "pool_status": pool_status(pool_id=pool_id, client=client).as_dict(),
        "window_s": WINDOW_S,
        "effective_capacity_factor": round(state.effective_factor(now_ms=now_ms), 4),
        "capacity_reason": state.reason(now_ms=now_ms),
        "provider": {"remaining_tokens": state.provider_remaining_tokens,
                     "remaining_requests": state.provider_remaining_requests,
                     "limit_tokens": state.provider_limit_tokens, "limit_requests": state.provider_limit_requests},
        # The adaptive long-lane limits (gateway/core/protection/concurrency.py).
        # start_gap_ms: the spacing of the lane's long starts (protection/slot_acquire.lua; 0: none yet).
        "lane_limits": {lane: {"limit": round(limit, 3), "in_use": lane_limits.in_use[lane],
                               "start_gap_ms": round(lane_limits.start_gap_ms[lane], 1)}
                        for lane, limit in lane_limits.limits.items()},
        "lane_limit_reason": lane_limits.last_decrease_why,
        # "held": requests admitted through an outage and not yet released (gateway/core/protection/held.py).
        "circuit": {"state": circuit.state, "why": circuit.why, "opened": circuit.opened,
                    "held": client.zcard(keys.pool_held(pool_id))},
        "blocked_until_ms": state.blocked_until_ms,
        "in_flight": client.zcount(budget_keys.pool_leases(pool_id), now_ms, "+inf"),
        "lane_in_flight": total_in_flight,
        "arrival_rate_per_s": round(arrival_rate, 3),
        "mean_time_in_system_s": round(mean_w, 3),
        "littles_l": round(arrival_rate * mean_w, 3),
        "queue_depth": depths,
        "upstream_429_per_min": total_429 * 60 / WINDOW_S,
        "lanes": lanes,
    }
