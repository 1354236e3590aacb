"""The ledger is append-only below the UI: the ORM refuses updates and
deletes, the admin offers no change or delete, and PostgreSQL's trigger
refuses them from raw SQL (any client)."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

import pytest
from django.contrib.admin.sites import site
from django.db import DatabaseError, connection, transaction
from django.test import RequestFactory

from budgets.models import LedgerImmutable, UsageRecord
from tests.people import build_world, ledger_add, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def row(redis_client):
    world = build_world()
    ledger_add(workload=world.wl_a, pool=world.pool, at=datetime(2026, 11, 2, 12, tzinfo=dt_timezone.utc))
    return UsageRecord.objects.get()


def test_saving_an_existing_row_raises(row):
    row.actual_output_tokens = 1
    with pytest.raises(LedgerImmutable):
        row.save()
    assert UsageRecord.objects.get().actual_output_tokens == 50


def test_deleting_a_row_raises(row):
    with pytest.raises(LedgerImmutable):
        row.delete()
    assert UsageRecord.objects.count() == 1


def test_queryset_update_and_delete_raise(row):
    with pytest.raises(LedgerImmutable):
        UsageRecord.objects.filter(pk=row.pk).update(cost=0)
    with pytest.raises(LedgerImmutable):
        UsageRecord.objects.all().delete()
    assert UsageRecord.objects.count() == 1


def test_admin_offers_no_add_change_or_delete(row):
    # given a superuser, who holds every permission
    request = RequestFactory().get("/admin/budgets/usagerecord/")
    request.user = make_user("root-ledger", superuser=True)
    model_admin = site.get_model_admin(UsageRecord)
    # then the admin still refuses every write
    assert model_admin.has_add_permission(request) is False
    assert model_admin.has_change_permission(request, row) is False
    assert model_admin.has_delete_permission(request, row) is False
    assert "delete_selected" not in model_admin.get_actions(request)


def test_admin_change_form_post_is_forbidden(client, row):
    client.force_login(make_user("root-ledger-post", superuser=True))
    response = client.post(f"/admin/budgets/usagerecord/{row.pk}/change/", {"cost": "0"})
    assert response.status_code == 403
    response = client.post(f"/admin/budgets/usagerecord/{row.pk}/delete/", {"post": "yes"})
    assert response.status_code == 403
    assert UsageRecord.objects.get().cost == row.cost


@pytest.mark.parametrize("sql", [
    "UPDATE budgets_usagerecord SET cost = 0",
    "UPDATE budgets_usagerecord SET actual_output_tokens = actual_output_tokens + 1",
    "DELETE FROM budgets_usagerecord",
])
def test_raw_sql_update_and_delete_are_refused_by_postgresql(row, sql):
    assert connection.vendor == "postgresql"
    with pytest.raises(DatabaseError) as excinfo:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    assert "append-only" in str(excinfo.value)
    assert UsageRecord.objects.get().actual_output_tokens == 50


def test_inserting_is_still_allowed(row):
    world_row = UsageRecord.objects.get()
    ledger_add(workload=world_row.workload, pool=world_row.pool, at=datetime(2026, 11, 3, tzinfo=dt_timezone.utc))
    assert UsageRecord.objects.count() == 2
