"""The request log's search box: one id of any kind (request, ``chatcmpl-``,
job) opens the request's page; a job that has not run yet opens its
workload's jobs page. Members search their tenant's log, admins and finance
every tenant's."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_safe

from gateway.core.request_lookup import request_find
from tenants.access import tenant_for_user_or_404
from tenants.decorators import auditor_required


def _found(request, *, tenant, tenant_ids: frozenset[int] | None):
    query = (request.GET.get("q") or "").strip()
    found = request_find(tenant_ids=tenant_ids, query=query) if query else None
    if found is not None and found.request_id:
        if tenant is not None:
            return redirect("tenant-request-detail", tenant.slug, found.request_id)
        return redirect("request-detail", found.request_id)
    if found is not None and found.job is not None:
        job = found.job
        return redirect(reverse("workload-jobs", args=[job.tenant.slug, job.workload.slug]) + f"#job-{job.id}")
    return render(request, "gateway/request_find.html", {"tenant": tenant, "query": query}, status=404 if query else 400)


@login_required
@require_safe
def tenant_request_find(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    return _found(request, tenant=tenant, tenant_ids=frozenset({tenant.id}))


@auditor_required
@require_safe
def any_request_find(request):
    return _found(request, tenant=None, tenant_ids=None)
