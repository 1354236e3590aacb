"""The web UI in a real browser (Playwright driving Debian's Chromium,
headless) against the real platform: the gateway (uvicorn) serving the pages
and /v1, Celery workers per lane, the simulated pool, PostgreSQL and Redis.

One story, in the order people live it: a member asks for a slice, an admin
approves it against the pool's headroom, the member's next API call is
admitted under the new budget, a call over the budget is rejected and shows
on the member's page with its reason, finance exports a CSV whose totals
match the page, and a member of another tenant can reach none of it.
Screenshots of every page land in a temporary folder, or in docs/screenshots/
(the README's pictures) with SLUICE_SCREENSHOTS=docs."""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import openai
import pytest

from budgets.web.templatetags.sluice_ui import human_duration

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = (ROOT / "docs" / "screenshots" if os.environ.get("SLUICE_SCREENSHOTS") == "docs"
         else Path(tempfile.gettempdir()) / "sluice-screenshots")
HELLO = [{"role": "user", "content": "Say hello to the gateway, please."}]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture
def browser(monkeypatch):
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        # CI installs it (.ci/run); there a missing browser is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is not installed, and CI must run the browser tests")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright import sync_api
    # Playwright's sync API runs an event loop in this thread; the test's own
    # ORM calls are plain synchronous code between browser steps.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
            # ORM calls made while Playwright's loop was running used their
            # own connection (Django keys connections by context): close it
            # here, or the test database cannot be dropped at the end.
            from django.db import connections

            connections.close_all()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


# Every page the browser refused to run or style because of the UI's
# Content-Security-Policy (llm_platform/settings.py): Chromium reports each one
# on the console. The story ends by asserting there were none.
CSP_VIOLATIONS: list[str] = []


def _watch_csp(page) -> None:
    page.on("console", lambda message: CSP_VIOLATIONS.append(f"{page.url}: {message.text}")
            if "Content Security Policy" in message.text else None)


def sign_in(browser, base_url: str, username: str, *, screenshot: str | None = None):
    from tests.people import PASSWORD

    context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 900}, accept_downloads=True)
    context.set_default_timeout(15_000)
    page = context.new_page()
    _watch_csp(page)
    page.goto("/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    if screenshot:
        shot(page, screenshot)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert "/accounts/login/" not in page.url, f"login failed for {username}"
    return page


def sdk(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=30)


def call(client: openai.OpenAI, *, max_tokens: int = 400, output_tokens: int = 30):
    return client.chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=max_tokens, extra_body={"sim": {"output_tokens": output_tokens}})


def test_member_admin_finance_story_in_a_real_browser(platform, browser, redis_client):
    from budgets.models import BudgetRequest, Reservation
    from budgets.admission.pool_config import pool_config_push
    from tests.people import build_world

    # given tenant A's workload with no budget yet (caps small enough for a 4,000 TPM slice)
    CSP_VIOLATIONS.clear()
    world = build_world(base_url=f"{platform.sim_url}/v1")
    Reservation.objects.filter(workload=world.wl_a).delete()
    world.wl_a.prompt_tokens_cap, world.wl_a.max_tokens_cap = 200, 400
    world.wl_a.save()
    pool_config_push(pool=world.pool)
    base = platform.base_url
    client_a = sdk(base, world.key_a)
    with pytest.raises(openai.PermissionDeniedError) as before:
        call(client_a)
    assert before.value.code == "no_reservation"

    # a member signs in and asks for a slice
    member = sign_in(browser, base, world.member_a.username, screenshot="01-login")
    assert member.url.endswith(f"/t/{world.tenant_a.slug}/")
    member.click("text=Request a budget slice")
    member.select_option("#id_workload", str(world.wl_a.id))
    member.select_option("#id_pool", str(world.pool.id))
    member.fill("#id_reserved_tpm", "4000")
    member.fill("#id_ceiling_tpm", "4000")
    member.fill("#id_rpm", "60")
    member.fill("#id_monthly_spend_budget", "25")
    member.fill("#id_justification", "Launching the support assistant")
    shot(member, "03-budget-request-form")
    member.click("#budget-request-form button[type=submit]")
    member.wait_for_selector("#request-status")
    assert member.inner_text("#request-status") == "Pending"
    shot(member, "04-budget-request-pending")
    request = BudgetRequest.objects.get()

    # an admin reviews it against the pool's headroom and approves it
    admin = sign_in(browser, base, world.admin.username)
    assert admin.url.endswith("/ops/pools/")
    shot(admin, "05-pools")
    admin.goto("/ops/requests/")
    shot(admin, "06-review-queue")
    admin.click(f"text=#{request.pk}")
    assert admin.inner_text("#free-now") == "750,000"  # 800,000 admission - tenant B's 50,000
    assert admin.inner_text("#free-after") == "746,000"
    shot(admin, "07-review")
    admin.fill("#id_comment", "Approved for the launch")
    approved_at = time.monotonic()
    admin.click("#approve")
    admin.wait_for_selector("#request-status >> text=Approved")

    # the member's next API call is admitted under the new budget, within seconds
    deadline = time.monotonic() + 10
    while True:
        try:
            raw = call(client_a)
            break
        except openai.PermissionDeniedError:
            assert time.monotonic() < deadline, "the approved slice did not reach admission"
            time.sleep(0.2)
    reached_s = time.monotonic() - approved_at
    assert raw.headers["x-ratelimit-limit-tokens"] == "4000"
    estimated_tokens = int(raw.headers["x-sluice-estimated-prompt-tokens"]) + 400
    assert raw.parse().usage.completion_tokens == 30
    assert reached_s < 10

    # spending past the budget (its ceiling bucket holds 15 s x 4,000 TPM = 1,000 tokens) is rejected with its reason
    rejected = None
    for _ in range(6):
        try:
            call(client_a, output_tokens=400)
        except openai.RateLimitError as exc:
            rejected = exc
            break
    assert rejected is not None and rejected.code == "workload_tpm"
    retry_after_ms = int(rejected.response.headers["retry-after-ms"])

    # and the member sees it on their page, with the approval notice
    member.goto(f"/t/{world.tenant_a.slug}/")
    example = member.locator("#rejection-examples tr", has_text="workload_tpm").first.inner_text()
    assert world.wl_a.slug in example
    assert f"{estimated_tokens:,}" in example  # the estimate the admission refused
    assert human_duration(retry_after_ms / 1000) in example  # the Retry-After the caller was given
    assert "Approved for the launch" in member.inner_text("#notifications")
    shot(member, "02-tenant-page")
    member.goto(f"/t/{world.tenant_a.slug}/requests/{request.pk}/")
    assert "Approved for the launch" in member.inner_text("main")
    shot(member, "08-budget-request-decided")

    admin.goto(f"/ops/pools/{world.pool.slug}/")
    assert admin.locator("svg.chart").count() == 3  # capacity, rejections, usage over the range
    assert admin.locator("#pool-workloads", has_text=world.wl_a.slug).count() == 1
    # the live part refreshes by itself
    # (a selector, not wait_for_function: evaluating a string is eval, which
    # the page's Content-Security-Policy refuses)
    admin.wait_for_selector("#live-status:text-matches('^updated')", timeout=12_000)
    assert "workload_tpm" in admin.inner_text("#live")
    shot(admin, "09-pool-overview")
    admin.goto("/api/docs/")
    admin.wait_for_selector(".swagger-ui .info", timeout=15_000)
    shot(admin, "11-api-docs")

    # finance's page totals equal the rows of its CSV export
    finance = sign_in(browser, base, world.finance.username)
    assert finance.url.endswith("/finance/")
    finance.goto("/finance/?period=this_month&group_by=workload")
    page_cost = Decimal(finance.get_attribute("#total-cost", "data-value"))
    page_tokens = int(finance.get_attribute("#total-actual", "data-value"))
    page_requests = int(finance.get_attribute("#total-requests", "data-value"))
    shot(finance, "10-finance")
    with finance.expect_download() as download_info:
        finance.click("#export-csv")
    path = download_info.value.path()
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert page_requests == len(rows) >= 2
    assert sum(Decimal(r["cost"]) for r in rows) == page_cost > 0
    assert sum(int(r["actual_input_tokens"]) + int(r["actual_output_tokens"]) for r in rows) == page_tokens
    # the last hour (this story's requests were all just made): minute buckets, and the same equality
    finance.click('a[data-period="last_hour"]')
    finance.wait_for_url("**period=last_hour**")
    assert finance.get_attribute("#spend-chart", "data-bucket") == "minute"
    assert int(finance.get_attribute("#total-requests", "data-value")) == page_requests
    with finance.expect_download() as download_info:
        finance.click("#export-csv")
    with open(download_info.value.path(), newline="") as handle:
        hour_rows = list(csv.DictReader(handle))
    assert sorted(r["request_id"] for r in hour_rows) == sorted(r["request_id"] for r in rows)

    # a member of another tenant can reach none of it
    outsider = sign_in(browser, base, world.member_b.username)
    assert outsider.url.endswith(f"/t/{world.tenant_b.slug}/")
    for url, status in [(f"/t/{world.tenant_a.slug}/", 404), (f"/t/{world.tenant_a.slug}/requests/{request.pk}/", 404),
                        (f"/t/{world.tenant_a.slug}/requests/new", 404), (f"/ops/requests/{request.pk}/", 403),
                        (f"/ops/pools/{world.pool.slug}/", 403), ("/finance/", 403),
                        ("/finance/ledger.csv?period=this_month", 403)]:
        response = outsider.goto(url)
        assert response.status == status, url
        body = outsider.content()
        assert world.tenant_a.name not in body and world.wl_a.slug not in body, url
    outsider.goto(f"/t/{world.tenant_a.slug}/")
    shot(outsider, "12-other-tenant-404")

    # every page of the story (the live pool page's script and the API docs
    # included) ran and styled within the Content-Security-Policy
    assert CSP_VIOLATIONS == []


def _watch_errors(page, errors: list[str]) -> None:
    page.on("console", lambda message: errors.append(f"{page.url}: {message.text}")
            if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))


@pytest.fixture
def file_mail(platform, tmp_path):
    """The web process and the housekeeping worker send e-mail to files (no SMTP server here)."""
    from gateway.core.lanes import HOUSEKEEPING

    overrides = {"EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend", "EMAIL_FILE_PATH": str(tmp_path)}
    with platform.environment(overrides, lanes=[HOUSEKEEPING.name]):
        yield tmp_path


def test_keys_alerts_jobs_and_withdraw_in_a_real_browser(platform, browser, file_mail):
    """A member revokes a key through its confirmation page, sets up alerts,
    reads a workload's jobs and withdraws a pending request; no page logs an
    error on the console."""
    from datetime import timedelta

    from django.utils import timezone

    from budgets.models import AlertDelivery, BudgetRequest
    from budgets.services.budget_requests import budget_request_submit
    from budgets.services.notifications import notification_create
    from gateway.models import Job
    from tenants.models import ApiKey
    from tests.people import build_world

    world = build_world(base_url=f"{platform.sim_url}/v1")
    errors: list[str] = []
    member = sign_in(browser, platform.base_url, world.member_a.username)
    _watch_errors(member, errors)

    # revoking a key asks first, says when it takes effect, then does it
    key = ApiKey.objects.get(workload=world.wl_a)
    assert sdk(platform.base_url, world.key_a).models.list().data
    member.goto(f"/t/{world.tenant_a.slug}/#keys")
    member.click(f"a[href='/t/{world.tenant_a.slug}/keys/{key.id}/revoke']")
    assert "within about a second" in member.inner_text("#revoke-confirm")
    shot(member, "17-revoke-key")
    member.click("#confirm-revoke")
    member.wait_for_selector("#messages >> text=is revoked")
    key.refresh_from_db()
    assert key.revoked_at is not None
    deadline = time.monotonic() + 5
    while True:  # refused by the gateway within about a second (a 60 s cache would not matter)
        try:
            sdk(platform.base_url, world.key_a).models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.05)

    # alerts: recipients and events saved; a delivery shows in the log
    member.goto(f"/t/{world.tenant_a.slug}/")
    member.click("text=Alerts")
    member.fill("#id_email_recipients", "ops@acme.test\nlead@acme.test")
    member.check("input[value=spend_hard]")
    member.check("input[value=request_decision]")
    member.click("#save-alerts")
    member.wait_for_selector("#messages >> text=Alert settings saved.")
    notification_create(tenant=world.tenant_a, kind="spend_hard_cap", dedupe_key="browser-hard-cap",
                        message="Spend of Acme reached its hard cap of 100.00 this month.")
    deadline = time.monotonic() + 30
    while not AlertDelivery.objects.filter(tenant=world.tenant_a, delivered=True).exists():  # the housekeeping worker mails it
        assert time.monotonic() < deadline, list(AlertDelivery.objects.values_list("error", flat=True))
        time.sleep(0.1)
    assert len(list(file_mail.iterdir())) == 1
    member.reload()
    assert "delivered" in member.inner_text("#alert-deliveries")
    shot(member, "18-alerts")

    # the jobs page: delayed with its release time, queued, finished
    now = timezone.now()
    for status, extra in [("succeeded", {"finished_at": now}), ("queued", {"request_id": "req-browser"}),
                          ("delayed", {"release_at": now + timedelta(minutes=2), "reason": "workload_tpm", "delays": 1})]:
        Job.objects.create(tenant=world.tenant_a, workload=world.wl_a, status=status, body={}, body_sha256="0" * 64,
                           deadline=now + timedelta(hours=1), **extra)
    member.goto(f"/t/{world.tenant_a.slug}/")
    member.click(f"#workload-{world.wl_a.slug} >> text=Jobs")
    assert member.locator("#jobs tbody tr").count() == 3
    assert "workload_tpm" in member.inner_text("#jobs tr[data-status=delayed]")
    shot(member, "19-jobs")

    # a pending request shows current -> requested and can be withdrawn
    request = budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                    reserved_tpm=120_000, ceiling_tpm=200_000, rpm=700, justification="More for launch")
    member.goto(f"/t/{world.tenant_a.slug}/requests/{request.pk}/")
    assert "Current" in member.inner_text("#current-vs-requested")
    shot(member, "20-request-withdraw")
    member.click("#withdraw")
    member.wait_for_selector("#request-status >> text=Withdrawn")
    assert BudgetRequest.objects.get(pk=request.pk).status == "withdrawn"

    # an approval that does not fit: the disabled button looks disabled
    big = budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                reserved_tpm=760_000, ceiling_tpm=760_000, rpm=700, justification="Too much")
    admin = sign_in(browser, platform.base_url, world.admin.username)
    _watch_errors(admin, errors)
    admin.goto(f"/ops/requests/{big.pk}/")
    assert admin.is_disabled("#approve")
    assert admin.eval_on_selector("#approve", "b => getComputedStyle(b).cursor") == "not-allowed"
    admin.goto("/api/schema/")
    assert "/v1/chat/completions:" in admin.inner_text("pre")
    assert errors == []
