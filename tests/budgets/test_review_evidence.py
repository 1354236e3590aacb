"""The admin's review page weighs a request against evidence: the
workload's peak and p95 use per minute over the last 7 and 30 days against
its current slice, the pool's effective capacity now, the red/green "free if
approved", and approval of a smaller amount than asked."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from budgets.admission import keys
from budgets.models import BudgetRequest, Notification, Reservation
from budgets.selectors.usage import workload_minute_use
from budgets.services.budget_requests import budget_request_approve, budget_request_submit
from tests.people import ledger_add

pytestmark = pytest.mark.django_db


def submit(world, **overrides):
    values = dict(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a, reserved_tpm=200_000,
                  ceiling_tpm=300_000, rpm=1_000, justification="Launch of the new assistant")
    values.update(overrides)
    return budget_request_submit(**values)


def _use_row(body: str, days: int) -> tuple[int, int, str]:
    row = re.search(rf'<tr data-days="{days}">(.*?)</tr>', body, re.S).group(1)
    values = re.findall(r'data-value="(\d+)"', row)
    busy = re.findall(r'<td class="num">([\d,]+)</td>', row)[0]
    return int(values[0]), int(values[1]), busy


def test_the_review_page_shows_peak_and_p95_use_for_7_and_30_days(login, world, redis_client):
    # given 20 busy minutes in the last week (150 tokens each, one of them at
    # 2,150) and, 20 days ago, one minute of 8,150 tokens
    now = timezone.now().replace(second=30, microsecond=0)
    for minute in range(1, 21):
        ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(days=2, minutes=minute),
                   input_tokens=100, output_tokens=50)
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(days=2, minutes=3, seconds=10),
               input_tokens=1_500, output_tokens=500)
    for _ in range(4):
        ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(days=20), input_tokens=2_000,
                   output_tokens=37)
    ledger_add(workload=world.wl_b, pool=world.pool, at=now - timedelta(days=1), input_tokens=90_000)  # another workload
    request = submit(world)

    # then the selector and the page agree on exact figures
    week = workload_minute_use(workload_id=world.wl_a.id, now=timezone.now(), days=7)
    assert (week.peak_tpm, week.p95_tpm, week.busy_minutes) == (2_150, 150, 20)
    month = workload_minute_use(workload_id=world.wl_a.id, now=timezone.now(), days=30)
    # 21 busy minutes; the nearest rank of the 95th percentile is the 20th: 2,150
    assert (month.peak_tpm, month.p95_tpm, month.busy_minutes) == (8_148, 2_150, 21)
    body = login(world.admin).get(f"/ops/requests/{request.pk}/").content.decode()
    assert _use_row(body, 7) == (2_150, 150, "20")
    assert _use_row(body, 30) == (8_148, 2_150, "21")
    assert re.search(r'<tr data-days="7">.*?<td class="num">100,000</td><td class="num">200,000</td>', body, re.S)


def test_the_review_page_shows_the_pools_effective_capacity(login, world, redis_client):
    request = submit(world)
    client = login(world.admin)
    body = client.get(f"/ops/requests/{request.pk}/").content.decode()
    assert re.search(r'id="effective-capacity">.*?data-value="(\d+)"', body, re.S).group(1) == "800000"
    # when upstream throttling has halved the pool's adaptive factor
    redis_client.hset(keys.pool_capacity(world.pool.id), mapping={"factor": 0.5, "throttles": 3})
    body = client.get(f"/ops/requests/{request.pk}/").content.decode()
    card = body.split('id="effective-capacity">')[1].split("</div>\n")[0]
    assert re.search(r'data-value="(\d+)"', card).group(1) == "400000"
    assert "50% of the admission budget" in card and "3 429s so far" in card


def test_free_if_approved_is_green_when_it_fits_and_red_when_not(login, world):
    client = login(world.admin)
    fits = submit(world)
    body = client.get(f"/ops/requests/{fits.pk}/").content.decode()
    assert re.search(r'<div class="value good" id="free-after">550,000</div>', body)
    too_big = submit(world, workload=world.wl_b, tenant=world.tenant_b, user=world.member_b, reserved_tpm=800_000,
                     ceiling_tpm=800_000)
    body = client.get(f"/ops/requests/{too_big.pk}/").content.decode()
    assert re.search(r'<div class="value bad" id="free-after">-100,000</div>', body)
    assert body.count('id="free-after"') == 1 and 'id="free-after" class=' not in body


def test_an_admin_approves_a_smaller_amount_than_asked(login, world, django_capture_on_commit_callbacks):
    request = submit(world)
    client = login(world.admin)
    # out of bounds: above what was asked, or nothing
    for amount in ("200001", "0"):
        response = client.post(f"/ops/requests/{request.pk}/approve", {"comment": "", "reserved_tpm": amount})
        assert response.status_code == 400
    assert "Approve between 1 and the 200,000 TPM asked for." in client.post(
        f"/ops/requests/{request.pk}/approve", {"reserved_tpm": "200001"}).content.decode()
    assert BudgetRequest.objects.get(pk=request.pk).status == "pending"
    # when the admin approves 120,000 of the 200,000 asked
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/ops/requests/{request.pk}/approve", {"comment": "start smaller", "reserved_tpm": "120000"})
    assert response.status_code == 302
    reservation = Reservation.objects.get(workload=world.wl_a)
    assert (reservation.reserved_tpm, reservation.ceiling_tpm, reservation.rpm) == (120_000, 300_000, 1_000)
    request.refresh_from_db()
    assert (request.status, request.reserved_tpm) == ("approved", 200_000)  # the request keeps what was asked
    details = request.events.get(action="approved").details
    assert (details["requested_reserved_tpm"], details["approved_reserved_tpm"]) == (200_000, 120_000)
    assert "120,000 TPM reserved (of 200,000 asked)" in Notification.objects.get(tenant=world.tenant_a).message


def test_approving_without_an_amount_grants_what_was_asked(world):
    request = submit(world)
    budget_request_approve(request_id=request.pk, approver=world.admin)
    assert Reservation.objects.get(workload=world.wl_a).reserved_tpm == 200_000
    assert request.events.get(action="approved").details["approved_reserved_tpm"] == 200_000
