"""The "Finance auditors" group: its members read every tenant's usage, spend
and ledger and change nothing. Add a user to it in Django admin."""

from django.contrib.auth.management import create_permissions
from django.db import migrations

GROUP = "Finance auditors"


def forwards(apps, schema_editor):
    # Permissions are normally created after all migrations ran; this one is
    # needed now.
    tenants_config = apps.get_app_config("tenants")
    tenants_config.models_module = True
    create_permissions(tenants_config, apps=apps, verbosity=0)
    tenants_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    group, _ = Group.objects.get_or_create(name=GROUP)
    group.permissions.add(Permission.objects.get(content_type__app_label="tenants", codename="audit_all_tenants"))


def backwards(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name=GROUP).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0002_finance_auditor_permission"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]
    operations = [migrations.RunPython(forwards, backwards)]
