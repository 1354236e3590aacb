"""Beat's table loses the two entries the pacer took over (gateway/worker/pacer.py).

django-celery-beat copies ``beat_schedule`` into its table and never deletes
a row that left it: without this, an upgraded install would keep sending both
tasks every 5 s beside the pacer's own sweeps. The tasks stay registered
(their names are kept for a run by hand), so a beat still running the old
table until its restart sends nothing that fails."""

from django.db import migrations
from django.utils import timezone

MOVED = {"take-over-lost-requests": "gateway.take_over_lost_requests",
         "release-alert-retries": "budgets.release_alert_retries"}


def forwards(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    deleted = 0
    for name, task in MOVED.items():
        deleted += PeriodicTask.objects.filter(name=name, task=task).delete()[0]
    if deleted:
        # The change stamp a running beat reads to reload its schedule.
        PeriodicTasks.objects.update_or_create(ident=1, defaults={"last_update": timezone.now()})


class Migration(migrations.Migration):

    dependencies = [
        ("gateway", "0005_batch_api"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    # Backwards: nothing to put back; an older beat_schedule re-creates its rows at beat's start.
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
