"""Every reservation write runs under its pool's row lock and re-checks the
pool's headroom, like an approval: Django admin's add, change and delete, a
pool's limits edited in the admin, and the expiry of an approved slice.
Real PostgreSQL, the real admin views through Django's test client."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from budgets.models import BudgetRequest, InferencePool, Reservation
from budgets.services.budget_requests import budget_request_approve, budget_request_submit, budget_requests_expire
from tests.people import make_user

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def admin_client():
    client = Client()
    client.force_login(make_user("root", superuser=True))
    return client


def form_data(reservation: Reservation, **changes) -> dict:
    data = {"workload": reservation.workload_id, "pool": reservation.pool_id, "rank": reservation.rank,
            "reserved_tpm": reservation.reserved_tpm,
            "ceiling_tpm": reservation.ceiling_tpm, "lend_fraction": reservation.lend_fraction, "rpm": reservation.rpm,
            "max_concurrency": reservation.max_concurrency}
    data.update(changes)
    return data


def reserved_on(pool: InferencePool) -> int:
    return Reservation.objects.filter(pool=pool).aggregate(t=Sum("reserved_tpm"))["t"] or 0


def test_admin_change_over_headroom_is_refused_with_a_clear_message(make_caller, admin_client):
    # given a pool admitting 800,000 TPM with 500,000 + 200,000 reserved
    big = make_caller(reserved_tpm=500_000)
    small = make_caller(pool=big.pool, reserved_tpm=200_000)
    # when an admin raises the small one to 400,000 in Django admin
    url = reverse("admin:budgets_reservation_change", args=[small.reservation.pk])
    response = admin_client.post(url, form_data(small.reservation, reserved_tpm=400_000, ceiling_tpm=400_000))
    # then the form is shown again with why, and nothing changed
    assert response.status_code == 200
    assert (f"Reservations on {big.pool} would sum to 900000 TPM, above its admission budget of 800000 TPM."
            in response.content.decode())
    small.reservation.refresh_from_db()
    assert small.reservation.reserved_tpm == 200_000
    # and a change that fits is saved
    response = admin_client.post(url, form_data(small.reservation, reserved_tpm=300_000, ceiling_tpm=300_000))
    assert response.status_code == 302
    small.reservation.refresh_from_db()
    assert (small.reservation.reserved_tpm, reserved_on(big.pool)) == (300_000, 800_000)


def test_admin_add_and_delete_go_through_the_service(make_caller, admin_client, monkeypatch):
    # given a pool with room for one more slice
    caller = make_caller(reserved_tpm=500_000)
    spare = make_caller(reserved_tpm=100_000)  # a workload on another pool, to move
    locked: list[int] = []
    import budgets.services.reservations as service

    real_lock = service.pool_lock
    monkeypatch.setattr(service, "pool_lock", lambda *, pool_id: locked.append(pool_id) or real_lock(pool_id=pool_id))
    # when an admin moves the spare workload onto the pool, over its headroom, then within it
    url = reverse("admin:budgets_reservation_change", args=[spare.reservation.pk])
    refused = admin_client.post(url, form_data(spare.reservation, pool=caller.pool.pk, reserved_tpm=400_000,
                                               ceiling_tpm=400_000))
    moved = admin_client.post(url, form_data(spare.reservation, pool=caller.pool.pk, reserved_tpm=300_000,
                                             ceiling_tpm=300_000))
    # then the first is refused, the second saved, each under the pool's lock
    assert (refused.status_code, moved.status_code) == (200, 302)
    assert reserved_on(caller.pool) == 800_000
    assert locked and set(locked) == {caller.pool.pk}
    # when the admin deletes it, that too takes the pool's lock
    locked.clear()
    deleted = admin_client.post(reverse("admin:budgets_reservation_delete", args=[spare.reservation.pk]),
                                {"post": "yes"})
    assert deleted.status_code == 302
    assert not Reservation.objects.filter(pk=spare.reservation.pk).exists()
    assert locked == [caller.pool.pk]


def test_two_concurrent_admin_writes_cannot_together_exceed_the_pool(make_caller, monkeypatch):
    # given a pool admitting 800,000 TPM with 400,000 reserved and two
    # workloads each asking for 300,000 more: each fits alone, not both
    base = make_caller(reserved_tpm=400_000)
    first = make_caller(pool=base.pool, reserved_tpm=1_000, ceiling_tpm=40_000)
    second = make_caller(pool=base.pool, reserved_tpm=1_000, ceiling_tpm=40_000)
    root = make_user("root", superuser=True)
    # The first writer stops right after its headroom check passed, until the
    # second has passed its own check too (no lock: both would save) or is
    # waiting for a lock (the pool's: it checks after the first saved).
    real_clean = Reservation.clean
    first_checked, second_checked, go = threading.Event(), threading.Event(), threading.Event()

    def clean(self):
        real_clean(self)
        if threading.current_thread().name == "first":
            first_checked.set()
            assert go.wait(timeout=30)
        elif threading.current_thread().name == "second":
            second_checked.set()

    monkeypatch.setattr(Reservation, "clean", clean)
    statuses: dict[str, int] = {}

    def write(caller):
        client = Client()
        client.force_login(root)
        url = reverse("admin:budgets_reservation_change", args=[caller.reservation.pk])
        response = client.post(url, form_data(caller.reservation, reserved_tpm=300_000, ceiling_tpm=300_000))
        statuses[threading.current_thread().name] = response.status_code
        connection.close()

    threads = {name: threading.Thread(target=write, args=(caller,), name=name)
               for name, caller in (("first", first), ("second", second))}
    # when both save in Django admin at the same moment
    threads["first"].start()
    assert first_checked.wait(timeout=30)
    threads["second"].start()
    deadline = time.monotonic() + 30
    while not second_checked.is_set() and not _a_query_waits_on_a_lock():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    go.set()
    for thread in threads.values():
        thread.join(timeout=60)
    # then the second found the first's reservation and was refused
    assert statuses == {"first": 302, "second": 200}
    assert reserved_on(base.pool) == 700_000 + 1_000


def _a_query_waits_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0] > 0


def test_admin_pool_edit_below_its_reservations_is_refused(make_caller, admin_client):
    caller = make_caller(reserved_tpm=600_000)
    pool = caller.pool
    url = reverse("admin:budgets_inferencepool_change", args=[pool.pk])
    data = {"name": pool.name, "slug": pool.slug, "base_url": pool.base_url, "api_key_env": "",
            "served_models": '["sim-small"]', "provider_tpm": 500_000, "provider_rpm": pool.provider_rpm,
            "headroom": pool.headroom, "burst_seconds": pool.burst_seconds, "max_concurrency": pool.max_concurrency,
            "tokenizer": pool.tokenizer, "estimate_safety_factor": 1.0, "is_active": "on"}
    response = admin_client.post(url, data)
    assert response.status_code == 200
    assert "Existing reservations exceed the new admission budget." in response.content.decode()
    pool.refresh_from_db()
    assert pool.provider_tpm == 1_000_000
    assert admin_client.post(url, {**data, "provider_tpm": 750_000}).status_code == 302
    pool.refresh_from_db()
    assert pool.provider_tpm == 750_000


def test_an_expired_slice_whose_old_reservation_no_longer_fits_stays_as_approved(make_caller):
    # given a workload of 300,000 TPM that asked to shrink to 100,000 for a while,
    # and another workload that took the freed headroom meanwhile
    from tenants.models import Membership

    caller = make_caller(reserved_tpm=300_000)
    member = make_user("member")
    Membership.objects.create(user=member, tenant=caller.tenant, role=Membership.Role.MEMBER)
    request = budget_request_submit(tenant=caller.tenant, user=member, pool=caller.pool, workload=caller.workload,
                                    reserved_tpm=100_000, ceiling_tpm=100_000, rpm=1_000, justification="quiet month",
                                    ends_on=timezone.now().date() + timedelta(days=1))
    budget_request_approve(request_id=request.pk, approver=make_user("root", superuser=True))
    make_caller(pool=caller.pool, reserved_tpm=650_000)
    # when the slice ends
    assert budget_requests_expire(today=timezone.now().date() + timedelta(days=2)) == 1
    # then the pool is not oversubscribed, and the history says why
    caller.reservation.refresh_from_db()
    assert caller.reservation.reserved_tpm == 100_000
    assert reserved_on(caller.pool) == 750_000
    request.refresh_from_db()
    assert request.status == BudgetRequest.Status.EXPIRED
    outcome = request.events.last().details["outcome"]
    assert outcome.startswith("the previous reservation no longer fits the pool (Reservations on")
    assert outcome.endswith("; left as approved")
