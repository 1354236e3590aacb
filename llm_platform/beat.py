"""Beat's scheduler: django-celery-beat's, asking the database whether the
schedule changed at most every CHANGE_CHECK_S.

The stock DatabaseScheduler asks on every tick (a commit and a query of
PeriodicTasks' change stamp), and beat ticks twice for each task it sends
(the send, then the look at the next entry) besides every wake-up: with the
housekeeping entries of llm_platform/celery.py that check was most of an
idle beat's CPU, and beat the largest share of the idle platform's. The
schedule itself changes only when a scheduled workload's cron is saved
(gateway/core/jobs/schedules.py) or an admin edits a periodic task, and
beat already sleeps up to its ``max_interval`` (5 s) between looks: a
change is picked up within CHANGE_CHECK_S plus one such sleep, and the
stock scheduler's full reload every 5 minutes still runs."""

from __future__ import annotations

import time

from django_celery_beat.schedulers import DatabaseScheduler

CHANGE_CHECK_S = 5.0


class PacedDatabaseScheduler(DatabaseScheduler):
    """DatabaseScheduler whose change check runs at most every CHANGE_CHECK_S."""

    def __init__(self, *args, **kwargs) -> None:
        self.change_checked_at: float | None = None
        super().__init__(*args, **kwargs)

    def schedule_changed(self) -> bool:
        now = time.monotonic()
        if self.change_checked_at is not None and now - self.change_checked_at < CHANGE_CHECK_S:
            return False
        self.change_checked_at = now
        return super().schedule_changed()
