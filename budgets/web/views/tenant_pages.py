"""The tenant page (members) and its budget requests."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from tenants.access import tenant_for_user_or_404, tenant_is_writable

from budgets.selectors.reservations import reservation_of_workload
from budgets.services.budget_requests import budget_request_submit, budget_request_withdraw
from budgets.web.dashboards import tenant_dashboard
from budgets.web.forms import NEW, ApiKeyForm, BudgetRequestForm
from budgets.models import BudgetRequest
from budgets.selectors.pools import pool_headroom, pools_active
from budgets.selectors.requests import budget_request_history, budget_request_of_tenant
from budgets.ledger.pricing import price_table_currency
from budgets.web.ranges import PRESETS, RangeError, time_range_from
from budgets.web.views import presenters


@login_required
def tenant_detail(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    now = timezone.now()
    try:
        time_range = time_range_from(request.GET, now=now)
    except RangeError as exc:
        return render(request, "budgets/range_error.html", {"tenant": tenant, "error": str(exc)}, status=400)
    dashboard = tenant_dashboard(tenant=tenant, now=now, time_range=time_range)
    panels = [
        {"panel": p, "minute_chart": presenters.workload_minute_chart(p),
         "range_chart": presenters.workload_range_chart(p, time_range.label),
         "spend_bar": presenters.spend_bar(p.spend) if p.spend else None}
        for p in dashboard.panels
    ]
    spend_rows = [{"status": s, "bar": presenters.spend_bar(s)} for s in dashboard.spend_statuses]
    return render(request, "budgets/tenant_detail.html", {
        "tenant": tenant, "dashboard": dashboard, "panels": panels, "spend_rows": spend_rows,
        "rejections_chart": presenters.rejections_chart(
            dashboard.rejection_minutes, dashboard.rejections_per_minute, "Rejections per minute by reason, last hour"),
        "can_write": tenant_is_writable(user=request.user, slug=slug),
        "key_form": ApiKeyForm(tenant=tenant),
        "range": time_range, "presets": PRESETS, "keep": [], "currency": price_table_currency(), "now": now,
    })


@login_required
@require_http_methods(["GET", "POST"])
def budget_request_new(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
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
            for name, problems in exc.message_dict.items():
                form.add_error(name if name in form.fields else None, problems)
        else:
            return redirect("budget-request-detail", slug=tenant.slug, request_id=created.pk)
    pools = [{"pool": p, "headroom": pool_headroom(pool=p)} for p in pools_active()]
    return render(request, "budgets/budget_request_form.html", {"tenant": tenant, "form": form, "pools": pools})


@login_required
def budget_request_detail(request, slug: str, request_id: int):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    try:
        budget_request = budget_request_of_tenant(tenant=tenant, request_id=request_id)
    except BudgetRequest.DoesNotExist:
        raise Http404("No such request.")
    return render(request, "budgets/budget_request_detail.html", {
        "tenant": tenant, "req": budget_request, "history": budget_request_history(request=budget_request),
        "current": reservation_of_workload(workload=budget_request.workload) if budget_request.workload_id else None,
        "can_write": tenant_is_writable(user=request.user, slug=slug),
    })


@login_required
@require_http_methods(["POST"])
def budget_request_withdraw_view(request, slug: str, request_id: int):
    """A member withdraws their tenant's pending request (finance and other
    tenants get 404, like every write)."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        budget_request_withdraw(request_id=request_id, tenant=tenant, user=request.user)
    except BudgetRequest.DoesNotExist:
        raise Http404("No such request.")
    except ValidationError as exc:
        for problems in exc.message_dict.values():
            for problem in problems:
                messages.error(request, problem)
    else:
        messages.success(request, f"Request #{request_id} is withdrawn.")
    return redirect("budget-request-detail", slug=tenant.slug, request_id=request_id)
