"""Usage queries name days between 2000-01-01 and 2100-12-31: outside that,
the management API answers a 400 naming the field and the pages a form error,
never the OverflowError that 9999-12-31 + 1 day used to be."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

OUT_OF_RANGE = [
    ("start=9999-12-31&end=9999-12-31", "start"),
    ("start=2026-01-01&end=9999-12-31", "end"),
    ("start=0001-01-01&end=0001-01-05", "start"),
    ("start=1999-12-31&end=2000-01-02", "start"),
    ("start=2100-12-31&end=2101-01-01", "end"),
]
MESSAGE = "Choose a day between 2000-01-01 and 2100-12-31."


@pytest.mark.parametrize("path", ["/api/usage/summary/", "/api/ledger/export/"])
@pytest.mark.parametrize("query,field", OUT_OF_RANGE)
def test_api_usage_days_out_of_range_are_a_400_naming_the_field(world, path, query, field):
    api = APIClient()
    api.force_authenticate(world.admin)
    response = api.get(f"{path}?{query}")
    assert response.status_code == 400
    assert response.json()[field] == [MESSAGE]


@pytest.mark.parametrize("path", ["/api/usage/summary/", "/api/ledger/export/"])
def test_api_usage_days_at_the_bounds_are_answered(world, path):
    api = APIClient()
    api.force_authenticate(world.admin)
    assert api.get(f"{path}?start=2100-12-31&end=2100-12-31").status_code == 200
    assert api.get(f"{path}?start=2000-01-01&end=2000-01-01").status_code == 200


@pytest.mark.parametrize("path", ["/finance/", "/finance/ledger.csv"])
@pytest.mark.parametrize("query,field", OUT_OF_RANGE)
def test_finance_pages_with_days_out_of_range_are_a_400(client, world, path, query, field):
    client.force_login(world.admin)
    response = client.get(f"{path}?{query}")
    assert response.status_code == 400
    if path == "/finance/":
        assert MESSAGE in response.content.decode()


def test_the_finance_page_at_the_last_day_is_answered(client, world):
    client.force_login(world.admin)
    assert client.get("/finance/?start=2100-12-31&end=2100-12-31").status_code == 200
    assert client.get("/finance/ledger.csv?start=2100-12-31&end=2100-12-31").status_code == 200


def test_a_budget_request_ending_past_three_years_is_a_400(world):
    api = APIClient()
    api.force_authenticate(world.member_a)
    response = api.post("/api/budget-requests/", {
        "tenant": world.tenant_a.slug, "pool": world.pool.slug, "workload_id": world.wl_a.id, "reserved_tpm": 10,
        "ceiling_tpm": 10, "rpm": 1, "justification": "x", "ends_on": "9999-12-31"}, format="json")
    assert response.status_code == 400
    assert response.json()["ends_on"] == ["Pick an end date within three years."]
