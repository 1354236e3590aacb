"""The server-rendered pages with Django's test client: each role sees its
pages, forms carry CSRF, finance changes nothing, and flows work end to end
in-process (the browser tests drive the same pages through real processes)."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone

from budgets.models import BudgetRequest, Reservation, SpendBudget
from budgets.ledger.rejections import rejection_count
from budgets.ledger.rollups import daily_usage_refresh
from tenants.models import ApiKey
from tests.people import ledger_add, ledger_now, ledger_spread

pytestmark = pytest.mark.django_db


def text(response) -> str:
    return response.content.decode()


def test_anonymous_users_are_sent_to_login(client, world):
    for url in ["/", "/t/", f"/t/{world.tenant_a.slug}/", "/ops/pools/", "/finance/", "/finance/ledger.csv"]:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/"), url


def test_login_page_and_logout(client, world):
    assert client.get("/accounts/login/").status_code == 200
    response = client.post("/accounts/login/", {"username": world.member_a.username, "password": "correct-horse-battery"})
    assert response.status_code == 302
    assert client.get("/", follow=True).redirect_chain[-1][0] == f"/t/{world.tenant_a.slug}/"
    assert client.post("/accounts/logout/").status_code == 302
    assert client.get(f"/t/{world.tenant_a.slug}/").status_code == 302


def test_home_sends_each_role_to_its_page(login, world):
    for user, target in [(world.admin, "/ops/pools/"), (world.finance, "/finance/"),
                         (world.member_a, f"/t/{world.tenant_a.slug}/")]:
        client = login(user)
        assert client.get("/", follow=True).redirect_chain[-1][0] == target


def test_tenant_page_shows_usage_rejections_keys_and_requests(login, world):
    now = timezone.now()
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(seconds=20), input_tokens=1234, output_tokens=10)
    rejection_count(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id, reason="workload_tpm",
                    estimated_tokens=777, retry_after_ms=2300)
    SpendBudget.objects.create(workload=world.wl_a, monthly_amount=Decimal("0.0001"), soft_threshold=0.5)
    response = login(world.member_a).get(f"/t/{world.tenant_a.slug}/")
    body = text(response)
    assert response.status_code == 200
    assert world.wl_a.slug in body and "<svg" in body
    assert "workload_tpm" in body and "777" in body and "2.3 s" in body  # the example, with its Retry-After
    assert ApiKey.objects.filter(workload=world.wl_a).get().prefix in body
    assert "budget spent" in body  # 1,234 + 10 tokens of sim-small cost 0.000191 > 0.0001
    assert world.tenant_b.name not in body and world.wl_b.slug not in body


def test_members_see_only_their_tenants(login, world):
    client = login(world.member_a)
    body = text(client.get("/t/", follow=True))
    assert world.tenant_a.name in body and world.tenant_b.name not in body
    assert client.get(f"/t/{world.tenant_b.slug}/").status_code == 404


def test_creating_a_key_shows_it_once_and_revoking_works(login, world):
    client = login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_a.id, "name": "ci"})
    assert response.status_code == 200 and response["Cache-Control"].startswith("max-age=0")
    raw = re.search(r"sk-sluice-[\w-]+", text(response)).group(0)
    key = ApiKey.objects.get(name="ci")
    assert raw.startswith(key.prefix) and raw not in text(client.get(f"/t/{world.tenant_a.slug}/"))
    # revoking asks first: the GET and a POST without the confirmation change nothing
    confirm = client.get(f"/t/{world.tenant_a.slug}/keys/{key.id}/revoke")
    assert confirm.status_code == 200 and "within about a second" in text(confirm)
    assert client.post(f"/t/{world.tenant_a.slug}/keys/{key.id}/revoke").status_code == 400
    key.refresh_from_db()
    assert key.revoked_at is None
    response = client.post(f"/t/{world.tenant_a.slug}/keys/{key.id}/revoke", {"confirm": "revoke"})
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_a_key_cannot_be_made_for_another_tenants_workload(login, world):
    client = login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_b.id})
    assert response.status_code == 400
    assert not ApiKey.objects.filter(workload=world.wl_b, name="").exclude(name="b").exists()
    assert client.post(f"/t/{world.tenant_b.slug}/keys/new", {"workload": world.wl_b.id}).status_code == 404
    key_b = ApiKey.objects.get(workload=world.wl_b)
    assert client.post(f"/t/{world.tenant_a.slug}/keys/{key_b.id}/revoke", {"confirm": "revoke"}).status_code == 404
    assert client.get(f"/t/{world.tenant_a.slug}/keys/{key_b.id}/revoke").status_code == 404
    key_b.refresh_from_db()
    assert key_b.revoked_at is None


def test_forms_need_a_csrf_token(world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_a.id})
    assert response.status_code == 403
    page = text(client.get(f"/t/{world.tenant_a.slug}/requests/new"))
    assert 'name="csrfmiddlewaretoken"' in page


def request_form(world, **overrides):
    data = {"workload": str(world.wl_a.id), "pool": str(world.pool.id), "reserved_tpm": "120000",
            "ceiling_tpm": "200000", "rpm": "700", "lend_fraction": "0", "spend_soft_threshold": "80",
            "justification": "Holiday traffic", "monthly_spend_budget": "300"}
    data.update(overrides)
    return data


def test_member_requests_a_slice_and_admin_approves_it(login, world, django_capture_on_commit_callbacks):
    # given a member who asks for more
    client = login(world.member_a)
    assert client.get(f"/t/{world.tenant_a.slug}/requests/new").status_code == 200
    response = client.post(f"/t/{world.tenant_a.slug}/requests/new", request_form(world, spend_hard_cap="on"))
    assert response.status_code == 302
    request = BudgetRequest.objects.get()
    assert (request.reserved_tpm, request.monthly_spend_budget, request.spend_hard_cap) == (120_000, Decimal("300"), True)
    # when the admin reviews it: the page shows the pool's headroom and what approval leaves
    admin = login(world.admin)
    review = text(admin.get(f"/ops/requests/{request.pk}/"))
    assert "650,000" in review  # free now: 800,000 - 150,000
    assert "630,000" in review  # free if approved: 800,000 - 50,000 - 120,000
    with django_capture_on_commit_callbacks(execute=True):
        response = admin.post(f"/ops/requests/{request.pk}/approve", {"comment": "enjoy"})
    assert response.status_code == 302
    assert Reservation.objects.get(workload=world.wl_a).ceiling_tpm == 200_000
    # then the member is told on their page
    page = text(login(world.member_a).get(f"/t/{world.tenant_a.slug}/"))
    assert "was approved" in page and "enjoy" in page


def test_invalid_request_form_shows_field_errors(login, world):
    client = login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/requests/new",
                           request_form(world, ceiling_tpm="5", reserved_tpm="abc", pool="999999"))
    assert response.status_code == 200
    body = text(response)
    assert "errorlist" in body and BudgetRequest.objects.count() == 0


def test_oversubscribing_approval_is_refused_on_the_page(login, world):
    client = login(world.member_a)
    client.post(f"/t/{world.tenant_a.slug}/requests/new", request_form(world, reserved_tpm="760000", ceiling_tpm="760000"))
    request = BudgetRequest.objects.get()
    admin = login(world.admin)
    assert "cannot be approved" in text(admin.get(f"/ops/requests/{request.pk}/"))
    response = admin.post(f"/ops/requests/{request.pk}/approve", {"comment": ""}, follow=True)
    # back on the request's own URL (not /approve), the reason shown once
    assert response.redirect_chain == [(f"/ops/requests/{request.pk}/", 302)]
    assert text(response).count("above its admission budget") == 1
    request.refresh_from_db()
    assert request.status == "pending"


def test_reject_needs_a_comment_and_tells_the_member(login, world):
    login(world.member_a).post(f"/t/{world.tenant_a.slug}/requests/new", request_form(world))
    request = BudgetRequest.objects.get()
    admin = login(world.admin)
    assert admin.post(f"/ops/requests/{request.pk}/reject", {"comment": ""}).status_code == 400
    assert admin.post(f"/ops/requests/{request.pk}/reject", {"comment": "use batch"}).status_code == 302
    body = text(login(world.member_a).get(f"/t/{world.tenant_a.slug}/requests/{request.pk}/"))
    assert "Rejected" in body and "use batch" in body and "Submitted" in body


def test_admin_pages_are_staff_only(login, world):
    for user in (world.member_a, world.finance):
        client = login(user)
        for url in ["/ops/pools/", f"/ops/pools/{world.pool.slug}/", f"/ops/pools/{world.pool.slug}/live", "/ops/requests/"]:
            assert client.get(url).status_code == 403, (user, url)


def test_pool_overview_renders_live_parts(login, world):
    now = timezone.now()
    ledger_add(workload=world.wl_b, pool=world.pool, at=now - timedelta(seconds=10), input_tokens=500, output_tokens=55)
    rejection_count(pool_id=world.pool.id, workload_id=world.wl_b.id, tenant_id=world.tenant_b.id, reason="pool_tpm",
                    estimated_tokens=1, retry_after_ms=1)
    client = login(world.admin)
    body = text(client.get(f"/ops/pools/{world.pool.slug}/"))
    assert "Effective capacity now" in body and "λ·W" in body and "pool_tpm" in body
    assert "555" in body  # used in the last minute by wl_b
    live = client.get(f"/ops/pools/{world.pool.slug}/live")
    assert live.status_code == 200 and live["Cache-Control"] == "no-store" and "<html" not in text(live)


def test_finance_is_read_only_everywhere(login, world):
    client = login(world.finance)
    assert client.get("/finance/").status_code == 200
    assert client.get(f"/t/{world.tenant_a.slug}/").status_code == 200  # reads every tenant
    for url, data in [(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_a.id}),
                      (f"/t/{world.tenant_a.slug}/requests/new", request_form(world)),
                      ("/finance/", {}), ("/admin/budgets/spendbudget/add/", {})]:
        assert client.post(url, data).status_code == 403, url
    assert "Create API key" not in text(client.get(f"/t/{world.tenant_a.slug}/"))
    assert BudgetRequest.objects.count() == 0 and ApiKey.objects.count() == 2
    assert client.post("/accounts/logout/").status_code == 302  # signing out is allowed


def test_finance_totals_equal_the_exported_rows(login, world):
    now = ledger_now()
    ledger_spread(world=world, now=now, days=6, per_day=3)
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(days=40))  # outside the period
    daily_usage_refresh(now=now - timedelta(days=2))  # the last days are read live
    client = login(world.finance)
    start = (now - timedelta(days=5)).date()
    query = f"start={start}&end={now.date()}&group_by=model"
    page = text(client.get(f"/finance/?{query}"))
    total_cost = Decimal(re.search(r'id="total-cost" data-value="([\d.]+)"', page).group(1))
    total_actual = int(re.search(r'id="total-actual" data-value="(\d+)"', page).group(1))
    total_requests = int(re.search(r'id="total-requests" data-value="(\d+)"', page).group(1))
    export = client.get(f"/finance/ledger.csv?{query}")
    assert export.status_code == 200 and export.streaming
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert len(rows) == total_requests == 6 * 3 * 2
    assert sum(Decimal(r["cost"]) for r in rows) == total_cost
    assert sum(int(r["actual_input_tokens"]) + int(r["actual_output_tokens"]) for r in rows) == total_actual
    # a sub-day range (UTC minutes, half-open) across yesterday and today: the same equality
    start_at, end_at = now - timedelta(days=1, minutes=10), now
    query = f"start={start_at:%Y-%m-%dT%H:%M}&end={end_at:%Y-%m-%dT%H:%M}&group_by=tenant"
    page = text(client.get(f"/finance/?{query}"))
    export = client.get(f"/finance/ledger.csv?{query}")
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert len(rows) == int(re.search(r'id="total-requests" data-value="(\d+)"', page).group(1)) == 2 * 3 * 2
    assert sum(Decimal(r["cost"]) for r in rows) == Decimal(re.search(r'id="total-cost" data-value="([\d.]+)"', page).group(1))
    assert sum(int(r["actual_input_tokens"]) + int(r["actual_output_tokens"]) for r in rows) == int(
        re.search(r'id="total-actual" data-value="(\d+)"', page).group(1))


def test_finance_filters_by_tenant_and_cost_center(login, world):
    ledger_spread(world=world, now=ledger_now(), days=2, per_day=1)
    client = login(world.finance)
    body = text(client.get(f"/finance/?period=last_7_days&tenant={world.tenant_b.slug}&group_by=workload"))
    assert world.wl_b.slug in body and world.wl_a.slug not in body.split('id="spend-table"')[1].split("</table>")[0]
    export = b"".join(client.get("/finance/ledger.csv?period=last_7_days&cost_center=CC-A").streaming_content).decode()
    assert world.wl_a.slug in export and world.wl_b.slug not in export


def test_finance_rejects_bad_filters_with_400(login, world):
    client = login(world.finance)
    assert client.get("/finance/?start=2026-02-01&end=2026-01-01").status_code == 400
    assert client.get("/finance/?start=not-a-date").status_code == 400
    assert client.get("/finance/?tenant=nope").status_code == 400
    assert client.get("/finance/ledger.csv?start=2020-01-01&end=2026-01-01").status_code == 400


def test_members_cannot_reach_finance(login, world):
    client = login(world.member_a)
    assert client.get("/finance/").status_code == 403
    assert client.get("/finance/ledger.csv").status_code == 403


def test_pages_read_rollups_not_a_year_of_ledger(login, world):
    # given a year of rollups (no need for the raw rows to prove the page never reads them)
    from budgets.models import DailyUsage, RollupState

    today = timezone.now().date()
    DailyUsage.objects.bulk_create([
        DailyUsage(day=today - timedelta(days=d), tenant=world.tenant_a, workload=world.wl_a, pool=world.pool,
                   model=m, requests=10, ok_requests=10, actual_input_tokens=1000, actual_output_tokens=100,
                   estimated_input_tokens=1000, estimated_output_tokens=200, cost=Decimal("0.01"))
        for d in range(3, 368) for m in ("sim-small", "sim-large")
    ])
    RollupState.objects.update_or_create(name="daily_usage", defaults={"final_through": today - timedelta(days=2)})
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = login(world.finance)
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/finance/?start={today - timedelta(days=366)}&end={today - timedelta(days=3)}&group_by=month")
    assert response.status_code == 200
    assert not any("budgets_usagerecord" in q["sql"] for q in queries.captured_queries)
    assert len(queries.captured_queries) < 40
    assert Decimal(re.search(r'id="total-cost" data-value="([\d.]+)"', text(response)).group(1)) == Decimal("0.01") * 364 * 2
