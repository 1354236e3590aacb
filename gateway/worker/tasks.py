"""The worker side's Celery tasks. Thin: each takes ids and calls one
function. Names are stable (the web side enqueues by name, beat schedules
name them), whatever module the code lives in."""

from __future__ import annotations

import logging
import time

from celery import shared_task
from celery.exceptions import Reject
from django.conf import settings
from django.db import close_old_connections

from budgets.models import InferencePool
from gateway.core.batches.lifecycle import FINALIZE_TASK, VALIDATE_TASK, batch_finalize, batch_validate
from gateway.core.jobs.callbacks import DELIVER_CALLBACK_TASK
from gateway.core.request.enqueue import EXECUTE_REQUEST_TASK, CallHint
from gateway.core.protection.held import mark_parse
from gateway.core.db_threads import DATABASE_AWAY
from gateway.core.key_usage import key_last_used_flush
from gateway.core.log_context import log_context
from gateway.core.jobs.schedules import TASK_NAME as RUN_SCHEDULE_TASK
from gateway.core.jobs.schedules import schedule_run
from gateway.core.request.takeover import lost_requests_reap_all
from gateway.worker.callbacks import callback_deliver
from gateway.worker.execution import REDIS_AWAY, leases_reap, request_execute
from gateway.worker.shutdown import HandBack, pause

logger = logging.getLogger(__name__)

# Redis away: the request's record, its buckets and (with the Redis broker)
# the queue itself are there. Celery's own retry would have to publish a new
# message to that same Redis, and a publish that fails drops the message; so
# the task waits for Redis itself, holding its unacknowledged message (a
# worker that dies meanwhile has it redelivered). Any other failure is the
# request's own: request_execute settles and answers it (worker_error).
REDIS_WAIT_FIRST_S = 0.25
REDIS_WAIT_MAX_S = 5.0


# A task whose every step is idempotent: acknowledged only when done (a
# worker that dies has it redelivered), and run again with short, capped
# backoff while PostgreSQL is away.
IDEMPOTENT_TASK = dict(acks_late=True, reject_on_worker_lost=True, ignore_result=True, autoretry_for=DATABASE_AWAY,
                       retry_backoff=1, retry_backoff_max=30, retry_jitter=True)


# A database restart must not lose an accepted request (the pool is not called
# twice: its answer is kept in Redis). Redis restarting or hanging is waited
# out in the task (below).
@shared_task(name=EXECUTE_REQUEST_TASK, max_retries=40, **IDEMPOTENT_TASK)
def execute_request(request_id: str, generation: int = 0, taken: str = "", call: str = "") -> str:
    """Run one delivery of an admitted request (the record lives in Redis,
    keyed by id; ``generation`` > 0: taken over from a lost worker;
    ``taken``: the provider room its release from the held set took,
    gateway/core/protection/held.py; ``call``: its pool call's hint, gateway/core/request/enqueue.py)."""
    close_old_connections()  # a connection broken by a database restart is replaced
    give_up_at = time.monotonic() + settings.SLUICE_TASK_TIME_LIMIT_S * 0.8
    answered: dict = {}
    wait_s = REDIS_WAIT_FIRST_S
    with log_context(request_id=request_id):
        while True:
            try:
                return request_execute(request_id=request_id, generation=generation, answered=answered,
                                       taken=mark_parse(taken), call=CallHint.parse(call) if call else None)
            except HandBack:
                # The worker is stopping (gateway/worker/shutdown.py): the
                # message goes back to the head of its queue now, not after
                # the broker's visibility timeout.
                raise Reject("worker stopping: handed back", requeue=True)
            except REDIS_AWAY as exc:
                if time.monotonic() + wait_s > give_up_at:
                    raise
                logger.warning("request %s: Redis unavailable (%s); trying again in %.2fs", request_id, exc, wait_s)
                if not pause(wait_s):
                    # Stopping with Redis away: the message stays unacknowledged
                    # there and comes back after the visibility timeout.
                    raise
                wait_s = min(REDIS_WAIT_MAX_S, wait_s * 2)


@shared_task(name="gateway.reap_leases", ignore_result=True)
def reap_leases() -> int:
    return leases_reap(pool_ids=list(InferencePool.objects.values_list("id", flat=True)))


@shared_task(name="gateway.take_over_lost_requests", ignore_result=True)
def take_over_lost_requests() -> int:
    """Requests of lost workers that no web process watches (jobs, or a web
    host lost too): the waiting web process handles its own each second.
    The pacer sweeps every 5 s (gateway/worker/pacer.py); the task is kept
    for a run by hand."""
    return lost_requests_reap_all()


@shared_task(name="gateway.flush_key_last_used", ignore_result=True)
def flush_key_last_used() -> int:
    """API keys' last use, noted by the web processes in Redis, to the database."""
    return key_last_used_flush()


@shared_task(name=RUN_SCHEDULE_TASK, ignore_result=True)
def run_schedule(schedule_id: int) -> int:
    return len(schedule_run(schedule_id=schedule_id))


# One attempt is one delivery-log row. The receiver failing is not retried
# here: the next attempt waits in Redis (gateway/core/jobs/callbacks.py).
@shared_task(name=DELIVER_CALLBACK_TASK, max_retries=10, **IDEMPOTENT_TASK)
def deliver_callback(job_id: str, attempt: int = 1) -> str:
    """One attempt at a finished job's callback (queue: the housekeeping lane)."""
    close_old_connections()
    return callback_deliver(job_id=job_id, attempt=attempt)


# A batch's validation and finalization: each runs under its batch row's
# lock and does nothing once done, so a redelivery is harmless.
@shared_task(name=VALIDATE_TASK, max_retries=10, **IDEMPOTENT_TASK)
def validate_batch(batch_id: str) -> str:
    close_old_connections()
    return batch_validate(batch_id=batch_id)


@shared_task(name=FINALIZE_TASK, max_retries=10, **IDEMPOTENT_TASK)
def finalize_batch(batch_id: str) -> str:
    close_old_connections()
    return batch_finalize(batch_id=batch_id)
