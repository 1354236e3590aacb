"""A member may withdraw a pending budget request: the status and event
choices gain "withdrawn", and on PostgreSQL the request guard of 0004 lets
pending -> withdrawn through (nothing else changes in it)."""

from django.db import migrations, models

GUARD = """
CREATE OR REPLACE FUNCTION sluice_budget_request_guard() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'budgets_budgetrequest is audit history: DELETE refused';
    END IF;
    IF (NEW.tenant_id, NEW.requested_by_id, NEW.pool_id, NEW.new_workload_name, NEW.new_workload_class,
        NEW.reserved_tpm, NEW.ceiling_tpm, NEW.rpm, NEW.lend_fraction, NEW.monthly_spend_budget,
        NEW.spend_soft_threshold, NEW.spend_hard_cap, NEW.justification, NEW.ends_on, NEW.created_at)
       IS DISTINCT FROM
       (OLD.tenant_id, OLD.requested_by_id, OLD.pool_id, OLD.new_workload_name, OLD.new_workload_class,
        OLD.reserved_tpm, OLD.ceiling_tpm, OLD.rpm, OLD.lend_fraction, OLD.monthly_spend_budget,
        OLD.spend_soft_threshold, OLD.spend_hard_cap, OLD.justification, OLD.ends_on, OLD.created_at) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: what was requested cannot change';
    END IF;
    IF OLD.workload_id IS NOT NULL AND NEW.workload_id IS DISTINCT FROM OLD.workload_id THEN
        RAISE EXCEPTION 'budgets_budgetrequest: the workload cannot change once set';
    END IF;
    IF NOT ((OLD.status = NEW.status)
            OR (OLD.status = 'pending' AND NEW.status IN ('approved', 'rejected', 'withdrawn'))
            OR (OLD.status = 'approved' AND NEW.status = 'expired')) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: %% -> %% refused', OLD.status, NEW.status;
    END IF;
    IF OLD.decided_at IS NOT NULL
       AND (NEW.decided_by_id, NEW.decided_at, NEW.decision_comment)
           IS DISTINCT FROM (OLD.decided_by_id, OLD.decided_at, OLD.decision_comment) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: a decision cannot be rewritten';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""
GUARD_BEFORE = """
CREATE OR REPLACE FUNCTION sluice_budget_request_guard() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'budgets_budgetrequest is audit history: DELETE refused';
    END IF;
    IF (NEW.tenant_id, NEW.requested_by_id, NEW.pool_id, NEW.new_workload_name, NEW.new_workload_class,
        NEW.reserved_tpm, NEW.ceiling_tpm, NEW.rpm, NEW.lend_fraction, NEW.monthly_spend_budget,
        NEW.spend_soft_threshold, NEW.spend_hard_cap, NEW.justification, NEW.ends_on, NEW.created_at)
       IS DISTINCT FROM
       (OLD.tenant_id, OLD.requested_by_id, OLD.pool_id, OLD.new_workload_name, OLD.new_workload_class,
        OLD.reserved_tpm, OLD.ceiling_tpm, OLD.rpm, OLD.lend_fraction, OLD.monthly_spend_budget,
        OLD.spend_soft_threshold, OLD.spend_hard_cap, OLD.justification, OLD.ends_on, OLD.created_at) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: what was requested cannot change';
    END IF;
    IF OLD.workload_id IS NOT NULL AND NEW.workload_id IS DISTINCT FROM OLD.workload_id THEN
        RAISE EXCEPTION 'budgets_budgetrequest: the workload cannot change once set';
    END IF;
    IF NOT ((OLD.status = NEW.status)
            OR (OLD.status = 'pending' AND NEW.status IN ('approved', 'rejected'))
            OR (OLD.status = 'approved' AND NEW.status = 'expired')) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: %% -> %% refused', OLD.status, NEW.status;
    END IF;
    IF OLD.decided_at IS NOT NULL
       AND (NEW.decided_by_id, NEW.decided_at, NEW.decision_comment)
           IS DISTINCT FROM (OLD.decided_by_id, OLD.decided_at, OLD.decision_comment) THEN
        RAISE EXCEPTION 'budgets_budgetrequest: a decision cannot be rewritten';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(GUARD)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(GUARD_BEFORE)


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0007_request_log_key_indexes_reservation_history'),
    ]

    operations = [
        migrations.AlterField(
            model_name='budgetrequest',
            name='status',
            field=models.CharField(choices=[('pending', 'Pending'), ('approved', 'Approved'), ('rejected', 'Rejected'), ('expired', 'Expired'), ('withdrawn', 'Withdrawn')], db_index=True, default='pending', max_length=20),
        ),
        migrations.AlterField(
            model_name='budgetrequestevent',
            name='action',
            field=models.CharField(choices=[('submitted', 'Submitted'), ('approved', 'Approved'), ('rejected', 'Rejected'), ('expired', 'Expired'), ('withdrawn', 'Withdrawn')], max_length=20),
        ),
        migrations.RunPython(forwards, backwards),
    ]
