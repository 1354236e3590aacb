"""Selectors that read budget requests: a tenant's own (for members), those
of every tenant a user may read (the management API), and the review queue
(for platform admins; views check the role)."""

from __future__ import annotations

from django.db.models import Case, IntegerField, QuerySet, Value, When

from tenants.access import tenant_ids_for_user
from tenants.models import Tenant

from budgets.models import BudgetRequest, BudgetRequestEvent

_RELATED = ("tenant", "pool", "workload", "requested_by", "decided_by")


def budget_requests_of_tenant(*, tenant: Tenant) -> QuerySet[BudgetRequest]:
    return BudgetRequest.objects.filter(tenant=tenant).select_related(*_RELATED).order_by("-created_at")


def budget_request_of_tenant(*, tenant: Tenant, request_id: int) -> BudgetRequest:
    """Another tenant's request raises DoesNotExist."""
    return BudgetRequest.objects.select_related(*_RELATED).get(tenant=tenant, pk=request_id)


def budget_requests_for_user(*, user, status: str | None = None,
                             tenant_slug: str | None = None) -> QuerySet[BudgetRequest]:
    """Requests of the tenants the user may read, newest first, with their history."""
    queryset = BudgetRequest.objects.select_related(*_RELATED)
    tenant_ids = tenant_ids_for_user(user=user)
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=tenant_ids)
    if status:
        queryset = queryset.filter(status=status)
    if tenant_slug:
        queryset = queryset.filter(tenant__slug=tenant_slug)
    return queryset.prefetch_related("events").order_by("-created_at")


def budget_request_for_user(*, user, request_id: int) -> BudgetRequest:
    """A request of a tenant the user may read; another tenant's raises DoesNotExist."""
    return budget_requests_for_user(user=user).get(pk=request_id)


def budget_requests_pending_count() -> int:
    return BudgetRequest.objects.filter(status=BudgetRequest.Status.PENDING).count()


def budget_requests_for_review(*, status: str | None = None) -> QuerySet[BudgetRequest]:
    """Every tenant's requests, pending first (platform admins only)."""
    queryset = BudgetRequest.objects.select_related(*_RELATED)
    if status:
        queryset = queryset.filter(status=status)
    return queryset.annotate(
        pending_first=Case(When(status=BudgetRequest.Status.PENDING, then=Value(0)), default=Value(1),
                           output_field=IntegerField())
    ).order_by("pending_first", "-created_at")


def budget_request_for_review(*, request_id: int) -> BudgetRequest:
    return BudgetRequest.objects.select_related(*_RELATED).get(pk=request_id)


def budget_request_history(*, request: BudgetRequest) -> list[BudgetRequestEvent]:
    return list(request.events.select_related("actor").order_by("created_at", "id"))
