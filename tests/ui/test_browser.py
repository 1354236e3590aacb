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
    assert f"{retry_after_ms / 1000:.1f}s" in example  # the Retry-After the caller was given
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
