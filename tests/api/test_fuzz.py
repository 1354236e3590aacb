"""Junk at every management API endpoint and every page, as the most
permissive user (a platform admin): answers are 2xx/4xx, never a 500."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

JUNK_BODIES = [
    b"", b"{", b"[]", b"null", b"123", b'"x"', b'{"tenant": {"a": 1}}', b'{"reserved_tpm": [1, 2]}',
    b'{"workload_id": "1 OR 1=1"}', b'{"monthly_amount": "NaN"}', b'{"comment": 5}', "{\"name\": \"\u0000\"}".encode(),
    b'{"start": "2026-13-45", "end": true}',
]
JUNK_QUERIES = ["", "?start=&end=", "?start=9999-99-99&end=0", "?group_by=__class__", "?tenant=%00", "?status=<x>",
                "?limit=-1&offset=abc", "?start=2026-01-01&end=2026-01-02&model=" + "m" * 5000]


def api_urls(world):
    a = world.tenant_a.slug
    return [
        "/api/tenants/", f"/api/tenants/{a}/", f"/api/tenants/{a}/keys/", f"/api/tenants/{a}/keys/999999/revoke/",
        f"/api/tenants/{a}/workloads/", f"/api/tenants/{a}/workloads/{world.wl_a.id}/", "/api/pools/",
        f"/api/pools/{world.pool.slug}/", "/api/budget-requests/", "/api/budget-requests/999999/",
        "/api/budget-requests/999999/approve/", "/api/budget-requests/999999/reject/", "/api/spend-budgets/",
        "/api/usage/summary/", "/api/ledger/export/", "/api/auth/token/",
    ]


def test_api_never_answers_500(world):
    api = APIClient()
    api.force_authenticate(world.admin)
    for url in api_urls(world):
        for query in JUNK_QUERIES:
            response = api.get(url + query)
            assert response.status_code < 500, (url, query, response.status_code)
        for body in JUNK_BODIES:
            for method in ("post", "put", "patch", "delete"):
                response = getattr(api, method)(url, body, content_type="application/json")
                assert response.status_code < 500, (method, url, body, response.status_code)


def test_pages_never_answer_500(client, world):
    client.force_login(world.admin)
    a = world.tenant_a.slug
    junk_forms = [{}, {"workload": "x", "pool": "y", "reserved_tpm": "1e99", "ceiling_tpm": "-1", "rpm": "NaN",
                       "lend_fraction": "inf", "ends_on": "2026-02-30", "monthly_spend_budget": "1e999",
                       "spend_soft_threshold": "0", "justification": "\x00"},
                  {"workload": "new", "new_workload_name": "!!!", "new_workload_class": "batch", "pool": "1",
                   "reserved_tpm": "1", "ceiling_tpm": "1", "rpm": "1", "spend_soft_threshold": "80", "justification": "x",
                   "lend_fraction": "0"},
                  {"comment": "x" * 10_000}]
    for url in [f"/t/{a}/requests/new", f"/t/{a}/keys/new", f"/t/{a}/keys/999999/revoke", "/ops/requests/999999/approve",
                "/ops/requests/999999/reject"]:
        for data in junk_forms:
            response = client.post(url, data)
            assert response.status_code < 500, (url, data, response.status_code)
    for query in JUNK_QUERIES + ["?period=nope", "?workload=%ff", "?group_by=cost_center&start=2026-01-01"]:
        for url in ["/finance/", "/finance/ledger.csv", "/ops/requests/"]:
            response = client.get(url + query)
            assert response.status_code < 500, (url, query, response.status_code)
