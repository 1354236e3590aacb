"""Sending a job's callback: one attempt per task, each checked, signed and
logged (JobCallbackDelivery); a failed attempt parks the next one in Redis
with exponential backoff (gateway/core/jobs/callbacks.py) until the attempts run
out. At least once: a receiver that must not act twice dedupes on the job id
(the body's ``id``) and the X-Sluice-Attempt header."""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone as dt_timezone

import httpx
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from gateway.core.jobs.callbacks import callback_backoff_s, callback_retry_schedule
from tenants.outbound import (SIGNATURE_HEADER, CallbackRefused, callback_signature, callback_target_resolve,
                              outbound_post)
from gateway.core.jobs.lifecycle import job_view
from gateway.models import Job, JobCallbackDelivery

logger = logging.getLogger(__name__)

USER_AGENT = "Sluice-Callbacks/1"


def _log(job: Job, *, attempt: int, at: datetime, started: float, address: str | None = None,
         status_code: int | None = None, error: str = "", next_attempt_at: datetime | None = None) -> None:
    delivered = status_code is not None and 200 <= status_code < 300
    try:
        with transaction.atomic():
            JobCallbackDelivery.objects.create(
                job=job, attempt=attempt, at=at, address=address, status_code=status_code, error=error[:500],
                delivered=delivered, duration_ms=max(0, int((time.monotonic() - started) * 1000)),
                next_attempt_at=next_attempt_at,
            )
            # In the same transaction: whoever sees the attempt sees its status.
            Job.objects.filter(pk=job.pk).update(callback_status=status_code if status_code is not None else 0)
    except IntegrityError:  # a redelivered task that got this far before: logged once
        return


def _retry_at(job_id: str, attempt: int) -> datetime | None:
    """Schedule attempt + 1 if there is one; when it is due."""
    if attempt >= settings.SLUICE_CALLBACK_MAX_ATTEMPTS:
        return None
    delay_s = callback_backoff_s(failed_attempt=attempt)
    due_ms = callback_retry_schedule(job_id=job_id, attempt=attempt + 1, delay_s=delay_s)
    return datetime.fromtimestamp(due_ms / 1000, tz=dt_timezone.utc)


def callback_deliver(*, job_id: str, attempt: int) -> str:
    """Make attempt ``attempt`` of the job's callback. Idempotent per
    (job, attempt): a redelivered task finds its log row and stops."""
    job = Job.objects.select_related("workload", "tenant").filter(pk=job_id).first()
    if job is None or not job.callback_url:
        return "skipped"
    done = JobCallbackDelivery.objects.filter(job=job)
    if done.filter(attempt=attempt).exists() or done.filter(delivered=True).exists():
        return "duplicate"
    at = timezone.now()
    started = time.monotonic()
    try:
        # Checked again now: the URL was checked at submission, but DNS may
        # answer differently today (or was made to).
        target = callback_target_resolve(url=job.callback_url)
    except CallbackRefused as refused:
        retry_at = _retry_at(job_id, attempt) if refused.retryable else None
        _log(job, attempt=attempt, at=at, started=started, error=f"refused: {refused.message}",
             next_attempt_at=retry_at)
        logger.warning("callback of job %s refused: %s", job_id, refused.message)
        return "refused"
    body = json.dumps(job_view(job, with_callback=False), separators=(",", ":")).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        SIGNATURE_HEADER: callback_signature(secret=job.tenant.callback_secret, timestamp=int(time.time()), body=body),
        "X-Sluice-Job-Id": str(job.id),
        "X-Sluice-Attempt": str(attempt),
    }
    try:
        status_code, error = outbound_post(target, body=body, headers=headers), ""
    except httpx.HTTPError as exc:
        status_code, error = None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if status_code is not None and 200 <= status_code < 300:
        _log(job, attempt=attempt, at=at, started=started, address=target.address, status_code=status_code)
        return "delivered"
    if status_code is not None:
        error = f"HTTP {status_code}"
    retry_at = _retry_at(job_id, attempt)
    _log(job, attempt=attempt, at=at, started=started, address=target.address, status_code=status_code, error=error,
         next_attempt_at=retry_at)
    logger.info("callback of job %s, attempt %s failed (%s)%s", job_id, attempt, error,
                f"; next at {retry_at:%H:%M:%S}" if retry_at else "; giving up")
    return "failed"
