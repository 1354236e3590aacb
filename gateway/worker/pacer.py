"""The pacer: moves due jobs from the delayed sorted set onto their lanes,
due job-callback and alert retries onto the housekeeping lane, and, every
SLUICE_TAKEOVER_SWEEP_S, the requests of lost workers that no web process
watches back onto theirs (gateway/core/request/takeover.py). On a thread of
its own (``held_run``), it moves requests held through an outage onto their
lanes as the provider makes room for them (gateway/core/protection/held.py):
that work is Redis only and its callers wait for it, so a database that
holds the loop's steps up (a lock, a restarting or hung server) does not
hold it up too.

Every one of these puts work back on a lane, and each look is a round trip
or two of Redis when there is nothing to do: here it rides on a loop that
runs anyway, where a beat entry would cost a task sent, picked up, traced
and acknowledged per look.

It does not poll. Between steps it waits in Redis (BLPOP on the wake-up key,
gateway/core/pacer_wake.py) until the earliest delayed job, callback or
alert retry is due, never longer than WAIT_MAX_S; whoever parks a job or a
callback retry pushes a wake-up in the same round trip, so work due sooner
than that is released at once, and a lost wake-up costs at most WAIT_MAX_S.
An alert retry pushes none (budgets may not import the wake-up key, and its
backoff is seconds): it leaves within WAIT_MAX_S of being parked at worst.
The held-release thread waits the same way on its own wake-up key
(``keys.HELD_WAKE``, pushed by each hold); while any pool has held requests
it steps every HELD_EVERY_S instead, without listening: their release
follows the provider's room, which nobody announces, and an outage's
admissions would each wake it.

Several pacers may run (one per host): ZREM is the claim, so each due job is
released by exactly one of them; a wake-up wakes one of them, which is
enough.

Stopping: SIGTERM only sets a flag (``StopFlag``) that both loops read after
each step and each wait, so the pacer exits within WAIT_MAX_S plus one step
(the handler runs while the BLPOP waits; the read resumes after it). The
handler must not take a lock: it runs in the main thread between two
bytecodes, and ``threading.Event.set()`` from a handler deadlocks for good
when the main thread was interrupted inside ``Event.wait()`` on the same
event while holding the event's (non-reentrant) lock. A step in progress
finishes: a job taken off the delayed set is released, not dropped."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import close_old_connections

from budgets.admission.keys import ALERT_RETRIES
from budgets.redis.clients import get_redis, redis_now_ms
from budgets.redis.composition import Commands
from budgets.services.alerts import alert_retries_release

from gateway.core import keys
from gateway.core.batches.lifecycle import FEED_EVERY_S, batches_step
from gateway.core.jobs.callbacks import callback_retries_release
from gateway.core.request.enqueue import lane_publish
from gateway.core.protection.held import held_release_call, mark_text
from gateway.core.jobs.lifecycle import job_release
from gateway.core.request.takeover import lost_requests_reap_all

logger = logging.getLogger(__name__)

# The longest wait without a look: bounds a lost wake-up and the stop.
WAIT_MAX_S = 1.0
BATCH = 100
# How often the held pools are looked at while any has held requests. A
# release is paced by the provider's room and a bucket that fills while it
# waits (gateway/core/protection/held_release.lua), so looking a few times a
# second releases as much, in bigger groups.
HELD_EVERY_S = 0.2
# Slices of a plain sleep, so the stop is seen.
PAUSE_SLICE_S = 0.05
# A blocked read may time out up to one server tick late (hz 10; Redis 6
# looks at blocked clients' timeouts on its tick when idle): the pacer
# listens until this much before the head is due and sleeps the rest itself.
REDIS_TICK_S = 0.1
# Whether the last step found running batches: then the pacer looks again
# within FEED_EVERY_S (gateway/core/batches/lifecycle.py).
_batches_active = False
# With none running, the batches are looked at (a database query) only when
# a wake-up came, since a batch that starts or is cancelled pushes one
# (gateway/core/batches/lifecycle.py), and otherwise at most every
# BATCHES_IDLE_LOOK_S: a lost wake-up costs a new batch that long, and an
# idle pacer no query a second.
BATCHES_IDLE_LOOK_S = 10.0
_batches_look_next = 0.0
_woken = False
# When the next sweep for lost workers' requests is due (monotonic clock).
_takeover_next = 0.0


def pacer_step() -> int:
    """Release every job, callback and alert retry due now, feed running
    batches their next lines, and take over lost workers' requests when the
    sweep is due; returns how many jobs and retries this pacer released."""
    global _batches_active
    client = get_redis()
    now_ms = redis_now_ms(client)
    due = client.zrangebyscore(keys.DELAYED_JOBS, "-inf", now_ms, start=0, num=BATCH)
    released = 0
    for job_id in due:
        if client.zrem(keys.DELAYED_JOBS, job_id):
            try:
                job_release(job_id=job_id)
                released += 1
            except Exception:
                # Put it back a second later rather than lose it.
                logger.exception("releasing job %s failed; retrying in 1 s", job_id)
                client.zadd(keys.DELAYED_JOBS, {job_id: now_ms + 1000})
    released += callback_retries_release(now_ms=now_ms) + alert_retries_release(now_ms=now_ms)
    if _batches_look_due():
        _batches_active = batches_step() > 0
    _takeover_step_due()
    return released


def _takeover_step_due() -> int:
    """Ask gateway/core/request/claim.lua about the started requests of
    every pool's lanes, at most every SLUICE_TAKEOVER_SWEEP_S (0: never), and
    take over those whose worker is lost: jobs, and calls whose web process
    is gone too (a waiting web process asks about its own each second). A
    heartbeat lives SLUICE_HEARTBEAT_TTL_S, so such a request moves within
    that, the sweep's period and one wait. Several pacers may sweep: the
    script moves each request once. Returns how many moved. A failure (the
    database or Redis away) is logged and waits for the next sweep: the
    releases of the step do not wait on it."""
    global _takeover_next
    every = settings.SLUICE_TAKEOVER_SWEEP_S
    now = time.monotonic()
    if every <= 0 or now < _takeover_next:
        return 0
    _takeover_next = now + every
    try:
        return lost_requests_reap_all()
    except Exception:
        logger.warning("taking over lost workers' requests failed; the next sweep tries again", exc_info=True)
        return 0


def _batches_look_due() -> bool:
    global _batches_look_next, _woken
    now = time.monotonic()
    if not (_batches_active or _woken or now >= _batches_look_next):
        return False
    _woken = False
    _batches_look_next = now + BATCHES_IDLE_LOOK_S
    return True


def held_step(client) -> tuple[int, bool]:
    """Release held requests on every pool that may have some; returns how
    many went onto their lanes, and whether any pool may still hold some. A
    pool with none left leaves the set of pools to look at (admission puts
    it back with its next held request)."""
    released = 0
    pools = client.smembers(keys.HELD_POOLS)
    for pool_id in pools:
        left, out = held_release_call(pool_id=int(pool_id)).run(client)
        for item in out:
            try:
                lane_publish(request_id=item.request_id, lane=item.lane, task_id=item.request_id,
                             kwargs={"taken": mark_text(item.mark)} if item.mark else {})
                released += 1
            except Exception:  # the broker: its caller hears queue_timeout at its deadline
                logger.exception("releasing held request %s failed", item.request_id)
        if left == 0 and not out:
            client.srem(keys.HELD_POOLS, pool_id)
            # A request held between the script and the SREM put its pool
            # back before the SREM took it out: look once more.
            if client.zcard(keys.pool_held(int(pool_id))):
                client.sadd(keys.HELD_POOLS, pool_id)
    return released, bool(pools) and bool(client.scard(keys.HELD_POOLS))


@dataclass(frozen=True)
class PacerWait:
    """How long the pacer may wait before its next step."""

    seconds: float


def _head_ms(reply) -> float | None:
    """The score of ``ZRANGE key 0 0 WITHSCORES``'s one member: a flat
    [member, score], or [[member, score]] where the client pairs them."""
    if not reply:
        return None
    return float(reply[0][1] if isinstance(reply[0], (list, tuple)) else reply[1])


def pacer_wait(client=None) -> PacerWait:
    """Until the earliest delayed job, callback or alert retry is due (at most
    WAIT_MAX_S). Takes the wake-ups pushed so far in the same round trip as it reads the
    heads: work they announced is in what it reads, and work parked after it
    leaves a wake-up for the wait."""
    global _woken
    client = client or get_redis()
    now_ms = redis_now_ms(client)
    woken, delayed, retries, alerts = (
        Commands()
        .command("DEL", keys.PACER_WAKE)
        .command("ZRANGE", keys.DELAYED_JOBS, 0, 0, "WITHSCORES")
        .command("ZRANGE", keys.CALLBACK_RETRIES, 0, 0, "WITHSCORES")
        .command("ZRANGE", ALERT_RETRIES, 0, 0, "WITHSCORES")
        .run(client))
    seconds = WAIT_MAX_S
    for head_ms in (_head_ms(delayed), _head_ms(retries), _head_ms(alerts)):
        if head_ms is not None:
            seconds = min(seconds, (head_ms - now_ms) / 1000)
    if int(woken):
        _woken = True
    if _batches_active:
        seconds = min(seconds, FEED_EVERY_S)
    return PacerWait(seconds=max(0.0, seconds))


def _wait(wait: PacerWait, stop: StopFlag) -> None:
    global _woken
    if wait.seconds < 0.001 or stop.requested:
        return
    if wait.seconds <= REDIS_TICK_S:
        _pause(wait.seconds, stop)
        return
    if get_redis().blpop([keys.PACER_WAKE], timeout=_listen_s(wait.seconds)) is not None:
        _woken = True


def _listen_s(seconds: float) -> float:
    """A BLPOP's timeout for a wait of ``seconds``: in whole milliseconds (0
    would mean for ever), a server tick short (the next look sleeps what is
    left), and within the client's read timeout (the busy wait, above
    WAIT_MAX_S): a hung Redis fails the read within it, so a stop asked
    meanwhile is seen within seconds, not when Redis answers again."""
    return round(max(min(seconds, settings.SLUICE_REDIS_BUSY_WAIT_S / 2) - REDIS_TICK_S, 0.001), 3)


class StopFlag:
    """Set from a signal handler: a plain attribute write, no lock."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_signal_args) -> None:
        self.requested = True


def _pause(seconds: float, stop: StopFlag) -> None:
    """Sleep up to ``seconds`` in slices of PAUSE_SLICE_S, ending early on stop."""
    deadline = time.monotonic() + seconds
    while not stop.requested:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(PAUSE_SLICE_S, left))


def held_run(*, stop: StopFlag) -> None:
    """The held requests' releases (``held_step``), beside the pacer's loop.
    While any pool holds requests it steps every HELD_EVERY_S; otherwise it
    waits for a hold's wake-up (``keys.HELD_WAKE``), at most WAIT_MAX_S (a
    lost wake-up costs that much, and the stop is seen within it)."""
    client = get_redis()
    while not stop.requested:
        try:
            _, still_held = held_step(client)
            if still_held:
                _pause(HELD_EVERY_S, stop)
            elif not stop.requested:
                client.blpop([keys.HELD_WAKE], timeout=_listen_s(WAIT_MAX_S))
        except Exception:
            logger.exception("releasing held requests failed")
            _pause(1.0, stop)


def held_start(*, stop: StopFlag) -> threading.Thread:
    """``held_run`` on a thread (a daemon: its step ends within a Redis call)."""
    thread = threading.Thread(target=held_run, kwargs={"stop": stop}, name="held-release", daemon=True)
    thread.start()
    return thread


def pacer_run(*, stop: StopFlag) -> None:
    logger.info("pacer running")
    while not stop.requested:
        try:
            released = pacer_step()
            close_old_connections()
            if released == 0 and not stop.requested:
                _wait(pacer_wait(), stop)
        except Exception:
            logger.exception("pacer step failed")
            _pause(1.0, stop)
    logger.info("pacer stopped")
