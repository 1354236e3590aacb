"""On PostgreSQL, refuse UPDATE and DELETE on the ledger below the ORM, so no
interface (admin, API, a stray script) can rewrite history. TRUNCATE, which
only an operator runs, is left alone (test databases are reset with it)."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION sluice_ledger_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'budgets_usagerecord is append-only: %% refused', TG_OP;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS sluice_ledger_append_only ON budgets_usagerecord;
CREATE TRIGGER sluice_ledger_append_only
    BEFORE UPDATE OR DELETE ON budgets_usagerecord
    FOR EACH ROW EXECUTE FUNCTION sluice_ledger_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS sluice_ledger_append_only ON budgets_usagerecord;
DROP FUNCTION IF EXISTS sluice_ledger_append_only();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("budgets", "0001_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
