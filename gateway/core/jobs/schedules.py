"""Cron schedules that produce jobs for scheduled workloads. Each JobSchedule
is mirrored by a django-celery-beat PeriodicTask, so beat fires it and admins
edit it in Django admin."""

from __future__ import annotations

import json
from dataclasses import replace

from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from gateway.core.request.chat import validate_chat_request
from gateway.core.request.context import context_for_workload
from gateway.core.jobs.lifecycle import job_submit
from gateway.core.lanes import HOUSEKEEPING
from gateway.models import JobSchedule

TASK_NAME = "gateway.run_schedule"


@transaction.atomic
def schedule_sync(*, schedule: JobSchedule) -> PeriodicTask:
    """Create or update the PeriodicTask that fires ``schedule``."""
    task = schedule.periodic_task or PeriodicTask(name=f"sluice-schedule-{schedule.pk}")
    task.task = TASK_NAME
    task.crontab = schedule.crontab
    task.interval = None
    task.args = json.dumps([schedule.pk])
    task.enabled = schedule.enabled
    task.queue = HOUSEKEEPING.queue
    task.description = f"Jobs for {schedule.workload} ({schedule.name})"
    task.save()
    if schedule.periodic_task_id != task.pk:
        schedule.periodic_task = task
        schedule.save(update_fields=["periodic_task"])
    return task


def schedule_delete(*, schedule: JobSchedule) -> None:
    task = schedule.periodic_task
    schedule.delete()
    if task is not None:
        task.delete()


def schedule_run(*, schedule_id: int, fired_at=None) -> list[str]:
    """Submit the schedule's jobs for one firing. Idempotency keys name the
    firing minute, so a duplicate beat tick creates nothing twice."""
    schedule = JobSchedule.objects.select_related("workload", "workload__tenant").filter(pk=schedule_id).first()
    if schedule is None or not schedule.enabled:
        return []
    fired_at = fired_at or timezone.now()
    # Its firings are made with the schedule's key: their ledger rows carry it.
    ctx = replace(context_for_workload(schedule.workload), api_key_id=schedule.api_key_id)
    chat = validate_chat_request(dict(schedule.body))
    job_ids = []
    for index in range(schedule.jobs_per_run):
        submitted = job_submit(
            ctx=ctx, chat=chat, body=dict(schedule.body), callback_url=schedule.callback_url,
            idempotency_key=f"schedule-{schedule.pk}-{fired_at:%Y%m%dT%H%M}-{index}",
            deadline_s=schedule.deadline_seconds, schedule_id=schedule.pk,
        )
        job_ids.append(str(submitted.job.id))
    return job_ids
