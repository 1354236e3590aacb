"""Roles and the tenant-scoped selectors, with cross-tenant cases."""

from __future__ import annotations

import pytest
from django.http import Http404

from budgets.models import InferencePool
from budgets.selectors.pools import pool_for_user, pools_for_user
from budgets.selectors.requests import (
    budget_request_for_user,
    budget_request_of_tenant,
    budget_requests_for_user,
    budget_requests_of_tenant,
)
from budgets.services.budget_requests import budget_request_submit
from budgets.models import BudgetRequest
from tenants.access import (
    api_key_of_tenant,
    api_keys_of_tenant,
    tenant_for_user,
    tenant_for_user_or_404,
    tenant_for_writer,
    tenant_ids_for_user,
    tenant_is_writable,
    tenants_for_user,
    workload_for_user,
    workload_for_user_by_slug,
    workload_of_tenant,
    workloads_of_tenant,
)
from tenants.models import ApiKey, Membership, Tenant, Workload
from tenants.roles import user_is_finance_auditor, user_is_platform_admin, user_may_write, user_sees_all_tenants
from tests.people import make_user

pytestmark = pytest.mark.django_db


def test_roles(world):
    assert user_is_platform_admin(world.admin) and not user_is_finance_auditor(world.admin)
    assert user_is_finance_auditor(world.finance) and not user_is_platform_admin(world.finance)
    assert not user_may_write(world.finance) and user_may_write(world.member_a) and user_may_write(world.admin)
    assert user_sees_all_tenants(world.finance) and not user_sees_all_tenants(world.member_a)


def test_finance_stays_read_only_even_with_a_membership(world):
    Membership.objects.create(tenant=world.tenant_a, user=world.finance)
    with pytest.raises(Tenant.DoesNotExist):
        tenant_for_writer(user=world.finance, slug=world.tenant_a.slug)


def test_an_inactive_user_sees_nothing(world):
    world.member_a.is_active = False
    world.member_a.save()
    assert list(tenants_for_user(user=world.member_a)) == []


def test_members_see_their_tenants_only(world):
    assert list(tenants_for_user(user=world.member_a)) == [world.tenant_a]
    assert tenant_ids_for_user(user=world.member_b) == {world.tenant_b.id}
    assert tenant_ids_for_user(user=world.finance) is None
    assert set(tenants_for_user(user=world.admin)) >= {world.tenant_a, world.tenant_b}
    with pytest.raises(Tenant.DoesNotExist):
        tenant_for_user(user=world.member_a, slug=world.tenant_b.slug)
    with pytest.raises(Tenant.DoesNotExist):
        tenant_for_writer(user=world.member_a, slug=world.tenant_b.slug)


def test_a_member_of_two_tenants_sees_both(world):
    Membership.objects.create(tenant=world.tenant_b, user=world.member_a)
    assert set(tenants_for_user(user=world.member_a)) == {world.tenant_a, world.tenant_b}


def test_workloads_and_keys_are_scoped_by_tenant(world):
    assert list(workloads_of_tenant(tenant=world.tenant_a)) == [world.wl_a]
    with pytest.raises(Workload.DoesNotExist):
        workload_of_tenant(tenant=world.tenant_a, workload_id=world.wl_b.id)
    key_b = ApiKey.objects.get(workload=world.wl_b)
    assert key_b not in api_keys_of_tenant(tenant=world.tenant_a)
    with pytest.raises(ApiKey.DoesNotExist):
        api_key_of_tenant(tenant=world.tenant_a, key_id=key_b.id)


def test_budget_requests_are_scoped_by_tenant(world):
    request_b = budget_request_submit(tenant=world.tenant_b, user=world.member_b, pool=world.pool, workload=world.wl_b,
                                      reserved_tpm=1, ceiling_tpm=40_000, rpm=1, justification="b")
    assert list(budget_requests_of_tenant(tenant=world.tenant_a)) == []
    with pytest.raises(BudgetRequest.DoesNotExist):
        budget_request_of_tenant(tenant=world.tenant_a, request_id=request_b.pk)
    assert budget_request_of_tenant(tenant=world.tenant_b, request_id=request_b.pk) == request_b


def test_tenant_or_404_answers_another_tenants_slug_with_404_for_read_and_write(world):
    assert tenant_for_user_or_404(user=world.member_a, slug=world.tenant_a.slug) == world.tenant_a
    assert tenant_for_user_or_404(user=world.member_a, slug=world.tenant_a.slug, write=True) == world.tenant_a
    with pytest.raises(Http404):
        tenant_for_user_or_404(user=world.member_a, slug=world.tenant_b.slug)
    with pytest.raises(Http404):
        tenant_for_user_or_404(user=world.member_a, slug=world.tenant_b.slug, write=True)
    with pytest.raises(Http404):
        tenant_for_user_or_404(user=world.member_a, slug="no-such-tenant")


def test_tenant_or_404_lets_finance_read_but_answers_404_on_write(world):
    Membership.objects.create(tenant=world.tenant_a, user=world.finance)
    assert tenant_for_user_or_404(user=world.finance, slug=world.tenant_b.slug) == world.tenant_b
    with pytest.raises(Http404):
        tenant_for_user_or_404(user=world.finance, slug=world.tenant_a.slug, write=True)
    with pytest.raises(Http404):
        tenant_for_user_or_404(user=world.finance, slug=world.tenant_b.slug, write=True)
    assert tenant_for_user_or_404(user=world.admin, slug=world.tenant_b.slug, write=True) == world.tenant_b


def test_tenant_is_writable_only_for_its_members_and_admins(world):
    assert tenant_is_writable(user=world.member_a, slug=world.tenant_a.slug) is True
    assert tenant_is_writable(user=world.admin, slug=world.tenant_a.slug) is True
    assert tenant_is_writable(user=world.member_a, slug=world.tenant_b.slug) is False
    assert tenant_is_writable(user=world.finance, slug=world.tenant_a.slug) is False


def test_workloads_for_a_user_are_scoped_to_the_tenants_they_read(world):
    assert workload_for_user(user=world.member_a, workload_id=world.wl_a.id) == world.wl_a
    assert workload_for_user_by_slug(user=world.member_a, slug=world.wl_a.slug) == world.wl_a
    with pytest.raises(Workload.DoesNotExist):
        workload_for_user(user=world.member_a, workload_id=world.wl_b.id)
    with pytest.raises(Workload.DoesNotExist):
        workload_for_user_by_slug(user=world.member_a, slug=world.wl_b.slug)
    assert workload_for_user(user=world.finance, workload_id=world.wl_b.id) == world.wl_b
    assert workload_for_user_by_slug(user=world.admin, slug=world.wl_b.slug) == world.wl_b


def test_budget_requests_for_a_user_are_scoped_to_the_tenants_they_read(world):
    # given one request in each tenant
    request_a = budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                      reserved_tpm=1, ceiling_tpm=40_000, rpm=1, justification="a")
    request_b = budget_request_submit(tenant=world.tenant_b, user=world.member_b, pool=world.pool, workload=world.wl_b,
                                      reserved_tpm=1, ceiling_tpm=40_000, rpm=1, justification="b")
    # then
    assert list(budget_requests_for_user(user=world.member_a)) == [request_a]
    assert list(budget_requests_for_user(user=world.member_a, tenant_slug=world.tenant_b.slug)) == []
    assert list(budget_requests_for_user(user=world.admin, tenant_slug=world.tenant_b.slug)) == [request_b]
    assert list(budget_requests_for_user(user=world.finance, status="approved")) == []
    assert budget_request_for_user(user=world.member_a, request_id=request_a.pk) == request_a
    with pytest.raises(BudgetRequest.DoesNotExist):
        budget_request_for_user(user=world.member_a, request_id=request_b.pk)


def test_inactive_pools_are_seen_by_platform_admins_only(world):
    InferencePool.objects.filter(pk=world.pool.pk).update(is_active=False)
    assert list(pools_for_user(user=world.admin).filter(pk=world.pool.pk)) == [world.pool]
    assert list(pools_for_user(user=world.member_a).filter(pk=world.pool.pk)) == []
    assert pool_for_user(user=world.admin, slug=world.pool.slug) == world.pool
    with pytest.raises(InferencePool.DoesNotExist):
        pool_for_user(user=world.member_a, slug=world.pool.slug)


def test_staff_user_without_superuser_is_an_admin_not_finance(world):
    staff = make_user("staff-only", staff=True)
    assert user_is_platform_admin(staff) and not user_is_finance_auditor(staff)


def test_the_finance_auditors_group_grants_the_audit_permission():
    from django.contrib.auth.models import Group

    group = Group.objects.get(name="Finance auditors")
    assert list(group.permissions.values_list("codename", flat=True)) == ["audit_all_tenants"]
