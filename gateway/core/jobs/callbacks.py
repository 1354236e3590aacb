"""Job callbacks: how a finished job's callback attempts are put on the
housekeeping lane and retried with backoff. The URL guard (SSRF) and the
signature are tenants.outbound's, shared with alert webhooks; the worker side
(gateway/worker/callbacks.py) sends them."""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

from budgets.redis.clients import get_redis, parked_release, redis_now_ms
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.lanes import HOUSEKEEPING
from gateway.core.pacer_wake import pacer_wake_commands
from tenants.outbound import (MAX_URL_LENGTH, SIGNATURE_HEADER, CallbackRefused, CallbackTarget, address_refusal, callback_signature, callback_signature_verify,
                              callback_target_resolve, callback_url_check, callback_url_parse, resolve_host,
                              webhook_backoff_s)

logger = logging.getLogger(__name__)

# The guard and signature, named here too for callers that know them as job callbacks'.
__all__ = ["MAX_URL_LENGTH", "SIGNATURE_HEADER", "CallbackRefused", "CallbackTarget", "address_refusal",
           "callback_signature", "callback_signature_verify", "callback_target_resolve", "callback_url_check",
           "callback_url_parse", "resolve_host", "DELIVER_CALLBACK_TASK", "callback_backoff_s", "callback_enqueue",
           "callback_retry_schedule", "callback_retries_release"]

# The worker side's task (gateway/worker/tasks.py), enqueued by name.
DELIVER_CALLBACK_TASK = "gateway.deliver_callback"


# --- attempts -------------------------------------------------------------------------------


def callback_backoff_s(*, failed_attempt: int) -> float:
    return webhook_backoff_s(failed_attempt=failed_attempt)


def _send(job_id: str, attempt: int) -> None:
    current_app.send_task(DELIVER_CALLBACK_TASK, args=[job_id, attempt], queue=HOUSEKEEPING.queue)


def callback_enqueue(*, job_id: str) -> None:
    """Put a finished job's first callback attempt on the housekeeping lane,
    once the transaction that finished it commits."""

    def send() -> None:
        try:
            _send(job_id, 1)
        except Exception:  # the broker: leave it to the pacer rather than lose it
            logger.warning("could not enqueue the callback of job %s; the pacer will", job_id, exc_info=True)
            try:
                callback_retry_schedule(job_id=job_id, attempt=1, delay_s=1.0)
            except Exception:  # Redis is the broker here: both are away
                logger.error("callback of job %s lost: neither broker nor Redis answered", job_id, exc_info=True)

    transaction.on_commit(send)


def callback_retry_schedule(*, job_id: str, attempt: int, delay_s: float) -> float:
    """Park attempt ``attempt`` in Redis until ``delay_s`` from now (on
    Redis's clock); returns when (ms). Never Celery countdown: with the Redis
    broker a task held past visibility_timeout is delivered twice."""
    client = get_redis()
    due_ms = redis_now_ms(client) + delay_s * 1000
    parked = Commands().zadd(keys.CALLBACK_RETRIES, {f"{job_id}:{attempt}": due_ms})
    pacer_wake_commands(parked)  # it may be due before the pacer's next look
    parked.run(client)
    return due_ms


def callback_retries_release(*, now_ms: float, limit: int = 100) -> int:
    """The pacer's step for callbacks: enqueue every due attempt (ZREM is the
    claim, so several pacers send each once); returns how many."""
    def send(member: str) -> None:
        job_id, _, attempt = member.rpartition(":")
        _send(job_id, int(attempt))

    return parked_release(key=keys.CALLBACK_RETRIES, now_ms=now_ms, send=send, what="callback", limit=limit)
