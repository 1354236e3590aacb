"""Beat's scheduler (llm_platform/beat.py) asks the database whether the
schedule changed at most every CHANGE_CHECK_S, and still sees a change once
that has passed. Against the real database: the change stamp is
django-celery-beat's own row, written when a periodic task is saved."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from llm_platform import beat
from llm_platform.beat import PacedDatabaseScheduler
from llm_platform.celery import app

pytestmark = pytest.mark.django_db(transaction=True)


def test_beat_reads_the_schedule_change_stamp_at_most_every_change_check_and_sees_a_change_after_it(monkeypatch):
    # given a schedule with a change stamp, and a scheduler that has just
    # looked at it (the clock is beat's: monotonic)
    every = IntervalSchedule.objects.create(every=30, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="beat-test-first", task="gateway.reap_leases", interval=every)
    clock = [1_000.0]
    monkeypatch.setattr(beat.time, "monotonic", lambda: clock[0])
    scheduler = PacedDatabaseScheduler(app=app, lazy=True)
    with CaptureQueriesContext(connection) as first:
        assert scheduler.schedule_changed() is False
    assert len(first.captured_queries) >= 1
    # when a periodic task is saved (the stamp moves) and beat ticks again within CHANGE_CHECK_S
    PeriodicTask.objects.create(name="beat-test-second", task="gateway.reap_leases", interval=every)
    clock[0] += beat.CHANGE_CHECK_S - 0.5
    with CaptureQueriesContext(connection) as within:
        changed_within = scheduler.schedule_changed()
    # then it asked the database nothing and saw no change yet
    assert (changed_within, len(within.captured_queries)) == (False, 0)
    # when CHANGE_CHECK_S has passed since its last look
    clock[0] += 0.5
    # then it reads the stamp again and sees the change, once
    assert scheduler.schedule_changed() is True
    clock[0] += beat.CHANGE_CHECK_S
    assert scheduler.schedule_changed() is False


def test_the_entries_the_pacer_took_over_leave_beats_table_and_the_rest_stay():
    # given an install upgraded from a beat_schedule that still had the two
    # entries (django-celery-beat copied them into its table and never deletes
    # a row), beside an entry beat still sends
    from importlib import import_module

    from django.apps import apps
    from django_celery_beat.models import PeriodicTasks

    moved = import_module("gateway.migrations.0006_beat_entries_to_pacer")
    every = IntervalSchedule.objects.create(every=5, period=IntervalSchedule.SECONDS)
    for name, task in moved.MOVED.items():
        PeriodicTask.objects.update_or_create(name=name, defaults={"task": task, "interval": every})
    PeriodicTask.objects.update_or_create(name="reap-leases", defaults={"task": "gateway.reap_leases",
                                                                        "interval": every})
    stamp = PeriodicTasks.last_change()
    # when the migration runs
    moved.forwards(apps, None)
    # then the pacer's two are gone, the other stays, and a running beat's
    # change check sees the schedule moved
    names = set(PeriodicTask.objects.values_list("name", flat=True))
    assert not names & set(moved.MOVED) and "reap-leases" in names
    assert PeriodicTasks.last_change() > stamp
    # and beat_schedule does not put them back at beat's next start, while
    # their tasks stay registered for a run by hand
    assert not set(moved.MOVED) & set(app.conf.beat_schedule)
    import budgets.tasks  # noqa: F401 (registers its tasks)
    import gateway.worker.tasks  # noqa: F401

    assert set(moved.MOVED.values()) <= set(app.tasks)
