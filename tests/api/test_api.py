"""The management API: token auth, role rules, DRF-shaped 400s for bad
input (never a 500), the same flows as the pages, and an OpenAPI schema."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from budgets.models import BudgetRequest, Reservation, SpendBudget
from budgets.ledger.rollups import daily_usage_refresh
from tenants.models import ApiKey
from tests.people import PASSWORD, ledger_add, ledger_now, ledger_spread

pytestmark = pytest.mark.django_db


def as_user(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return api


def slice_body(world, **overrides):
    body = {"tenant": world.tenant_a.slug, "pool": world.pool.slug, "workload_id": world.wl_a.id,
            "reserved_tpm": 120_000, "ceiling_tpm": 200_000, "rpm": 700, "justification": "more traffic"}
    body.update(overrides)
    return body


def test_schema_and_docs_are_served(world):
    api = APIClient()
    schema = api.get("/api/schema/?format=json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ["/api/tenants/", "/api/budget-requests/", "/api/budget-requests/{request_id}/approve/",
                 "/api/usage/summary/", "/api/ledger/export/", "/api/pools/", "/api/spend-budgets/"]:
        assert path in paths, path
    docs = api.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


def test_schema_is_valid_openapi():
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.validation import validate_schema

    validate_schema(SchemaGenerator().get_schema(request=None, public=True))


def test_token_is_obtained_with_a_password_and_required(world):
    anonymous = APIClient()
    assert anonymous.get("/api/tenants/").status_code == 401
    response = anonymous.post("/api/auth/token/", {"username": world.member_a.username, "password": PASSWORD})
    assert response.status_code == 200
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {response.json()['token']}")
    assert [t["slug"] for t in api.get("/api/tenants/").json()] == [world.tenant_a.slug]
    bad = anonymous.post("/api/auth/token/", {"username": world.member_a.username, "password": "nope"})
    assert bad.status_code == 400 and "non_field_errors" in bad.json()


def test_member_flow_request_then_admin_approves(world, django_capture_on_commit_callbacks):
    member = as_user(world.member_a)
    created = member.post("/api/budget-requests/", slice_body(world, monthly_spend_budget="99.5"), format="json")
    assert created.status_code == 201, created.content
    request_id = created.json()["id"]
    assert created.json()["history"][0]["action"] == "submitted"
    assert member.post(f"/api/budget-requests/{request_id}/approve/").status_code == 403
    admin = as_user(world.admin)
    detail = admin.get(f"/api/budget-requests/{request_id}/").json()
    assert detail["preview"]["fits"] is True and detail["preview"]["headroom_after"]["free_tpm"] == 630_000
    with django_capture_on_commit_callbacks(execute=True):
        approved = admin.post(f"/api/budget-requests/{request_id}/approve/", {"comment": "go"}, format="json")
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert Reservation.objects.get(workload=world.wl_a).reserved_tpm == 120_000
    assert SpendBudget.objects.get(workload=world.wl_a).monthly_amount == Decimal("99.5")
    again = admin.post(f"/api/budget-requests/{request_id}/approve/", {}, format="json")
    assert again.status_code == 400 and "status" in again.json()


def test_an_admin_approves_less_than_asked_through_the_api(world):
    request_id = as_user(world.member_a).post("/api/budget-requests/", slice_body(world), format="json").json()["id"]
    admin = as_user(world.admin)
    too_much = admin.post(f"/api/budget-requests/{request_id}/approve/", {"reserved_tpm": 120_001}, format="json")
    assert too_much.status_code == 400
    assert too_much.json() == {"reserved_tpm": ["Approve between 1 and the 120,000 TPM asked for."]}
    assert admin.post(f"/api/budget-requests/{request_id}/approve/", {"reserved_tpm": 0},
                      format="json").status_code == 400
    approved = admin.post(f"/api/budget-requests/{request_id}/approve/", {"reserved_tpm": 70_000}, format="json")
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert approved.json()["reserved_tpm"] == 120_000  # what was asked, kept
    assert Reservation.objects.get(workload=world.wl_a).reserved_tpm == 70_000


def test_oversubscribing_approval_is_a_400_with_the_reason(world):
    member = as_user(world.member_a)
    request_id = member.post("/api/budget-requests/", slice_body(world, reserved_tpm=760_000, ceiling_tpm=760_000),
                             format="json").json()["id"]
    response = as_user(world.admin).post(f"/api/budget-requests/{request_id}/approve/", {}, format="json")
    assert response.status_code == 400 and "reserved_tpm" in response.json()
    assert BudgetRequest.objects.get().status == "pending"


def test_reject_needs_a_comment(world):
    request_id = as_user(world.member_a).post("/api/budget-requests/", slice_body(world), format="json").json()["id"]
    admin = as_user(world.admin)
    assert admin.post(f"/api/budget-requests/{request_id}/reject/", {}, format="json").json() == {
        "comment": ["Say why the request is rejected."]}
    assert admin.post(f"/api/budget-requests/{request_id}/reject/", {"comment": "no"}, format="json").status_code == 200


BAD_SLICES = [
    {"reserved_tpm": "many"},
    {"reserved_tpm": -1},
    {"reserved_tpm": 10**30},
    {"ceiling_tpm": 1},
    {"rpm": None},
    {"pool": "no-such-pool"},
    {"pool": "x" * 500},
    {"tenant": "../../etc"},
    {"workload_id": "abc"},
    {"workload_id": 10**12},
    {"workload_id": None, "new_workload_name": ""},
    {"workload_id": None, "new_workload_name": "x", "new_workload_class": "wizard"},
    {"justification": ""},
    {"lend_fraction": 2},
    {"ends_on": "yesterday"},
    {"ends_on": "2001-01-01"},
    {"monthly_spend_budget": "-5"},
    {"monthly_spend_budget": "1e999"},
    {"spend_soft_threshold": 0},
]


@pytest.mark.parametrize("overrides", BAD_SLICES)
def test_bad_slice_requests_get_400_with_field_errors(world, overrides):
    response = as_user(world.member_a).post("/api/budget-requests/", slice_body(world, **overrides), format="json")
    assert response.status_code in (400, 404), response.content
    if response.status_code == 400:
        assert isinstance(response.json(), dict) and response.json()
    assert BudgetRequest.objects.count() == 0


@pytest.mark.parametrize("body", [b"{not json", b"[]", b"null", b'"text"', b"{}"])
def test_malformed_bodies_get_400(world, body):
    api = as_user(world.member_a)
    for url in ["/api/budget-requests/", f"/api/tenants/{world.tenant_a.slug}/keys/"]:
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 400, (url, body, response.content)


@pytest.mark.parametrize("query", [
    "", "start=2026-01-01", "start=x&end=y", "start=2026-02-01&end=2026-01-01", "start=2020-01-01&end=2026-01-01",
    "start=2026-01-01&end=2026-01-31&group_by=wizard", "start=2026-01-01&end=2026-01-31&workload=nope",
    "start=2026-01-01&end=2026-01-31&pool=nope",
])
def test_bad_usage_queries_get_400(world, query):
    api = as_user(world.finance)
    assert api.get(f"/api/usage/summary/?{query}").status_code == 400
    assert api.get(f"/api/ledger/export/?{query}").status_code == 400


def test_the_export_streams_on_the_loop_under_asgi_whatever_wraps_the_request():
    # given the same request as Django's ASGI handler builds it, as its WSGI
    # handler does, and as DRF's view gets it (wrapping either)
    from django.core.handlers.asgi import ASGIRequest
    from django.test import RequestFactory
    from rest_framework.request import Request

    from budgets.ledger.export import ledger_csv_response
    from budgets.models import UsageRecord

    scope = {"type": "http", "method": "GET", "path": "/api/ledger/export/", "query_string": b"", "headers": []}
    asgi, wsgi = ASGIRequest(scope, None), RequestFactory().get("/api/ledger/export/")
    # then under ASGI the rows come through an async iterator (pulled in
    # batches on the request's one thread), under WSGI through a plain one
    for request, is_async in ((asgi, True), (Request(asgi), True), (wsgi, False), (Request(wsgi), False)):
        response = ledger_csv_response(request=request, queryset=UsageRecord.objects.none(), filename="x.csv")
        assert response.is_async is is_async, request


def test_usage_summary_totals_equal_the_export(world):
    now = ledger_now()
    ledger_spread(world=world, now=now, days=5, per_day=2)
    daily_usage_refresh(now=now - timedelta(days=2))
    api = as_user(world.finance)
    window = f"start={(now - timedelta(days=4)).date()}&end={now.date()}"
    summary = api.get(f"/api/usage/summary/?{window}&group_by=cost_center&group_by=model").json()
    assert {tuple(sorted(r["key"])) for r in summary["rows"]} == {("cost_center", "model")}
    export = api.get(f"/api/ledger/export/?{window}")
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert len(rows) == summary["total"]["requests"] == 20
    assert sum(Decimal(r["cost"]) for r in rows) == Decimal(summary["total"]["cost"])


def test_usage_groups_by_endpoint_and_the_export_names_it(world):
    now = ledger_now()
    ledger_spread(world=world, now=now, days=2, per_day=1)
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(hours=1), input_tokens=300, output_tokens=0,
               endpoint="/v1/embeddings")
    api = as_user(world.finance)
    window = f"start={(now - timedelta(days=3)).date()}&end={now.date()}"
    summary = api.get(f"/api/usage/summary/?{window}&group_by=endpoint").json()
    by_endpoint = {r["key"]["endpoint"]: r["requests"] for r in summary["rows"]}
    assert by_endpoint == {"/v1/chat/completions": summary["total"]["requests"] - 1, "/v1/embeddings": 1}
    export = api.get(f"/api/ledger/export/?{window}")
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert sorted(r["endpoint"] for r in rows).count("/v1/embeddings") == 1
    assert {r["endpoint"] for r in rows} == {"/v1/chat/completions", "/v1/embeddings"}


def test_member_usage_is_limited_to_their_tenants(world):
    now = ledger_now()
    ledger_spread(world=world, now=now, days=2, per_day=1)
    api = as_user(world.member_a)
    window = f"start={(now - timedelta(days=3)).date()}&end={now.date()}"
    summary = api.get(f"/api/usage/summary/?{window}&group_by=tenant").json()
    assert [r["key"]["tenant"] for r in summary["rows"]] == [str(world.tenant_a.id)]
    export = b"".join(api.get(f"/api/ledger/export/?{window}").streaming_content).decode()
    assert world.wl_a.slug in export and world.wl_b.slug not in export


def test_finance_reads_everything_and_writes_nothing(world):
    api = as_user(world.finance)
    assert len(api.get("/api/tenants/").json()) >= 2
    assert api.get(f"/api/tenants/{world.tenant_a.slug}/keys/").status_code == 200
    for url, body in [("/api/budget-requests/", slice_body(world)),
                      (f"/api/tenants/{world.tenant_a.slug}/keys/", {"workload_id": world.wl_a.id}),
                      ("/api/spend-budgets/", {"tenant": world.tenant_a.slug, "monthly_amount": "5"})]:
        assert api.post(url, body, format="json").status_code == 403, url
    assert BudgetRequest.objects.count() == 0 and ApiKey.objects.count() == 2


def test_api_keys_created_once_and_revoked(world):
    api = as_user(world.member_a)
    created = api.post(f"/api/tenants/{world.tenant_a.slug}/keys/", {"workload_id": world.wl_a.id, "name": "ci"},
                       format="json")
    assert created.status_code == 201 and created.json()["key"].startswith(created.json()["prefix"])
    listed = api.get(f"/api/tenants/{world.tenant_a.slug}/keys/").json()
    assert all("key" not in k for k in listed)
    revoked = api.post(f"/api/tenants/{world.tenant_a.slug}/keys/{created.json()['id']}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["is_active"] is False
    assert api.post(f"/api/tenants/{world.tenant_a.slug}/keys/", {"workload_id": world.wl_b.id}, format="json").json() == {
        "workload_id": ["Unknown workload."]}


def test_workloads_and_pools(world):
    api = as_user(world.member_a)
    workloads = api.get(f"/api/tenants/{world.tenant_a.slug}/workloads/").json()
    assert workloads[0]["reservation"]["reserved_tpm"] == 100_000
    pool = api.get(f"/api/pools/{world.pool.slug}/").json()
    assert pool["admission"]["free_tpm"] == 650_000 and "reservations" not in pool
    admin_view = as_user(world.admin).get(f"/api/pools/{world.pool.slug}/").json()
    assert {r["workload"] for r in admin_view["reservations"]} == {world.wl_a.slug, world.wl_b.slug}
    assert "available" in admin_view["live"]


def test_spend_budgets_set_by_admins_with_month_to_date(world):
    admin = as_user(world.admin)
    response = admin.post("/api/spend-budgets/", {"workload_id": world.wl_a.id, "monthly_amount": "12.5",
                                                  "hard_cap": True}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["workload"] == world.wl_a.slug and response.json()["month_to_date"] == "0.000000"
    assert as_user(world.member_a).post("/api/spend-budgets/", {"tenant": world.tenant_a.slug, "monthly_amount": "1"},
                                        format="json").status_code == 403
    assert admin.post("/api/spend-budgets/", {"tenant": world.tenant_a.slug, "workload_id": 1, "monthly_amount": "1"},
                      format="json").status_code == 400
    listed = as_user(world.member_a).get("/api/spend-budgets/").json()
    assert [b["workload"] for b in listed] == [world.wl_a.slug]


NOT_FOUND = {"detail": "Not found."}


def test_what_a_caller_may_not_see_is_the_same_drf_404(world):
    # given tenant A's request and key, asked for by tenant B's member
    member_a, member_b, admin = as_user(world.member_a), as_user(world.member_b), as_user(world.admin)
    request_id = member_a.post("/api/budget-requests/", slice_body(world), format="json").json()["id"]
    key_a = ApiKey.objects.get(workload=world.wl_a)
    today = timezone.now().date()
    window = f"start={today - timedelta(days=3)}&end={today}"
    a, b = world.tenant_a.slug, world.tenant_b.slug
    # then every lookup the caller may not make answers exactly DRF's 404
    answers = [
        member_b.get(f"/api/tenants/{a}/"),
        member_b.get(f"/api/tenants/{a}/workloads/"),
        member_b.get(f"/api/tenants/{b}/workloads/{world.wl_a.id}/"),
        member_b.get(f"/api/tenants/{a}/keys/"),
        member_b.post(f"/api/tenants/{a}/keys/", {"workload_id": world.wl_a.id}, format="json"),
        member_b.post(f"/api/tenants/{b}/keys/{key_a.id}/revoke/"),
        member_b.get(f"/api/budget-requests/{request_id}/"),
        member_b.post("/api/budget-requests/", slice_body(world), format="json"),
        member_b.get(f"/api/usage/summary/?{window}&tenant={a}"),
        member_b.get(f"/api/ledger/export/?{window}&tenant={a}"),
        member_a.get("/api/pools/no-such-pool/"),
        admin.post("/api/budget-requests/999999999/reject/", {}, format="json"),  # 404 before the missing comment
        admin.post("/api/budget-requests/999999999/approve/", {}, format="json"),
        admin.post("/api/spend-budgets/", {"tenant": "no-such-tenant", "monthly_amount": "1"}, format="json"),
    ]
    assert [(r.status_code, r.json()) for r in answers] == [(404, NOT_FOUND)] * len(answers)
    key_a.refresh_from_db()
    assert key_a.revoked_at is None


def test_unknown_references_in_a_body_or_query_are_field_400s(world):
    member_a, admin = as_user(world.member_a), as_user(world.admin)
    today = timezone.now().date()
    window = f"start={today - timedelta(days=3)}&end={today}"
    cases = [
        (member_a.post("/api/budget-requests/", slice_body(world, pool="no-such-pool"), format="json"),
         {"pool": ["Unknown or inactive pool."]}),
        (member_a.post("/api/budget-requests/", slice_body(world, workload_id=world.wl_b.id), format="json"),
         {"workload_id": ["Unknown workload."]}),
        (member_a.get(f"/api/usage/summary/?{window}&workload={world.wl_b.slug}"), {"workload": ["Unknown workload."]}),
        (member_a.get(f"/api/usage/summary/?{window}&pool=no-such-pool"), {"pool": ["Unknown pool."]}),
        (admin.post("/api/spend-budgets/", {"workload_id": 999_999_999, "monthly_amount": "1"}, format="json"),
         {"workload_id": ["Unknown workload."]}),
    ]
    assert [(r.status_code, r.json()) for r, _ in cases] == [(400, body) for _, body in cases]
    assert BudgetRequest.objects.count() == 0 and SpendBudget.objects.count() == 0


def test_inactive_pools_are_hidden_from_everyone_but_admins(world):
    world.pool.is_active = False
    world.pool.save(update_fields=["is_active"])
    member_a, admin = as_user(world.member_a), as_user(world.admin)
    assert world.pool.slug not in [p["slug"] for p in member_a.get("/api/pools/").json()]
    assert world.pool.slug in [p["slug"] for p in admin.get("/api/pools/").json()]
    assert member_a.get(f"/api/pools/{world.pool.slug}/").json() == NOT_FOUND
    assert admin.get(f"/api/pools/{world.pool.slug}/").status_code == 200
    assert admin.post("/api/budget-requests/", slice_body(world), format="json").json() == {
        "pool": ["Unknown or inactive pool."]}
