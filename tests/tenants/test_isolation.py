"""Every page and every management API endpoint, asked by a member of
another tenant: 404 or 403, and none of the first tenant's data in the
answer. The URL inventory test fails when a route is added without a case
here."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from budgets.services.budget_requests import budget_request_submit
from budgets.models import AlertSettings, SpendBudget, UsageRecord
from gateway.core.batches.files import file_write
from gateway.models import Batch, BatchFile, Job
from budgets.ledger.rejections import rejection_count
from tenants.models import ApiKey
from tests.people import ledger_add

pytestmark = pytest.mark.django_db

# Routes that hold no tenant's data (asserted below to leak none anyway).
PUBLIC = {"login", "logout", "api-token", "api-schema", "api-docs", "home", "tenant-list"}
# Routes of other parts of the project, tested where they live. /metrics is
# for the operator's scraper, by token or network, never by a user's session
# (tests/test_observability.py).
FOREIGN_PREFIXES = ("v1/", "healthz", "readyz", "metrics", "admin/")


def _names(resolver=None, prefix=""):
    resolver = resolver or get_resolver()
    for entry in resolver.url_patterns:
        if isinstance(entry, URLResolver):
            yield from _names(entry, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry.name


@pytest.fixture
def seeded(world, settings, tmp_path):
    """Tenant A has a request, a key, a spend budget, usage, a rejection, a job and a batch."""
    settings.MEDIA_ROOT = tmp_path / "files"
    now = timezone.now()
    request_a = budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                      reserved_tpm=1_000, ceiling_tpm=150_000, rpm=10, justification="secret plan A")
    SpendBudget.objects.create(tenant=world.tenant_a, monthly_amount=1000)
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=2))
    rejection_count(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id, reason="workload_tpm",
                    estimated_tokens=5, retry_after_ms=5)
    # its alert settings and a job name it (the slug is among what must not leak)
    AlertSettings.objects.create(tenant=world.tenant_a, email_recipients=f"ops@{world.tenant_a.slug}.test",
                                 events=["spend_soft"])
    Job.objects.create(tenant=world.tenant_a, workload=world.wl_a, status="queued", body={}, body_sha256="0" * 64,
                       deadline=now + timedelta(hours=1))
    batch_input = file_write(tenant_id=world.tenant_a.id, workload_id=world.wl_a.id, purpose=BatchFile.Purpose.BATCH,
                             filename="in.jsonl", lines=iter([b'{"custom_id": "secret plan A"}\n']))
    Batch.objects.create(tenant=world.tenant_a, workload=world.wl_a, endpoint="/v1/chat/completions",
                         status=Batch.Status.IN_PROGRESS, input_file=batch_input, expires_at=now + timedelta(hours=24))
    return world, request_a, ApiKey.objects.get(workload=world.wl_a)


def page_cases(world, request_a, key_a):
    a, b = world.tenant_a.slug, world.tenant_b.slug
    # tenant A's ledger row (the request log's own page), where seeded
    ledger_a = UsageRecord.objects.filter(workload=world.wl_a).values_list("request_id", flat=True).first() or "req_x"
    today = timezone.now().date()
    return {
        "tenant-detail": [("get", f"/t/{a}/", {})],
        "budget-request-new": [("get", f"/t/{a}/requests/new", {}), ("post", f"/t/{a}/requests/new", {"justification": "x"})],
        "budget-request-detail": [("get", f"/t/{a}/requests/{request_a.pk}/", {})],
        "budget-request-withdraw": [("post", f"/t/{a}/requests/{request_a.pk}/withdraw", {})],
        "api-key-new": [("post", f"/t/{a}/keys/new", {"workload": world.wl_a.id})],
        "api-key-expiry": [("post", f"/t/{a}/keys/{key_a.id}/expiry", {"expires_in_days": "7"})],
        "api-key-revoke": [("post", f"/t/{a}/keys/{key_a.id}/revoke", {}), ("get", f"/t/{a}/keys/{key_a.id}/revoke", {}),
                           ("post", f"/t/{a}/keys/{key_a.id}/revoke", {"confirm": "revoke"})],
        "tenant-alerts": [("get", f"/t/{a}/alerts", {}), ("post", f"/t/{a}/alerts", {"email_recipients": "x@y.test"})],
        "tenant-alerts-test": [("post", f"/t/{a}/alerts/test", {})],
        "workload-jobs": [("get", f"/t/{a}/workloads/{world.wl_a.slug}/jobs", {})],
        "workload-batches": [("get", f"/t/{a}/workloads/{world.wl_a.slug}/batches", {}),
                             ("get", f"/t/{b}/workloads/{world.wl_a.slug}/batches", {})],
        "batch-detail": [("get", f"/t/{a}/batches/{_batch_a(world)}", {}),
                         ("get", f"/t/{b}/batches/{_batch_a(world)}", {})],
        "batch-cancel": [("get", f"/t/{a}/batches/{_batch_a(world)}/cancel", {}),
                         ("post", f"/t/{a}/batches/{_batch_a(world)}/cancel", {"confirm": "cancel"}),
                         ("post", f"/t/{b}/batches/{_batch_a(world)}/cancel", {"confirm": "cancel"})],
        "batch-file-content": [("get", f"/t/{a}/files/{_file_a(world)}/content", {}),
                               ("get", f"/t/{b}/files/{_file_a(world)}/content", {})],
        "callback-secret-rotate": [("post", f"/t/{a}/callback-secret/rotate", {})],
        "pool-list": [("get", "/ops/pools/", {})],
        "pool-detail": [("get", f"/ops/pools/{world.pool.slug}/", {})],
        "pool-live": [("get", f"/ops/pools/{world.pool.slug}/live", {})],
        "review-list": [("get", "/ops/requests/", {})],
        "review-detail": [("get", f"/ops/requests/{request_a.pk}/", {})],
        "review-approve": [("post", f"/ops/requests/{request_a.pk}/approve", {"comment": "x"})],
        "review-reject": [("post", f"/ops/requests/{request_a.pk}/reject", {"comment": "x"})],
        "finance": [("get", "/finance/", {})],
        "finance-export": [("get", f"/finance/ledger.csv?start={today - timedelta(days=3)}&end={today}", {})],
        "tenant-request-log": [("get", f"/t/{a}/log/", {})],
        "tenant-request-detail": [("get", f"/t/{a}/log/{ledger_a}/", {}), ("get", f"/t/{b}/log/{ledger_a}/", {})],
        "request-log": [("get", "/log/", {})],
        "request-detail": [("get", f"/log/{ledger_a}/", {})],
        "tenant-request-find": [("get", f"/t/{a}/log/find?q={ledger_a}", {}), ("get", f"/t/{b}/log/find?q={ledger_a}", {}),
                                ("get", f"/t/{b}/log/find?q={_job_a(world)}", {})],
        "request-find": [("get", f"/log/find?q={ledger_a}", {})],
    }


def _job_a(world) -> str:
    return str(Job.objects.filter(workload=world.wl_a).values_list("id", flat=True).first() or "none")


def _batch_a(world) -> str:
    return Batch.objects.filter(workload=world.wl_a).values_list("id", flat=True).first() or "batch_none"


def _file_a(world) -> str:
    return BatchFile.objects.filter(workload=world.wl_a).values_list("id", flat=True).first() or "file-none"


def api_cases(world, request_a, key_a):
    a = world.tenant_a.slug
    today = timezone.now().date()
    window = f"start={today - timedelta(days=3)}&end={today}"
    return {
        "api-tenant-detail": [("get", f"/api/tenants/{a}/", {})],
        "api-key-list": [("get", f"/api/tenants/{a}/keys/", {}), ("post", f"/api/tenants/{a}/keys/", {"workload_id": world.wl_a.id})],
        "api-key-revoke": [("post", f"/api/tenants/{a}/keys/{key_a.id}/revoke/", {})],
        "api-callback-secret": [("get", f"/api/tenants/{a}/callback-secret/", {})],
        "api-callback-secret-rotate": [("post", f"/api/tenants/{a}/callback-secret/rotate/", {})],
        "api-workload-list": [("get", f"/api/tenants/{a}/workloads/", {})],
        "api-workload-detail": [("get", f"/api/tenants/{a}/workloads/{world.wl_a.id}/", {})],
        "api-budget-request-detail": [("get", f"/api/budget-requests/{request_a.pk}/", {})],
        "api-budget-request-approve": [("post", f"/api/budget-requests/{request_a.pk}/approve/", {})],
        "api-budget-request-reject": [("post", f"/api/budget-requests/{request_a.pk}/reject/", {"comment": "x"})],
        "api-budget-request-list": [("post", "/api/budget-requests/", {
            "tenant": a, "pool": world.pool.slug, "workload_id": world.wl_a.id, "reserved_tpm": 1, "ceiling_tpm": 40_000,
            "rpm": 1, "justification": "x"})],
        "api-spend-budget-list": [("post", "/api/spend-budgets/", {"tenant": a, "monthly_amount": "1"})],
        "api-usage-summary": [("get", f"/api/usage/summary/?{window}&tenant={a}", {})],
        "api-ledger-export": [("get", f"/api/ledger/export/?{window}&tenant={a}", {})],
        "api-request-detail": [
            ("get", f"/api/requests/{UsageRecord.objects.filter(workload=world.wl_a).values_list('request_id', flat=True).first() or 'req_x'}", {}),
            ("get", f"/api/requests/{_job_a(world)}/", {})],
        # last: its session sign-in drops the token above
        "pool-metrics": [("get", f"/api/pools/{world.pool.id}/metrics", {})],
    }


def leaked(world, request_a, body: str) -> list[str]:
    secrets = [world.tenant_a.slug, world.tenant_a.name, world.wl_a.slug, "secret plan A", "CC-A",
               world.tenant_a.callback_secret]
    return [s for s in secrets if s in body]


def test_every_route_has_an_isolation_case(world):
    request_a = type("R", (), {"pk": 1})
    key_a = type("K", (), {"id": 1})
    covered = set(page_cases(world, request_a, key_a)) | set(api_cases(world, request_a, key_a)) | PUBLIC
    covered |= {"api-tenant-list", "api-pool-list", "api-pool-detail", "api-budget-request-list",
                "api-spend-budget-list", "api-usage-summary", "api-ledger-export"}  # listed: scoped answers below
    missing = [(route, name) for route, name in _names()
               if not route.startswith(FOREIGN_PREFIXES) and name not in covered]
    assert missing == []


def test_another_tenants_member_gets_404_or_403_on_every_page(client, seeded):
    world, request_a, key_a = seeded
    client.force_login(world.member_b)
    for name, cases in page_cases(world, request_a, key_a).items():
        for method, url, data in cases:
            response = getattr(client, method)(url, data)
            assert response.status_code in (403, 404), (name, url, response.status_code)
            body = b"".join(response.streaming_content).decode() if response.streaming else response.content.decode()
            assert leaked(world, request_a, body) == [], (name, url)
    request_a.refresh_from_db()
    key_a.refresh_from_db()
    assert request_a.status == "pending" and key_a.revoked_at is None
    assert AlertSettings.objects.get(tenant=world.tenant_a).recipients == [f"ops@{world.tenant_a.slug}.test"]
    assert Batch.objects.get(workload=world.wl_a).status == Batch.Status.IN_PROGRESS


def test_another_tenants_member_gets_404_or_403_on_every_api_endpoint(seeded):
    world, request_a, key_a = seeded
    from rest_framework.authtoken.models import Token

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=world.member_b).key}")
    for name, cases in api_cases(world, request_a, key_a).items():
        for method, url, data in cases:
            if name == "pool-metrics":  # session-authenticated admin view of the gateway
                api.force_authenticate(None)
                plain = APIClient()
                plain.force_login(world.member_b)
                response = plain.get(url)
            else:
                response = getattr(api, method)(url, data, format="json")
            assert response.status_code in (403, 404), (name, url, response.status_code)
            body = b"".join(response.streaming_content).decode() if response.streaming else response.content.decode()
            assert leaked(world, request_a, body) == [], (name, url)


def test_scoped_lists_show_another_tenants_member_nothing_of_theirs(seeded):
    world, request_a, _key_a = seeded
    api = APIClient()
    api.force_authenticate(world.member_b)
    today = timezone.now().date()
    window = f"start={today - timedelta(days=3)}&end={today}"
    for url in ["/api/tenants/", "/api/pools/", f"/api/pools/{world.pool.slug}/", "/api/budget-requests/",
                "/api/spend-budgets/", f"/api/usage/summary/?{window}&group_by=tenant&group_by=workload",
                f"/api/ledger/export/?{window}", "/api/schema/"]:
        response = api.get(url)
        assert response.status_code == 200, (url, response.status_code)
        body = b"".join(response.streaming_content).decode() if response.streaming else response.content.decode()
        assert leaked(world, request_a, body) == [], url
    assert world.tenant_b.slug in api.get("/api/tenants/").content.decode()


def test_public_pages_leak_nothing(client, seeded):
    world, request_a, _key_a = seeded
    client.force_login(world.member_b)
    for url in ["/", "/t/", "/accounts/login/", "/api/docs/"]:
        response = client.get(url, follow=True)
        assert response.status_code == 200, url
        assert leaked(world, request_a, response.content.decode()) == [], url
