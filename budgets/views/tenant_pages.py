"""The tenant page (members) and its budget requests."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from tenants.access import tenant_for_user, tenant_for_writer
from tenants.models import Tenant
from tenants.roles import user_may_write

from ..budget_requests import budget_request_submit
from ..dashboards import tenant_dashboard
from ..forms import NEW, ApiKeyForm, BudgetRequestForm
from ..models_requests import BudgetRequest
from ..selectors_pool import pool_headroom, pools_active
from ..selectors_requests import budget_request_history, budget_request_of_tenant
from . import presenters


def readable_tenant(request, slug: str) -> Tenant:
    try:
        return tenant_for_user(user=request.user, slug=slug)
    except Tenant.DoesNotExist:
        raise Http404("No such tenant.")


def writable_tenant(request, slug: str) -> Tenant:
    try:
        return tenant_for_writer(user=request.user, slug=slug)
    except Tenant.DoesNotExist:
        raise Http404("No such tenant.")


@login_required
def tenant_detail(request, slug: str):
    tenant = readable_tenant(request, slug)
    dashboard = tenant_dashboard(tenant=tenant, now=timezone.now())
    panels = [
        {"panel": p, "minute_chart": presenters.workload_minute_chart(p), "daily_chart": presenters.workload_daily_chart(p),
         "spend_bar": presenters.spend_bar(p.spend) if p.spend else None}
        for p in dashboard.panels
    ]
    spend_rows = [{"status": s, "bar": presenters.spend_bar(s)} for s in dashboard.spend_statuses]
    return render(request, "budgets/tenant_detail.html", {
        "tenant": tenant, "dashboard": dashboard, "panels": panels, "spend_rows": spend_rows,
        "rejections_chart": presenters.rejections_chart(
            dashboard.rejection_minutes, dashboard.rejections_per_minute, "Rejections per minute by reason, last hour"),
        "can_write": user_may_write(request.user) and _is_writer(request, slug),
        "key_form": ApiKeyForm(tenant=tenant),
    })


def _is_writer(request, slug: str) -> bool:
    try:
        tenant_for_writer(user=request.user, slug=slug)
        return True
    except Tenant.DoesNotExist:
        return False


@login_required
@require_http_methods(["GET", "POST"])
def budget_request_new(request, slug: str):
    tenant = writable_tenant(request, slug)
    form = BudgetRequestForm(request.POST or None, tenant=tenant,
                             initial={"workload": request.GET.get("workload") or NEW})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            created = budget_request_submit(
                tenant=tenant, user=request.user, pool=data["pool"], workload=data["workload_obj"],
                new_workload_name=data.get("new_workload_name") or "", new_workload_class=data.get("new_workload_class") or "",
                reserved_tpm=data["reserved_tpm"], ceiling_tpm=data["ceiling_tpm"], rpm=data["rpm"],
                lend_fraction=data.get("lend_fraction") or 0.0, justification=data["justification"],
                ends_on=data.get("ends_on"), monthly_spend_budget=data.get("monthly_spend_budget"),
                spend_soft_threshold=(data.get("spend_soft_threshold") or 80) / 100.0,
                spend_hard_cap=bool(data.get("spend_hard_cap")),
            )
        except ValidationError as exc:
            for name, messages in exc.message_dict.items():
                form.add_error(name if name in form.fields else None, messages)
        else:
            return redirect("budget-request-detail", slug=tenant.slug, request_id=created.pk)
    pools = [{"pool": p, "headroom": pool_headroom(pool=p)} for p in pools_active()]
    return render(request, "budgets/budget_request_form.html", {"tenant": tenant, "form": form, "pools": pools})


@login_required
def budget_request_detail(request, slug: str, request_id: int):
    tenant = readable_tenant(request, slug)
    try:
        budget_request = budget_request_of_tenant(tenant=tenant, request_id=request_id)
    except BudgetRequest.DoesNotExist:
        raise Http404("No such request.")
    return render(request, "budgets/budget_request_detail.html", {
        "tenant": tenant, "req": budget_request, "history": budget_request_history(request=budget_request),
    })
