"""Selectors that reach tenant-owned data on behalf of a user (Zulip's
``access_*_by_id``): a view never looks a tenant, workload or key up on its
own. Another tenant's object raises ``DoesNotExist``, exactly like one that
does not exist, so views answer 404 and leak nothing.

Why 404 and not 403: a 403 would confirm that the slug or id exists, which
tells a member of one tenant which other tenants, workloads and keys there
are. A tenant the user may not read, or may not change (a finance auditor, a
member of another tenant), is answered as if it did not exist.
``tenant_for_user_or_404`` is the one place that turns this into ``Http404``;
the management API's exception handler (llm_platform/api_errors.py) renders
it, and any ``ObjectDoesNotExist``, as DRF's ``{"detail": "Not found."}``."""

from __future__ import annotations

from django.db.models import QuerySet
from django.http import Http404

from tenants.models import ApiKey, Tenant, Workload
from tenants.roles import user_is_platform_admin, user_may_write, user_sees_all_tenants


def tenants_for_user(*, user) -> QuerySet[Tenant]:
    """Tenants the user may read: all for admins and finance, else their memberships."""
    if user_sees_all_tenants(user):
        return Tenant.objects.all()
    if not (user and user.is_authenticated and user.is_active):
        return Tenant.objects.none()
    return Tenant.objects.filter(memberships__user=user).distinct()


def tenant_ids_for_user(*, user) -> set[int] | None:
    """The ids of the tenants the user may read; None means every tenant."""
    if user_sees_all_tenants(user):
        return None
    return set(tenants_for_user(user=user).values_list("id", flat=True))


def tenant_for_user(*, user, slug: str) -> Tenant:
    """A tenant the user may read, by slug."""
    return tenants_for_user(user=user).get(slug=slug)


def tenant_for_writer(*, user, slug: str) -> Tenant:
    """A tenant the user may change (keys, budget requests): a member, or a
    platform admin; never a finance auditor."""
    if not user_may_write(user):
        raise Tenant.DoesNotExist("read-only user")
    if user_is_platform_admin(user):
        return Tenant.objects.get(slug=slug)
    return Tenant.objects.get(slug=slug, memberships__user=user)


def tenant_for_user_or_404(*, user, slug: str, write: bool = False) -> Tenant:
    """The tenant the user may read (``write=True``: may change), else
    ``Http404``; see the module docstring for why never 403."""
    try:
        if write:
            return tenant_for_writer(user=user, slug=slug)
        return tenant_for_user(user=user, slug=slug)
    except Tenant.DoesNotExist:
        raise Http404("No such tenant.")


def tenant_is_writable(*, user, slug: str) -> bool:
    """Whether the user may change the tenant (to show or hide write controls)."""
    try:
        tenant_for_writer(user=user, slug=slug)
    except Tenant.DoesNotExist:
        return False
    return True


def workload_of_tenant(*, tenant: Tenant, workload_id: int) -> Workload:
    return Workload.objects.get(tenant=tenant, pk=workload_id)


def workloads_of_tenant(*, tenant: Tenant) -> QuerySet[Workload]:
    return (
        Workload.objects.filter(tenant=tenant)
        .select_related("tenant")
        .order_by("slug")
    )


def workload_for_user(*, user, workload_id: int) -> Workload:
    """A workload of any tenant the user may read, by id."""
    return Workload.objects.get(pk=workload_id, tenant__in=tenants_for_user(user=user))


def workload_for_user_by_slug(*, user, slug: str) -> Workload:
    """A workload of any tenant the user may read, by slug."""
    return Workload.objects.get(slug=slug, tenant__in=tenants_for_user(user=user))


def api_key_of_tenant(*, tenant: Tenant, key_id: int) -> ApiKey:
    return ApiKey.objects.select_related("workload").get(workload__tenant=tenant, pk=key_id)


def api_keys_of_tenant(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(workload__tenant=tenant).select_related("workload").order_by("-created_at")
