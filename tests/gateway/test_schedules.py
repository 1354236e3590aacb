"""Cron schedules stored with django-celery-beat produce jobs for a
scheduled workload, once per firing."""

from __future__ import annotations

import time

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from gateway.models import Job, JobSchedule
from gateway.core.jobs.schedules import schedule_run, schedule_sync
from gateway.worker.tasks import run_schedule

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "Enrich record."}], "max_tokens": 20,
        "sim": {"output_tokens": 4}}


def make_schedule(caller, **overrides) -> JobSchedule:
    crontab = CrontabSchedule.objects.create(minute="0", hour="2", day_of_week="*", day_of_month="*",
                                             month_of_year="*")
    schedule = JobSchedule(name=f"nightly-{caller.workload.id}", workload=caller.workload, crontab=crontab,
                           body=BODY, jobs_per_run=3, **overrides)
    schedule.full_clean()
    schedule.save()
    schedule_sync(schedule=schedule)
    return schedule


def test_a_schedule_is_a_beat_periodic_task(make_caller):
    caller = make_caller(workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    schedule = make_schedule(caller)
    task = PeriodicTask.objects.get(name=f"sluice-schedule-{schedule.pk}")
    assert task.task == "gateway.run_schedule"
    assert task.args == f"[{schedule.pk}]"
    assert task.crontab_id == schedule.crontab_id and task.enabled
    # editing the schedule edits the periodic task
    schedule.enabled = False
    schedule.save()
    schedule_sync(schedule=schedule)
    task.refresh_from_db()
    assert task.enabled is False


def test_schedules_only_serve_scheduled_workloads(make_caller):
    caller = make_caller(workload_class="interactive")
    crontab = CrontabSchedule.objects.create(minute="*")
    with pytest.raises(ValidationError):
        JobSchedule(name="x", workload=caller.workload, crontab=crontab, body=BODY).full_clean()
    scheduled = make_caller(workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    with pytest.raises(ValidationError):
        JobSchedule(name="y", workload=scheduled.workload, crontab=crontab, body={"messages": []}).full_clean()
    # a schedule's jobs cannot stream (jobs do not)
    with pytest.raises(ValidationError) as excinfo:
        JobSchedule(name="z", workload=scheduled.workload, crontab=crontab, body={**BODY, "stream": True}).full_clean()
    assert "do not stream" in str(excinfo.value)
    JobSchedule(name="w", workload=scheduled.workload, crontab=crontab, body={**BODY, "stream": False}).full_clean()


def test_a_firing_creates_its_jobs_once(make_caller):
    caller = make_caller(workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    schedule = make_schedule(caller)
    fired_at = timezone.now()
    first = schedule_run(schedule_id=schedule.pk, fired_at=fired_at)
    again = schedule_run(schedule_id=schedule.pk, fired_at=fired_at)  # a duplicate beat tick
    assert len(first) == 3 and first == again
    assert Job.objects.filter(schedule=schedule).count() == 3


def test_beat_task_runs_on_a_worker_and_its_jobs_complete(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    schedule = make_schedule(caller)
    run_schedule.delay(schedule.pk)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        statuses = list(Job.objects.filter(schedule=schedule).values_list("status", flat=True))
        if len(statuses) == 3 and set(statuses) == {"succeeded"}:
            break
        time.sleep(0.2)
    assert sorted(statuses) == ["succeeded"] * 3


def test_a_schedules_key_must_be_its_workloads_and_new_ones_name_one(make_caller):
    from gateway.admin import JobScheduleForm
    from tenants.models import ApiKey

    caller = make_caller(workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    other = make_caller(workload_class="scheduled", prompt_tokens_cap=100, max_tokens_cap=100)
    crontab = CrontabSchedule.objects.create(minute="*")
    # another workload's key is refused
    with pytest.raises(ValidationError) as excinfo:
        JobSchedule(name="k", workload=caller.workload, crontab=crontab, body=BODY,
                    api_key=ApiKey.objects.get(workload=other.workload)).full_clean()
    assert excinfo.value.message_dict == {"api_key": ["The key must belong to the schedule's workload."]}
    # Django admin's form asks a new schedule for its key
    data = {"name": "nightly", "workload": caller.workload.id, "crontab": crontab.id, "body": '{"model": "sim-small", '
            '"messages": [{"role": "user", "content": "x"}]}', "jobs_per_run": 1, "deadline_seconds": 60, "enabled": "on"}
    form = JobScheduleForm(data=data)
    assert form.is_valid() is False and list(form.errors) == ["api_key"]
    form = JobScheduleForm(data={**data, "api_key": ApiKey.objects.get(workload=caller.workload).id})
    assert form.is_valid(), form.errors
