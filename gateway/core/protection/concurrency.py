"""How many long requests may be in a pool call at once, per pool and lane:
a limit the gateway learns, not a thread count (docs/RELIABILITY.md,
"Adaptive long-lane concurrency").

A lane's worker threads stay as they are; what is limited is how many of them
hold one of the lane's *slots* on the pool while they call it. The slots are a
counting semaphore in Redis (``slot_acquire.lua``): atomic across every worker
process and host, and leased, so a worker that dies mid-call gives its slot
back when the lease ends. The semaphore's size is the lane's limit, which
``lane_limit.lua`` moves by AIMD from the short requests' latency per token
against its idle baseline (the pool's head-of-line blocking shows there
first) and from the pool's 429s. The script's header says why AIMD.

This module only talks to Redis; the worker's wait for a slot (bounded by
the request's deadline, fail-open past it) is gateway/worker/lane_slot.py."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.redis.clients import get_redis
from budgets.redis.scripts import LuaScript, ScriptCall
from gateway.core import keys
from gateway.core.lanes import BATCH, INTERACTIVE, INTERACTIVE_LONG

SLOT_ACQUIRE = LuaScript(__package__, "slot_acquire.lua")
# A waiter for a slot asks again within its spacing wait plus POLL_MAX_S
# (gateway/worker/lane_slot.py); one this late after that has stopped asking.
WAITER_GRACE_MS = 1000
LANE_LIMIT = LuaScript(__package__, "lane_limit.lua")

# The lanes whose pool calls are limited, and the one whose latency is the
# signal. Scheduled work is paced already (gateway/worker/pacer.py).
LIMITED_LANES: tuple[str, ...] = (INTERACTIVE_LONG.name, BATCH.name)
SIGNAL_LANE = INTERACTIVE.name


@dataclass(frozen=True)
class SlotGrant:
    taken: bool
    held: int  # slots of the lane held on the pool now
    limit: float  # the lane's limit when asked
    now_ms: float
    spacing_wait_ms: float = 0.0  # a free slot waits this long for the spacing of long starts


@dataclass(frozen=True)
class LaneLimits:
    """A pool's limited lanes as the overview page and /metrics show them."""

    limits: dict[str, float]
    in_use: dict[str, int]
    baseline_ms_per_token: float | None
    recent_ms_per_token: float | None
    decreases: int
    last_decrease_ms: float
    last_decrease_why: str
    # The spacing of long calls' starts (slot_acquire.lua): its two terms
    # (None until known) and the gap each lane's next start keeps.
    short_call_ms: float | None = None
    long_call_ms: dict[str, float | None] | None = None
    start_gap_ms: dict[str, float] | None = None


def lane_limited(lane: str) -> bool:
    return lane in LIMITED_LANES


def slot_lease_ms() -> int:
    """A slot outlives any healthy call: the upstream timeout plus a margin."""
    return int(settings.SLUICE_UPSTREAM_TIMEOUT_S * 1000) + 30_000


def slot_acquire_call(*, pool_id: int, lane: str, holder: str, lease_ms: int | None = None) -> ScriptCall[SlotGrant]:
    return ScriptCall(
        script=SLOT_ACQUIRE,
        keys=[keys.lane_slots(pool_id, lane), keys.lane_limits(pool_id), *keys.lane_slot_waiters(pool_id, lane)],
        args=[holder, lease_ms if lease_ms is not None else slot_lease_ms(), lane, settings.SLUICE_LANE_LIMIT_INITIAL,
              WAITER_GRACE_MS],
        parse=lambda raw: SlotGrant(taken=int(raw[0]) == 1, held=int(raw[1]), limit=float(raw[2]),
                                    now_ms=float(raw[3]), spacing_wait_ms=float(raw[4])),
    )


def slot_wait_end(*, pool_id: int, lane: str, holder: str, client=None) -> None:
    """A waiter that stops waiting (it calls without a slot) leaves the line
    at once, not when its grace ends."""
    (client or get_redis()).zrem(keys.lane_slot_waiters(pool_id, lane)[0], holder)


def slot_release(*, pool_id: int, lane: str, holder: str, client=None) -> int:
    """Give the slot back; returns how many of the lane's slots remain held
    (this one no longer among them). One ZREM: atomic without a script."""
    client = client or get_redis()
    pipe = client.pipeline(transaction=False)
    pipe.zrem(keys.lane_slots(pool_id, lane), holder)
    pipe.zcard(keys.lane_slots(pool_id, lane))
    return int(pipe.execute()[1])


def start_gap_ms(*, short_call_ms: float | None, long_call_ms: float | None, limit: float) -> float:
    """The spacing slot_acquire.lua keeps between long calls' starts (its
    header says why): 0 while either duration is unknown."""
    if short_call_ms is None or long_call_ms is None:
        return 0.0
    return min(short_call_ms, long_call_ms / (2 * max(1, int(limit))))


def lane_limit_call(*, pool_id: int, event: str, value: str | float,
                    extra: str | float, duration_ms: float = 0) -> ScriptCall[tuple[str, dict]]:
    return ScriptCall(
        script=LANE_LIMIT,
        keys=[keys.lane_limits(pool_id)],
        args=[event, value, extra, ",".join(LIMITED_LANES), settings.SLUICE_LANE_LIMIT_INITIAL,
              settings.SLUICE_LANE_LIMIT_MIN, settings.SLUICE_LANE_LIMIT_MAX,
              settings.SLUICE_LANE_LIMIT_CONGESTION_RATIO, settings.SLUICE_LANE_LIMIT_DECREASE,
              settings.SLUICE_LANE_LIMIT_COOLDOWN_MS, settings.SLUICE_LANE_LIMIT_WARMUP_SAMPLES,
              settings.SLUICE_LANE_LIMIT_BASELINE_DRIFT, settings.SLUICE_LANE_LIMIT_EWMA_WEIGHT,
              settings.SLUICE_LANE_LIMIT_MEMORY_MS, duration_ms],
        parse=lambda raw: (raw[0], {lane: float(v) for lane, v in zip(LIMITED_LANES, raw[1:])}),
    )


def lane_limit_short_sample(*, pool_id: int, ms_per_token: float, admitted_ms: float,
                            duration_ms: float = 0) -> tuple[str, dict]:
    """A short call answered: its latency per output token feeds the signal,
    its duration the spacing of long starts."""
    return lane_limit_call(pool_id=pool_id, event="short", value=ms_per_token, extra=admitted_ms,
                           duration_ms=duration_ms).run()


def lane_limit_long_done(*, pool_id: int, lane: str, in_use: int, duration_ms: float = 0) -> tuple[str, dict]:
    """A limited lane's call succeeded with ``in_use`` of its slots held
    (its own included): a full lane without congestion may grow."""
    return lane_limit_call(pool_id=pool_id, event="long", value=lane, extra=in_use, duration_ms=duration_ms).run()


def lane_limit_throttle(*, pool_id: int) -> tuple[str, dict]:
    """The pool answered 429: every limited lane backs off."""
    return lane_limit_call(pool_id=pool_id, event="throttle", value=0, extra=0).run()


def lane_limits_read(*, pool_id: int, client=None) -> LaneLimits:
    client = client or get_redis()
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.lane_limits(pool_id))
    for lane in LIMITED_LANES:
        pipe.zcard(keys.lane_slots(pool_id, lane))
    raw, *held = pipe.execute()

    def number(name: str) -> float | None:
        return float(raw[name]) if raw.get(name) else None

    base, fast, short_ms = number("base"), number("fast"), number("short_ms")
    limits = {lane: float(raw.get(f"{lane}.limit") or settings.SLUICE_LANE_LIMIT_INITIAL) for lane in LIMITED_LANES}
    long_ms = {lane: number(f"{lane}.call_ms") for lane in LIMITED_LANES}
    return LaneLimits(
        limits=limits,
        in_use=dict(zip(LIMITED_LANES, (int(h) for h in held))),
        baseline_ms_per_token=base, recent_ms_per_token=fast, decreases=int(raw.get("decreases") or 0),
        last_decrease_ms=float(raw.get("last_decrease_ms") or 0), last_decrease_why=raw.get("last_decrease_why", ""),
        short_call_ms=short_ms, long_call_ms=long_ms,
        start_gap_ms={lane: start_gap_ms(short_call_ms=short_ms, long_call_ms=long_ms[lane], limit=limits[lane])
                      for lane in LIMITED_LANES},
    )
