"""Django admin: a spend budget's tenant and workload are searchable
selects (autocomplete by name or slug), not raw ids; alert deliveries are
named in good English."""

from __future__ import annotations

import json
import re

import pytest

from budgets.models import AlertDelivery

pytestmark = pytest.mark.django_db


def test_the_spend_budget_form_picks_tenants_and_workloads_by_name(login, world):
    client = login(world.admin)
    body = client.get("/admin/budgets/spendbudget/add/").content.decode()
    for field in ("tenant", "workload"):
        select = re.search(rf'<select name="{field}"[^>]*>', body).group(0)
        assert "admin-autocomplete" in select and 'data-ajax--url="/admin/autocomplete/"' in select
    assert 'class="vForeignKeyRawIdAdminField"' not in body
    found = json.loads(client.get("/admin/autocomplete/", {
        "app_label": "budgets", "model_name": "spendbudget", "field_name": "tenant",
        "term": world.tenant_b.slug}).content)
    assert [r["id"] for r in found["results"]] == [str(world.tenant_b.id)]
    found = json.loads(client.get("/admin/autocomplete/", {
        "app_label": "budgets", "model_name": "spendbudget", "field_name": "workload",
        "term": world.tenant_a.slug}).content)
    assert [r["id"] for r in found["results"]] == [str(world.wl_a.id)]


def test_alert_deliveries_are_named_in_the_plural(login, world):
    assert AlertDelivery._meta.verbose_name_plural == "alert deliveries"
    body = login(world.admin).get("/admin/budgets/").content.decode()
    assert "Alert deliveries" in body and "Alert deliverys" not in body
