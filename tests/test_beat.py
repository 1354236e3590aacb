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
