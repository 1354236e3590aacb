"""The adaptive long-lane limit (gateway/core/concurrency.py): the slot
semaphore's atomicity (threads and processes) and leases against a real
Redis, the worker's bounded wait, and the AIMD rule (lane_limit.lua) step by
step with exact values."""

from __future__ import annotations

import math
import multiprocessing
import threading
import time

import pytest

from budgets.admission.redis_client import redis_now_ms
from gateway.core import keys
from gateway.core.concurrency import (LIMITED_LANES, lane_limit_long_done, lane_limit_short_sample,
                                      lane_limit_throttle, lane_limits_read, slot_acquire_call, slot_release)
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
