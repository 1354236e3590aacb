"""A member withdraws a pending budget request; the request pages show the
workload's current reservation beside what is requested."""

from __future__ import annotations

import pytest

from budgets.models import BudgetRequest, BudgetRequestEvent
from budgets.services.budget_requests import budget_request_approve, budget_request_submit

pytestmark = pytest.mark.django_db


def submit(world, **numbers) -> BudgetRequest:
    values = {"reserved_tpm": 120_000, "ceiling_tpm": 200_000, "rpm": 700, **numbers}
    return budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                 justification="Holiday traffic", **values)


def test_a_member_withdraws_a_pending_request(login, world):
    request = submit(world)
    client = login(world.member_a)
    page = client.get(f"/t/{world.tenant_a.slug}/requests/{request.pk}/").content.decode()
    assert 'id="withdraw"' in page
    response = client.post(f"/t/{world.tenant_a.slug}/requests/{request.pk}/withdraw", follow=True)
    assert response.redirect_chain == [(f"/t/{world.tenant_a.slug}/requests/{request.pk}/", 302)]
    request.refresh_from_db()
    assert request.status == "withdrawn"
    assert list(request.events.values_list("action", "actor_name")) == [
        ("submitted", world.member_a.username), ("withdrawn", world.member_a.username)]
    body = response.content.decode()
    assert "is withdrawn" in body and 'id="withdraw"' not in body
    # and it left the review queue: approving it now is refused
    admin = login(world.admin)
    admin.post(f"/ops/requests/{request.pk}/approve", {"comment": ""})
    request.refresh_from_db()
    assert request.status == "withdrawn"


def test_only_pending_requests_of_ones_own_tenant_can_be_withdrawn(login, world):
    request = submit(world)
    budget_request_approve(request_id=request.pk, approver=world.admin)
    client = login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/requests/{request.pk}/withdraw", follow=True)
    assert "already approved" in response.content.decode()
    request.refresh_from_db()
    assert request.status == "approved"
    # another tenant's member, under either slug, and finance: 404, nothing changes
    other = submit(world)
    for user, slug in [(world.member_b, world.tenant_a.slug), (world.member_b, world.tenant_b.slug)]:
        assert login(user).post(f"/t/{slug}/requests/{other.pk}/withdraw").status_code == 404
    assert login(world.finance).post(f"/t/{world.tenant_a.slug}/requests/{other.pk}/withdraw").status_code == 403
    other.refresh_from_db()
    assert other.status == "pending"
    assert not BudgetRequestEvent.objects.filter(action="withdrawn").exists()


def test_request_pages_show_current_and_requested(login, world):
    # world.res_a holds 100,000 reserved / 150,000 ceiling / 600 RPM
    request = submit(world)
    for client, url in [(login(world.member_a), f"/t/{world.tenant_a.slug}/requests/{request.pk}/"),
                        (login(world.admin), f"/ops/requests/{request.pk}/")]:
        body = client.get(url).content.decode()
        table = body[body.index('id="current-vs-requested"'):]
        table = table[:table.index("</table>")]
        assert "Current" in table and "Requested" in table
        assert table.index("100,000") < table.index("120,000")
        assert table.index("150,000") < table.index("200,000")
        assert table.index("600") < table.index("700")
