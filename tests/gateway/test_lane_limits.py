"""The adaptive long-lane limit (gateway/core/protection/concurrency.py): the slot
semaphore's atomicity (threads and processes) and leases against a real
Redis, the worker's bounded wait, and the AIMD rule (lane_limit.lua) step by
step with exact values."""

from __future__ import annotations

import math
import multiprocessing
import threading
import time

import pytest

from budgets.redis.clients import redis_now_ms
from gateway.core import keys
from gateway.core.protection.concurrency import (LIMITED_LANES, WAITER_GRACE_MS, lane_limit_long_done,
                                                 lane_limit_short_sample, lane_limit_throttle, lane_limits_read,
                                                 slot_acquire_call, slot_lease_ms, slot_release, slot_wait_end)
from gateway.worker.lane_slot import slot_wait
from tests.hammer import _hammer, slots_take_many

POOL = 41
LONG = "interactive-long"


def _set_limit(redis_client, lane: str, limit: float) -> None:
    redis_client.hset(keys.lane_limits(POOL), f"{lane}.limit", limit)


def test_hundred_threads_against_five_slots_take_exactly_five(redis_client):
    # given
    _set_limit(redis_client, LONG, 5)

    # when
    def attempt(n: int) -> tuple[str, bool]:
        holder = f"t{n}"
        return holder, slot_acquire_call(pool_id=POOL, lane=LONG, holder=holder, lease_ms=600_000).run().taken

    results = _hammer(threads=100, attempts=1, barrier_at=time.time() + 0.2, attempt=attempt)

    # then
    assert len(results) == 100
    assert sum(taken for _, taken in results) == 5
    assert redis_client.zcard(keys.lane_slots(POOL, LONG)) == 5


def test_four_processes_by_eight_threads_take_exactly_the_limit(redis_client):
    # given
    _set_limit(redis_client, LONG, 7)
    ctx = multiprocessing.get_context("spawn")
    barrier_at = time.time() + 4.0  # spawned interpreters need a moment to import Django

    # when
    with ctx.Pool(4) as processes:
        chunks = processes.map(slots_take_many, [(POOL, LONG, 8, 5, barrier_at)] * 4)

    # then
    results = [r for chunk in chunks for r in chunk]
    assert len(results) == 160
    taken = {holder for holder, ok in results if ok}
    assert len(taken) == 7
    assert set(redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1)) == taken


def test_lanes_and_pools_have_their_own_slots(redis_client):
    _set_limit(redis_client, LONG, 1)
    _set_limit(redis_client, "batch", 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="a").run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="b").run().taken
    assert slot_acquire_call(pool_id=POOL, lane="batch", holder="b").run().taken
    assert slot_acquire_call(pool_id=POOL + 1, lane=LONG, holder="b").run().taken


def test_a_holder_asking_again_keeps_its_one_slot(redis_client):
    _set_limit(redis_client, LONG, 2)
    first = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run()
    again = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run()
    assert (first.taken, first.held, again.taken, again.held) == (True, 1, True, 1)


def test_release_frees_the_slot_for_the_next(redis_client):
    _set_limit(redis_client, LONG, 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="a").run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="b").run().taken
    assert slot_release(pool_id=POOL, lane=LONG, holder="a") == 0
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="b").run().taken


def test_a_freed_slot_goes_to_the_waiter_that_asked_first_whoever_polls_first(redis_client):
    # given the lane's one slot held, and waiters that asked in the order a, b, c
    _set_limit(redis_client, LONG, 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="holder").run().taken
    for waiter in ("a", "b", "c"):
        assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder=waiter).run().taken
    # when the slot is freed and the later waiters poll before the first
    slot_release(pool_id=POOL, lane=LONG, holder="holder")
    # then neither they nor a newcomer take it; the first waiter does
    assert [slot_acquire_call(pool_id=POOL, lane=LONG, holder=h).run().taken for h in ("c", "b", "new", "a")] == [
        False, False, False, True]
    # and the next one freed goes to b, then c, then the newcomer
    order = []
    for _ in range(3):
        slot_release(pool_id=POOL, lane=LONG, holder=order[-1] if order else "a")
        order.append(next(h for h in ("new", "c", "b") if slot_acquire_call(pool_id=POOL, lane=LONG, holder=h).run().taken))
    assert order == ["b", "c", "new"]


def test_a_waiter_that_stops_asking_leaves_the_line(redis_client):
    _set_limit(redis_client, LONG, 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="holder").run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="gone").run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run().taken
    slot_release(pool_id=POOL, lane=LONG, holder="holder")
    # "gone" is first in line: "next" waits behind it while it may still ask
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run().taken
    # when it has not asked for longer than its grace (its worker died)
    time.sleep(WAITER_GRACE_MS / 1000 + 0.1)
    # then the next in line gets the slot
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run().taken
    # and one that gives up leaves the line at once
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="quits").run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="after").run().taken
    slot_wait_end(pool_id=POOL, lane=LONG, holder="quits")
    slot_release(pool_id=POOL, lane=LONG, holder="next")
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="after").run().taken


def test_a_dead_holders_slot_comes_back_when_its_lease_ends(redis_client):
    # given: two slots, one held by a live worker, one by a worker that died
    _set_limit(redis_client, LONG, 2)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="live", lease_ms=600_000).run().taken
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="dead", lease_ms=150).run().taken
    assert not slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run().taken

    # when: polling (with a deadline) until the dead one's lease has ended
    deadline = time.monotonic() + 5
    grant = slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run()
    while not grant.taken and time.monotonic() < deadline:
        grant = slot_acquire_call(pool_id=POOL, lane=LONG, holder="next").run()

    # then: the dead holder is gone, the live one kept its slot, the newcomer has the other
    assert grant.taken
    assert sorted(redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1)) == ["live", "next"]


def test_a_waiter_gets_the_slot_another_worker_releases(redis_client):
    # given
    _set_limit(redis_client, LONG, 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="running").run().taken
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(slot_wait(
        pool_id=POOL, lane=LONG, holder="waiting", deadline_ms=redis_now_ms() + 30_000)))
    waiter.start()
    # the waiter is polling, not holding
    assert redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1) == ["running"]

    # when
    slot_release(pool_id=POOL, lane=LONG, holder="running")
    waiter.join(timeout=10)

    # then
    assert got == [True]
    assert redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1) == ["waiting"]


def test_a_waiter_past_its_deadline_goes_ahead_without_a_slot(redis_client):
    _set_limit(redis_client, LONG, 1)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="running").run().taken
    assert slot_wait(pool_id=POOL, lane=LONG, holder="late", deadline_ms=redis_now_ms() + 100) is False
    assert redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1) == ["running"]


@pytest.fixture
def aimd(settings):
    settings.SLUICE_LANE_LIMIT_INITIAL = 4.0
    settings.SLUICE_LANE_LIMIT_MIN = 1.0
    settings.SLUICE_LANE_LIMIT_MAX = 6.0
    settings.SLUICE_LANE_LIMIT_CONGESTION_RATIO = 2.0
    settings.SLUICE_LANE_LIMIT_DECREASE = 0.75
    settings.SLUICE_LANE_LIMIT_COOLDOWN_MS = 0
    settings.SLUICE_LANE_LIMIT_WARMUP_SAMPLES = 3
    settings.SLUICE_LANE_LIMIT_BASELINE_DRIFT = 0.0
    settings.SLUICE_LANE_LIMIT_EWMA_WEIGHT = 0.5
    settings.SLUICE_LANE_LIMIT_MEMORY_MS = 600_000
    return settings


def _fresh() -> float:
    """An admission time after any decrease so far (the sample is fresh)."""
    return redis_now_ms() + 3_600_000


def _limits(**values: float) -> dict[str, float]:
    return {lane: values.get(lane.replace("-", "_"), 4.0) for lane in LIMITED_LANES}


def test_short_latency_twice_its_baseline_cuts_every_limited_lane(redis_client, aimd):
    # given: three idle samples make the baseline 10 ms per token
    for _ in range(3):
        assert lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh()) == ("held", _limits())

    # when: the EWMA reaches 10 + 0.5 x (50 - 10) = 30 > 2 x 10
    verdict = lane_limit_short_sample(pool_id=POOL, ms_per_token=50.0, admitted_ms=_fresh())

    # then: min(4 - 1, floor(4 x 0.75)) = 3 on both lanes, with the reason kept
    assert verdict == ("decreased", _limits(interactive_long=3.0, batch=3.0))
    state = lane_limits_read(pool_id=POOL)
    assert (state.baseline_ms_per_token, state.recent_ms_per_token, state.decreases) == (10.0, None, 1)
    assert state.last_decrease_why == "short latency 3.00x its idle baseline"


def test_no_decrease_before_the_baseline_has_its_samples(redis_client, aimd):
    assert lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh())[0] == "held"
    assert lane_limit_short_sample(pool_id=POOL, ms_per_token=90.0, admitted_ms=_fresh())[0] == "held"


def test_a_sample_admitted_before_the_last_decrease_does_not_cut_again(redis_client, aimd):
    # given: one decrease (4 -> 3)
    for _ in range(3):
        lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh())
    before_decrease = redis_now_ms()
    assert lane_limit_short_sample(pool_id=POOL, ms_per_token=50.0, admitted_ms=before_decrease + 1)[0] == "decreased"

    # when: a call admitted before that decrease answers slowly
    stale = lane_limit_short_sample(pool_id=POOL, ms_per_token=500.0, admitted_ms=before_decrease - 1000)

    # then
    assert stale == ("held", _limits(interactive_long=3.0, batch=3.0))


def test_a_full_lane_without_congestion_grows_by_one_over_its_limit(redis_client, aimd):
    assert lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=4) == ("increased", _limits(interactive_long=4.25))
    # a lane not using its limit does not grow
    assert lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=3) == ("held", _limits(interactive_long=4.25))
    assert lane_limit_long_done(pool_id=POOL, lane="batch", in_use=4) == ("increased",
                                                                           _limits(interactive_long=4.25, batch=4.25))


def test_growth_stops_at_the_max(redis_client, aimd):
    _set_limit(redis_client, LONG, 5.9)
    assert lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=5) == ("increased", _limits(interactive_long=6.0))
    assert lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=6) == ("held", _limits(interactive_long=6.0))


def test_the_level_that_hurt_is_not_probed_again_while_remembered(redis_client, aimd):
    # given: a 429 at limit 4 leaves 3, remembering 4
    assert lane_limit_throttle(pool_id=POOL) == ("decreased", _limits(interactive_long=3.0, batch=3.0))

    # when: the lane stays full and calm
    limits = [lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=3)[1][LONG] for _ in range(4)]

    # then: 3 + 1/3 + ... up to just below 4, never 4 itself
    assert limits[0] == pytest.approx(3 + 1 / 3)
    assert limits[-1] == pytest.approx(3.999)
    assert all(limit < 4 for limit in limits)


def test_the_slots_that_hurt_are_remembered_not_the_fraction_the_limit_had_grown_to(redis_client, aimd):
    # given: the limit had grown to 4.25 (4 slots: slot_acquire grants the whole part) when the pool congested
    _set_limit(redis_client, LONG, 4.25)
    assert lane_limit_throttle(pool_id=POOL)[1][LONG] == 3.0

    # when: the lane stays full and calm
    limits = [lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=3)[1][LONG] for _ in range(6)]

    # then: it climbs to just below 4, the 4 slots that hurt, not to 4.249 (4 slots again)
    assert limits[-1] == pytest.approx(3.999)
    assert all(math.floor(limit) == 3 for limit in limits)


def test_a_decrease_below_a_remembered_level_does_not_lower_the_ceiling(redis_client, aimd):
    # given: congestion at 4 slots, then the limit regrown to 3.999 (3 slots)
    lane_limit_throttle(pool_id=POOL)
    for _ in range(6):
        lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=3)

    # when: one more decrease at 3 slots (noise, or the tail of the first congestion)
    assert lane_limit_throttle(pool_id=POOL)[1][LONG] == 2.0
    limits = [lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=in_use)[1][LONG] for in_use in (2, 2, 2, 3, 3, 3, 3)]

    # then: the ceiling is still the 4 slots that hurt first, not 3: the lane gets its 3 slots back
    assert limits[-1] == pytest.approx(3.999)


def test_the_level_is_probed_again_once_the_memory_fades(redis_client, aimd):
    aimd.SLUICE_LANE_LIMIT_MEMORY_MS = 0
    lane_limit_throttle(pool_id=POOL)
    limits = [lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=3)[1][LONG] for _ in range(4)]
    assert limits[-1] > 4


def test_decreases_wait_for_the_cooldown_and_stop_at_the_min(redis_client, aimd):
    aimd.SLUICE_LANE_LIMIT_COOLDOWN_MS = 600_000
    assert lane_limit_throttle(pool_id=POOL)[0] == "decreased"
    assert lane_limit_throttle(pool_id=POOL) == ("held", _limits(interactive_long=3.0, batch=3.0))
    aimd.SLUICE_LANE_LIMIT_COOLDOWN_MS = 0
    steps = [lane_limit_throttle(pool_id=POOL)[1][LONG] for _ in range(4)]
    assert steps == [2.0, 1.0, 1.0, 1.0]


# --- the spacing of long calls' starts (slot_acquire.lua) --------------------------------------


def _durations(redis_client, *, short_ms: float | None = None, long_ms: float | None = None) -> None:
    if short_ms is not None:
        redis_client.hset(keys.lane_limits(POOL), "short_ms", short_ms)
    if long_ms is not None:
        redis_client.hset(keys.lane_limits(POOL), f"{LONG}.call_ms", long_ms)


def test_no_spacing_while_either_duration_is_unknown(redis_client):
    # given: four slots, no short call ever timed
    _set_limit(redis_client, LONG, 4)
    _durations(redis_client, long_ms=60_000)

    # when / then: every slot is taken at once
    assert [slot_acquire_call(pool_id=POOL, lane=LONG, holder=f"r{n}").run().taken for n in range(4)] == [True] * 4


def test_a_long_start_waits_a_short_calls_duration_after_the_last(redis_client):
    # given: short calls take 400 ms; long ones 60 s on 4 slots (60,000 / 8 = 7,500 ms > 400 ms)
    _set_limit(redis_client, LONG, 4)
    _durations(redis_client, short_ms=400, long_ms=60_000)

    # when
    first = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run()
    second = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r2").run()

    # then: a free slot, but the second start waits out the gap
    assert (first.taken, first.spacing_wait_ms) == (True, 0.0)
    assert not second.taken and second.held == 1
    assert 0 < second.spacing_wait_ms <= 400
    assert redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1) == ["r1"]

    # and: once the gap has passed, it starts
    time.sleep(second.spacing_wait_ms / 1000 + 0.02)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="r2").run().taken


def test_the_gap_is_at_most_half_the_turnover_of_the_lanes_slots(redis_client):
    # given: long calls of 1,000 ms on 4 slots turn a slot over every 250 ms; short calls take 10 s
    _set_limit(redis_client, LONG, 4.5)
    _durations(redis_client, short_ms=10_000, long_ms=1_000)

    # when
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run().taken
    wait = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r2").run().spacing_wait_ms

    # then: min(10,000, 1,000 / (2 x 4)) = 125 ms, not the short calls' 10 s
    assert 100 < wait <= 125
    state = lane_limits_read(pool_id=POOL)
    assert (state.short_call_ms, state.long_call_ms[LONG], state.start_gap_ms[LONG]) == (10_000.0, 1_000.0, 125.0)


def test_the_spacing_is_kept_across_the_limited_lanes_of_a_pool(redis_client):
    # given: a long interactive call just started; batch calls are long too
    _durations(redis_client, short_ms=5_000, long_ms=600_000)
    redis_client.hset(keys.lane_limits(POOL), "batch.call_ms", 600_000)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run().taken

    # when / then: a batch start on the same pool waits for it; another pool's does not
    assert slot_acquire_call(pool_id=POOL, lane="batch", holder="b1").run().spacing_wait_ms > 4_000
    assert slot_acquire_call(pool_id=POOL + 1, lane="batch", holder="b1").run().taken


def test_a_holder_asking_again_is_not_spaced_from_its_own_start(redis_client):
    _durations(redis_client, short_ms=5_000, long_ms=600_000)
    assert slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run().taken
    again = slot_acquire_call(pool_id=POOL, lane=LONG, holder="r1").run()
    assert (again.taken, again.held, again.spacing_wait_ms) == (True, 1, 0.0)


def test_twenty_threads_at_a_free_lane_start_one_call_per_gap(redis_client):
    # given: eight free slots and a 300 ms gap
    _set_limit(redis_client, LONG, 8)
    _durations(redis_client, short_ms=300, long_ms=600_000)

    # when: twenty threads ask at the same instant
    def attempt(n: int) -> tuple[str, bool]:
        holder = f"t{n}"
        return holder, slot_acquire_call(pool_id=POOL, lane=LONG, holder=holder, lease_ms=600_000).run().taken

    results = _hammer(threads=20, attempts=1, barrier_at=time.time() + 0.2, attempt=attempt)

    # then: one starts; the others wait for the spacing
    assert sum(taken for _, taken in results) == 1
    assert redis_client.zcard(keys.lane_slots(POOL, LONG)) == 1


def test_waiters_on_a_spaced_lane_start_one_gap_apart(redis_client):
    # given: a 150 ms gap and three workers waiting for free slots
    _set_limit(redis_client, LONG, 8)
    _durations(redis_client, short_ms=150, long_ms=600_000)
    got: list[bool] = []

    # when
    workers = [threading.Thread(target=lambda n=n: got.append(slot_wait(
        pool_id=POOL, lane=LONG, holder=f"w{n}", deadline_ms=redis_now_ms() + 30_000))) for n in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)

    # then: all three hold slots, granted (each slot's lease end less the
    # lease, on Redis' clock) at least the gap apart
    assert got == [True] * 3
    leases = redis_client.zrange(keys.lane_slots(POOL, LONG), 0, -1, withscores=True)
    starts = sorted(end - slot_lease_ms() for _, end in leases)
    assert len(starts) == 3
    assert all(b - a >= 150 - 0.01 for a, b in zip(starts, starts[1:]))


def test_short_and_long_durations_are_typical_not_the_latest(redis_client, aimd):
    lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh(), duration_ms=1_000)
    lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh(), duration_ms=2_000)
    lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=1, duration_ms=20_000)
    lane_limit_long_done(pool_id=POOL, lane=LONG, in_use=1, duration_ms=10_000)
    # a call without a duration (0) leaves them alone
    lane_limit_short_sample(pool_id=POOL, ms_per_token=10.0, admitted_ms=_fresh())
    state = lane_limits_read(pool_id=POOL)
    # EWMA weight 0.1: 1,000 + 0.1 x 1,000; 20,000 - 0.1 x 10,000
    assert state.short_call_ms == pytest.approx(1_100)
    assert state.long_call_ms == {LONG: pytest.approx(19_000), "batch": None}
