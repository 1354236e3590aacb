"""Budget-slice requests: submit, approve against real headroom (never
oversubscribing, even under concurrent approvals), reject, expire, and an
audit history nobody can edit."""

from __future__ import annotations

import threading
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from budgets.admission import keys
from budgets.services.budget_requests import (
    budget_request_approve,
    budget_request_reject,
    budget_request_submit,
    budget_requests_expire,
)
from budgets.models import AuditImmutable, BudgetRequest, BudgetRequestEvent, Notification, Reservation, SpendBudget
from budgets.selectors.pools import budget_request_preview, pool_headroom
from tests.people import build_world, world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def submit(world, **overrides):
    values = dict(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a, reserved_tpm=200_000,
                  ceiling_tpm=300_000, rpm=1_000, justification="Launch of the new assistant")
    values.update(overrides)
    return budget_request_submit(**values)


def test_submit_records_the_request_and_its_first_event(world):
    request = submit(world, monthly_spend_budget=Decimal("250.00"), spend_hard_cap=True)
    assert request.status == "pending"
    event = request.events.get()
    assert (event.action, event.actor_id, event.actor_name) == ("submitted", world.member_a.id, world.member_a.username)


@pytest.mark.parametrize("overrides, field", [
    ({"ceiling_tpm": 1}, "ceiling_tpm"),
    ({"reserved_tpm": 900_000, "ceiling_tpm": 900_000}, "reserved_tpm"),
    ({"rpm": 9_000}, "rpm"),
    ({"justification": "  "}, "justification"),
    ({"workload": None}, "workload"),
    ({"workload": None, "new_workload_name": "new one", "new_workload_class": "wizard"}, "new_workload_class"),
    ({"ends_on": date(2000, 1, 1)}, "ends_on"),
])
def test_submit_refuses_bad_requests_with_field_errors(world, overrides, field):
    with pytest.raises(ValidationError) as excinfo:
        submit(world, **overrides)
    assert field in excinfo.value.message_dict
    assert BudgetRequest.objects.count() == 0


def test_another_tenants_workload_is_refused(world):
    with pytest.raises(ValidationError) as excinfo:
        submit(world, workload=world.wl_b)
    assert "workload" in excinfo.value.message_dict


def test_approval_reserves_the_slice_and_reaches_admission_on_commit(world, redis_client, django_capture_on_commit_callbacks):
    request = submit(world, monthly_spend_budget=Decimal("250"), spend_soft_threshold=0.7, spend_hard_cap=True)
    with django_capture_on_commit_callbacks(execute=True):
        budget_request_approve(request_id=request.pk, approver=world.admin, comment="ok for Q4")
    reservation = Reservation.objects.get(workload=world.wl_a)
    assert (reservation.reserved_tpm, reservation.ceiling_tpm, reservation.rpm) == (200_000, 300_000, 1_000)
    # the bucket config in Redis follows: the ceiling bucket refills at 300,000 TPM
    config = redis_client.hgetall(keys.pool_config(world.pool.id))
    assert float(config[f"{world.wl_a.id}.E.tok.rate"]) == pytest.approx(300_000 / 60_000)
    request.refresh_from_db()
    assert (request.status, request.decided_by_id, request.decision_comment) == ("approved", world.admin.id, "ok for Q4")
    budget = SpendBudget.objects.get(workload=world.wl_a)
    assert (budget.monthly_amount, budget.soft_threshold, budget.hard_cap) == (Decimal("250"), 0.7, True)
    approved = request.events.get(action="approved")
    assert approved.details["headroom_before"]["reserved_tpm"] == 150_000
    assert approved.details["headroom_after"]["reserved_tpm"] == 250_000
    assert approved.details["previous_reservation"]["reserved_tpm"] == 100_000
    assert Notification.objects.get(tenant=world.tenant_a).kind == "request_approved"


def test_approving_a_new_workload_creates_it_with_caps_that_fit(world):
    request = submit(world, workload=None, new_workload_name="Nightly digest", new_workload_class="batch",
                     reserved_tpm=8_000, ceiling_tpm=8_000, rpm=20)
    budget_request_approve(request_id=request.pk, approver=world.admin)
    request.refresh_from_db()
    workload = request.workload
    assert workload.tenant_id == world.tenant_a.id and workload.workload_class == "batch"
    assert workload.prompt_tokens_cap + workload.max_tokens_cap <= 8_000 * 15 / 60
    assert Reservation.objects.get(workload=workload).reserved_tpm == 8_000


def test_approval_never_oversubscribes(world):
    # the pool's admission budget is 800,000 TPM; 150,000 are reserved
    # (wl_a's own 100,000 would be replaced: 50,000 + 760,000 > 800,000)
    request = submit(world, reserved_tpm=760_000, ceiling_tpm=760_000)
    preview = budget_request_preview(request=request)
    assert not preview.fits and "reserved_tpm" in preview.problems
    assert preview.after.free_tpm == 800_000 - 50_000 - 760_000 == -10_000
    with pytest.raises(ValidationError) as excinfo:
        budget_request_approve(request_id=request.pk, approver=world.admin)
    assert "reserved_tpm" in excinfo.value.message_dict
    request.refresh_from_db()
    assert request.status == "pending"
    assert Reservation.objects.get(workload=world.wl_a).reserved_tpm == 100_000


def test_a_decided_request_cannot_be_decided_again(world):
    request = submit(world)
    budget_request_reject(request_id=request.pk, reviewer=world.admin, comment="not this quarter")
    with pytest.raises(ValidationError):
        budget_request_approve(request_id=request.pk, approver=world.admin)
    with pytest.raises(ValidationError):
        budget_request_reject(request_id=request.pk, reviewer=world.admin, comment="again")
    assert Notification.objects.get().kind == "request_rejected"


def test_rejection_needs_a_comment(world):
    request = submit(world)
    with pytest.raises(ValidationError) as excinfo:
        budget_request_reject(request_id=request.pk, reviewer=world.admin, comment=" ")
    assert "comment" in excinfo.value.message_dict


@pytest.mark.django_db(transaction=True)
def test_concurrent_approvals_never_oversubscribe_the_pool(redis_client):
    # given a pool with 800,000 TPM of admission budget, 150,000 reserved, and
    # six requests of 200,000 each: only three fit
    world = build_world()
    from tenants.models import Workload

    request_ids = []
    for i in range(6):
        workload = Workload.objects.create(tenant=world.tenant_a, name=f"w{i}", slug=f"conc-{i}-{world.pool.slug}",
                                           prompt_tokens_cap=1000, max_tokens_cap=200)
        request_ids.append(submit(world, workload=workload, reserved_tpm=200_000, ceiling_tpm=200_000, rpm=10).pk)
    barrier = threading.Barrier(len(request_ids))
    outcomes: dict[int, str] = {}

    def approve(request_id: int) -> None:
        try:
            barrier.wait()
            budget_request_approve(request_id=request_id, approver=world.admin)
            outcomes[request_id] = "approved"
        except ValidationError:
            outcomes[request_id] = "refused"
        finally:
            close_old_connections()
            connection.close()

    # when six admins approve at the same instant
    threads = [threading.Thread(target=approve, args=(rid,)) for rid in request_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # then exactly three are approved and the pool is never over its budget
    assert sorted(outcomes.values()) == ["approved"] * 3 + ["refused"] * 3
    headroom = pool_headroom(pool=world.pool)
    assert headroom.reserved_tpm == 750_000 <= headroom.admission_tpm
    assert BudgetRequest.objects.filter(status="approved").count() == 3


def test_history_cannot_be_edited_or_deleted(world):
    request = submit(world)
    budget_request_reject(request_id=request.pk, reviewer=world.admin, comment="no")
    event = request.events.first()
    event.comment = "rewritten"
    with pytest.raises(AuditImmutable):
        event.save()
    with pytest.raises(AuditImmutable):
        BudgetRequestEvent.objects.all().update(comment="x")
    with pytest.raises(AuditImmutable):
        BudgetRequestEvent.objects.all().delete()
    request.refresh_from_db()
    request.status = "approved"
    with pytest.raises(AuditImmutable):
        request.save()
    request.refresh_from_db()
    request.reserved_tpm = 1
    with pytest.raises(AuditImmutable):
        request.save()
    with pytest.raises(AuditImmutable):
        request.delete()


@pytest.mark.parametrize("sql", [
    "UPDATE budgets_budgetrequestevent SET comment = 'x'",
    "DELETE FROM budgets_budgetrequestevent",
    "UPDATE budgets_budgetrequest SET reserved_tpm = 1",
    "UPDATE budgets_budgetrequest SET status = 'approved'",
    "UPDATE budgets_budgetrequest SET decision_comment = 'rewritten'",
    "DELETE FROM budgets_budgetrequest",
])
def test_postgresql_refuses_history_edits_from_any_client(world, sql):
    request = submit(world)
    budget_request_reject(request_id=request.pk, reviewer=world.admin, comment="no")
    with pytest.raises(DatabaseError):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    request.refresh_from_db()
    assert (request.status, request.reserved_tpm, request.decision_comment) == ("rejected", 200_000, "no")


def test_expired_slice_restores_the_previous_reservation(world):
    request = submit(world, ends_on=timezone.now().date() + timedelta(days=1))
    budget_request_approve(request_id=request.pk, approver=world.admin)
    assert budget_requests_expire(today=timezone.now().date() + timedelta(days=1)) == 0  # still on its last day
    assert budget_requests_expire(today=timezone.now().date() + timedelta(days=2)) == 1
    reservation = Reservation.objects.get(workload=world.wl_a)
    assert (reservation.reserved_tpm, reservation.ceiling_tpm, reservation.rpm) == (100_000, 150_000, 600)
    request.refresh_from_db()
    assert request.status == "expired"
    assert request.events.last().details["outcome"] == "previous reservation restored"


def test_expired_slice_of_a_new_workload_is_removed(world):
    request = submit(world, workload=None, new_workload_name="pilot", new_workload_class="interactive",
                     reserved_tpm=40_000, ceiling_tpm=40_000, rpm=10, ends_on=timezone.now().date() + timedelta(days=1))
    budget_request_approve(request_id=request.pk, approver=world.admin)
    budget_requests_expire(today=timezone.now().date() + timedelta(days=5))
    request.refresh_from_db()
    assert not Reservation.objects.filter(workload=request.workload).exists()


def _approve_in_child(request_id: int, approver_id: int, barrier, results) -> None:
    from django.contrib.auth.models import User

    approver = User.objects.get(pk=approver_id)
    barrier.wait()
    try:
        budget_request_approve(request_id=request_id, approver=approver)
        results.put((request_id, "approved"))
    except ValidationError:
        results.put((request_id, "refused"))
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_concurrent_approvals_from_separate_processes_never_oversubscribe(redis_client):
    # given five requests of 250,000 TPM on a pool with 650,000 free: two fit
    import multiprocessing

    from django.db import connections
    from tenants.models import Workload

    world = build_world()
    request_ids = []
    for i in range(5):
        workload = Workload.objects.create(tenant=world.tenant_b, name=f"p{i}", slug=f"proc-{i}-{world.pool.slug}",
                                           prompt_tokens_cap=1000, max_tokens_cap=200)
        request_ids.append(budget_request_submit(
            tenant=world.tenant_b, user=world.member_b, pool=world.pool, workload=workload, reserved_tpm=250_000,
            ceiling_tpm=250_000, rpm=10, justification="batch backfill").pk)
    # when five processes (each with its own database connection) approve at once
    connections.close_all()  # children must not inherit the parent's socket
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(len(request_ids)), ctx.Queue()
    children = [ctx.Process(target=_approve_in_child, args=(rid, world.admin.id, barrier, results)) for rid in request_ids]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
    outcomes = sorted(results.get(timeout=5)[1] for _ in children)
    # then exactly two are approved and the pool stays within its budget
    assert outcomes == ["approved"] * 2 + ["refused"] * 3
    assert pool_headroom(pool=world.pool).reserved_tpm == 650_000 <= 800_000
