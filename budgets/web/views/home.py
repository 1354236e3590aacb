from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render

from tenants.access import tenants_for_user
from tenants.roles import user_is_finance_auditor, user_is_platform_admin


@login_required
def home(request):
    """Send each role to its page."""
    if user_is_platform_admin(request.user):
        return redirect("pool-list")
    if user_is_finance_auditor(request.user):
        return redirect("finance")
    return redirect("tenant-list")


@login_required
def tenant_list(request):
    tenants = list(tenants_for_user(user=request.user))
    if len(tenants) == 1 and not (user_is_platform_admin(request.user) or user_is_finance_auditor(request.user)):
        return redirect("tenant-detail", slug=tenants[0].slug)
    return render(request, "budgets/tenant_list.html", {"tenants": tenants})
