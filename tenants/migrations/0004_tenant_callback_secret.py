"""Each tenant gets its own job-callback signing secret. Added nullable,
filled one fresh secret per existing tenant (a callable default would give
them all the same one), then made required."""

from django.db import migrations, models

import tenants.keys


def fill_secrets(apps, schema_editor):
    Tenant = apps.get_model("tenants", "Tenant")
    for tenant in Tenant.objects.filter(callback_secret__isnull=True).only("pk"):
        Tenant.objects.filter(pk=tenant.pk).update(callback_secret=tenants.keys.callback_secret_generate())


class Migration(migrations.Migration):
    dependencies = [("tenants", "0003_finance_auditors_group")]

    operations = [
        migrations.AddField(
            model_name="tenant", name="callback_secret",
            field=models.CharField(max_length=100, null=True, editable=False),
        ),
        migrations.RunPython(fill_secrets, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="tenant", name="callback_secret",
            field=models.CharField(
                default=tenants.keys.callback_secret_generate, editable=False, max_length=100,
                help_text="Signs this tenant's job callbacks (X-Sluice-Signature). Rotate it from the tenant page or API.",
            ),
        ),
        migrations.AddField(
            model_name="tenant", name="callback_secret_rotated_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
    ]
