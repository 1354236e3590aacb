"""Every page of the web UI, as a member, an admin and finance, in a real
browser (Playwright driving Debian's Chromium) at a phone's 390 px and a
1,400 px window: the page itself never scrolls sideways (tables scroll in
their own container, charts shrink with the page). Fails on
``document.documentElement.scrollWidth > innerWidth`` and names the
elements that stick out."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.ui.test_browser import browser, shot  # noqa: F401 (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WIDTHS = (390, 1400)

# The page's width against the window's, and the elements whose right edge
# passes the window (the culprits, for the failure message).
OVERFLOW_JS = """() => {
  const out = [];
  for (const el of document.querySelectorAll('body *')) {
    const box = el.getBoundingClientRect();
    if (box.right > window.innerWidth + 1 && !el.closest('.table-scroll')) {
      out.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
               (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ').join('.') : '') +
               ' right=' + Math.round(box.right));
    }
  }
  return {scroll: document.documentElement.scrollWidth, inner: window.innerWidth, culprits: out.slice(0, 8)};
}"""


def _pages(world, *, budget_request, request_id: str, key_id: int, refusal_id: str,
           batch_id: str) -> dict[str, list[str]]:
    a, wl = world.tenant_a.slug, world.wl_a.slug
    member = ["/", "/t/", f"/t/{a}/", f"/t/{a}/requests/new", f"/t/{a}/requests/{budget_request.pk}/",
              f"/t/{a}/alerts", f"/t/{a}/log/?range=7d", f"/t/{a}/log/{request_id}/", f"/t/{a}/log/{refusal_id}/",
              f"/t/{a}/keys/{key_id}/revoke", f"/t/{a}/workloads/{wl}/jobs", f"/t/{a}/?range=30d",
              f"/t/{a}/workloads/{wl}/batches", f"/t/{a}/batches/{batch_id}", f"/t/{a}/batches/{batch_id}/cancel"]
    finance = ["/", "/t/", f"/t/{a}/", "/finance/", "/finance/?period=last_30_days&group_by=workload",
               "/finance/?period=last_hour&group_by=day", "/log/?range=7d", f"/log/{request_id}/", f"/log/{refusal_id}/",
               f"/t/{a}/log/", f"/t/{a}/workloads/{wl}/batches", f"/t/{a}/batches/{batch_id}"]
    admin = sorted(set(member + finance) | {
        "/ops/pools/", f"/ops/pools/{world.pool.slug}/", f"/ops/pools/{world.pool.slug}/?range=7d", "/ops/requests/",
        f"/ops/requests/{budget_request.pk}/"})
    return {"member": member, "finance": finance, "admin": admin}


def _batch_with_errors(world) -> str:
    """A running batch with a long plan note, validation-style errors, metadata and failed lines."""
    from django.utils import timezone

    from gateway.core.batches.files import file_write
    from gateway.core.batches.lifecycle import batch_plan
    from gateway.models import Batch, BatchFile, Job

    stored = file_write(tenant_id=world.tenant_a.id, workload_id=world.wl_a.id, purpose=BatchFile.Purpose.BATCH,
                        filename="in.jsonl", lines=iter([b'{"custom_id": "a"}\n'] * 3))
    plan = batch_plan(type("Ctx", (), {"slices": []})(), tokens=10_000, requests=3, window_s=86400, basis="file size")
    batch = Batch.objects.create(
        tenant=world.tenant_a, workload=world.wl_a, endpoint="/v1/chat/completions", status=Batch.Status.IN_PROGRESS,
        input_file=stored, expires_at=timezone.now() + timedelta(hours=24), total=3, plan=plan,
        metadata={"description": "nightly re-index of the whole document store " * 4},
        errors=[{"code": "invalid_json_line", "message": "Line 2 is not JSON: " + "x" * 200, "param": None, "line": 2}])
    for line, status in ((1, Job.Status.REJECTED), (2, Job.Status.PENDING), (3, Job.Status.QUEUED)):
        Job.objects.create(tenant=world.tenant_a, workload=world.wl_a, batch=batch, line=line,
                           custom_id="custom-" + "y" * 120 + str(line), status=status, body={}, body_sha256="",
                           deadline=batch.expires_at, result_status=400 if line == 1 else None,
                           result={"error": {"message": "This model's maximum context length is 2000 tokens " * 3,
                                             "code": "context_length_exceeded"}} if line == 1 else None)
    return batch.id


def test_no_page_scrolls_sideways_at_390_or_1400_px(live_server, browser, world, settings, tmp_path):  # noqa: F811
    from django.utils import timezone

    from budgets.models import RejectionSample
    from budgets.services.budget_requests import budget_request_submit
    from tenants.models import ApiKey
    from tests.people import PASSWORD, ledger_add, ledger_spread

    # given a few days of traffic on both tenants, a pending budget request and a key
    now = timezone.now()
    ledger_spread(world=world, now=now, days=5, per_day=3)
    request_id = ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=2))
    budget_request = budget_request_submit(
        tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a, reserved_tpm=150_000,
        ceiling_tpm=200_000, rpm=800, justification="A launch with a rather long justification " * 6)
    key_id = ApiKey.objects.filter(workload=world.wl_a).values_list("id", flat=True).first()
    refusal = RejectionSample.objects.create(
        sample_id="req_" + "f" * 32, at=now - timedelta(minutes=1), tenant=world.tenant_a, workload=world.wl_a,
        pool=world.pool, reason="context_length_exceeded", estimated_tokens=9008, retry_after_ms=None,
        message="This model's maximum context length is 2000 tokens; your prompt resulted in 9008 tokens.")
    settings.MEDIA_ROOT = tmp_path / "files"
    pages = _pages(world, budget_request=budget_request, request_id=request_id, key_id=key_id,
                   refusal_id=refusal.sample_id, batch_id=_batch_with_errors(world))
    people = {"member": world.member_a, "admin": world.admin, "finance": world.finance}

    failures, visited = [], 0
    anonymous = browser.new_context(base_url=live_server.url, viewport={"width": 390, "height": 800})
    login_page = anonymous.new_page()
    login_page.goto("/accounts/login/")
    found = login_page.evaluate(OVERFLOW_JS)
    if found["scroll"] > found["inner"]:
        failures.append(f"anonymous 390px /accounts/login/: {found}")
    anonymous.close()
    for role, user in people.items():
        context = browser.new_context(base_url=live_server.url, viewport={"width": 1400, "height": 900})
        context.set_default_timeout(15_000)
        page = context.new_page()
        page.goto("/accounts/login/")
        page.fill("#id_username", user.username)
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_load_state()
        assert "/accounts/login/" not in page.url, f"login failed for {role}"
        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": 900})
            for url in pages[role]:
                response = page.goto(url)
                assert response.status == 200, f"{role} {url}: {response.status}"
                visited += 1
                found = page.evaluate(OVERFLOW_JS)
                if width == 390 and role == "admin":  # the phone pictures, for a look (SLUICE_SCREENSHOTS)
                    shot(page, "phone-" + (url.strip("/").replace("/", "-").replace("?", "-")[:60] or "home"))
                if found["scroll"] > found["inner"]:
                    failures.append(f"{role} {width}px {url}: page {found['scroll']} px wide in {found['inner']}; "
                                    f"sticking out: {found['culprits']}")
        context.close()

    # then every page fits its window, at both widths, for every role
    assert visited == 2 * sum(len(urls) for urls in pages.values())
    assert failures == [], "\n".join(failures)
