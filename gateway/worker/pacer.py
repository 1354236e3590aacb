"""The pacer: moves due jobs from the delayed sorted set onto their lanes,
due job-callback retries onto the housekeeping lane, and requests held
through an outage onto their lanes as the provider makes room for them
(gateway/core/protection/held.py).

Several pacers may run (one per host): ZREM is the claim, so each due job is
released by exactly one of them. It sleeps until the earliest release, never
longer than MAX_SLEEP_S (new jobs may be due sooner).

Stopping: SIGTERM only sets a flag (``StopFlag``) that the loop reads between
steps, so the pacer exits within MAX_SLEEP_S plus one step. The handler must
not take a lock: it runs in the main thread between two bytecodes, and
``threading.Event.set()`` from a handler deadlocks for good when the main
thread was interrupted inside ``Event.wait()`` on the same event while
holding the event's (non-reentrant) lock. A step in progress finishes: a job
taken off the delayed set is released, not dropped."""

from __future__ import annotations

import logging
import time

from django.db import close_old_connections

from budgets.redis.clients import get_redis, redis_now_ms

from gateway.core import keys
from gateway.core.jobs.callbacks import callback_retries_release
from gateway.core.request.enqueue import lane_publish
from gateway.core.protection.held import held_release_call, mark_text
from gateway.core.jobs.lifecycle import job_release

logger = logging.getLogger(__name__)

MAX_SLEEP_S = 0.05
BATCH = 100
# How often the held pools are looked at. A release is paced by the
# provider's room and a bucket that fills while it waits
# (gateway/core/protection/held_release.lua), so looking every few steps releases as
# much, in bigger groups, and spares Redis a SMEMBERS on every idle step.
HELD_EVERY_S = 0.2
_held_next = 0.0


def pacer_step() -> int:
    """Release every job and callback retry due now; returns how many this pacer released."""
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
    return released + callback_retries_release(now_ms=now_ms) + _held_step_due(client)


def _held_step_due(client) -> int:
    global _held_next
    now = time.monotonic()
    if now < _held_next:
        return 0
    _held_next = now + HELD_EVERY_S
    return held_step(client)


def held_step(client) -> int:
    """Release held requests on every pool that may have some; returns how
    many went onto their lanes. A pool with none left leaves the set of
    pools to look at (admission puts it back with its next held request)."""
    released = 0
    for pool_id in client.smembers(keys.HELD_POOLS):
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
    return released


def pacer_sleep_s() -> float:
    client = get_redis()
    head = client.zrange(keys.DELAYED_JOBS, 0, 0, withscores=True)
    if not head:
        return MAX_SLEEP_S
    wait = (head[0][1] - redis_now_ms(client)) / 1000
    return min(MAX_SLEEP_S, max(0.001, wait))


class StopFlag:
    """Set from a signal handler: a plain attribute write, no lock."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_signal_args) -> None:
        self.requested = True


def _pause(seconds: float, stop: StopFlag) -> None:
    """Sleep up to ``seconds`` in slices of MAX_SLEEP_S, ending early on stop."""
    deadline = time.monotonic() + seconds
    while not stop.requested:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(MAX_SLEEP_S, left))


def pacer_run(*, stop: StopFlag) -> None:
    logger.info("pacer running")
    while not stop.requested:
        try:
            if pacer_step() == 0:
                _pause(pacer_sleep_s(), stop)
            close_old_connections()
        except Exception:
            logger.exception("pacer step failed")
            _pause(1.0, stop)
    logger.info("pacer stopped")
