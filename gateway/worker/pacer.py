"""The pacer: moves due jobs from the delayed sorted set onto their lanes,
and due job-callback retries onto the housekeeping lane.

Several pacers may run (one per host): ZREM is the claim, so each due job is
released by exactly one of them. It sleeps until the earliest release, never
longer than MAX_SLEEP_S (new jobs may be due sooner)."""

from __future__ import annotations

import logging
import threading

from django.db import close_old_connections

from budgets.admission.redis_client import get_redis, redis_now_ms

from gateway.core import keys
from gateway.core.callbacks import callback_retries_release
from gateway.core.jobs import job_release

logger = logging.getLogger(__name__)

MAX_SLEEP_S = 0.05
BATCH = 100


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
    return released + callback_retries_release(now_ms=now_ms)


def pacer_sleep_s() -> float:
    client = get_redis()
    head = client.zrange(keys.DELAYED_JOBS, 0, 0, withscores=True)
    if not head:
        return MAX_SLEEP_S
    wait = (head[0][1] - redis_now_ms(client)) / 1000
    return min(MAX_SLEEP_S, max(0.001, wait))


def pacer_run(*, stop: threading.Event) -> None:
    logger.info("pacer running")
    while not stop.is_set():
        try:
            if pacer_step() == 0:
                stop.wait(pacer_sleep_s())
            close_old_connections()
        except Exception:
            logger.exception("pacer step failed")
            stop.wait(1.0)
