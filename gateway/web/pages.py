"""Web UI pages whose data lives in gateway: a workload's jobs, and the
confirmation to revoke an API key (with its last use, which the gateway
buffers in memory and Redis before the database has it)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from budgets.errors import Rejected
from budgets.ledger.pricing import price_table_currency
from budgets.models import UsageRecord
from gateway.core.jobs.lifecycle import job_list_params, jobs_of_workload, jobs_running
from gateway.core.key_usage import key_last_used_at
from gateway.models import Job
from gateway.web.auth import key_use_noted
from tenants.access import api_key_of_tenant, tenant_for_user_or_404
from tenants.models import ApiKey, Workload
from tenants.services import api_key_revoke


@login_required
def workload_jobs(request, slug: str, workload_slug: str):
    """Delayed (with release time), queued, running and finished jobs of one
    workload, newest first, paged like GET /v1/jobs. Members see their own
    tenant's; admins and finance any (read-only: the page changes nothing)."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    try:
        workload = Workload.objects.get(tenant=tenant, slug=workload_slug)
    except Workload.DoesNotExist:
        raise Http404("No such workload.")
    try:
        status, after, limit = job_list_params(status=request.GET.get("status"), after=request.GET.get("after"),
                                               limit=request.GET.get("limit") or "50")
        page = jobs_of_workload(workload_id=workload.id, status=status, after=after, limit=limit)
    except Rejected as rejected:
        return render(request, "gateway/jobs.html", {"tenant": tenant, "workload": workload, "error": rejected.message,
                                                      "statuses": Job.JOB_STATUS_CHOICES}, status=400)
    # Each job's ledger row (one query for the page): its tokens, cost and a link to its request's page.
    request_ids = [job.request_id for job in page.jobs if job.request_id]
    rows = {row.request_id: row for row in UsageRecord.objects.filter(tenant=tenant, request_id__in=request_ids)}
    return render(request, "gateway/jobs.html", {
        "tenant": tenant, "workload": workload, "running": jobs_running(jobs=page.jobs), "has_more": page.has_more,
        "status": status, "statuses": Job.JOB_STATUS_CHOICES, "next_after": page.jobs[-1].id if page.has_more else None,
        "jobs": [(job, rows.get(job.request_id)) for job in page.jobs], "currency": price_table_currency(),
    })


@login_required
@require_http_methods(["GET", "POST"])
def api_key_revoke_page(request, slug: str, key_id: int):
    """GET: a page that says what revoking does and asks to confirm. POST
    with ``confirm=revoke``: revoke. A POST without it (a stale form, a
    script) is shown the confirmation, never acted on."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        key = api_key_of_tenant(tenant=tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.")
    if request.method == "POST" and request.POST.get("confirm") == "revoke":
        api_key_revoke(api_key=key)
        messages.success(request, f"Key {key.prefix}… of {key.workload.slug} is revoked: calls with it are refused "
                                  f"within a second on every gateway process.")
        return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#keys")
    return render(request, "tenants/api_key_revoke.html", {
        "tenant": tenant, "key": key, "poll_s": settings.SLUICE_AUTH_REVOCATION_POLL_S,
        "last_used_at": key_last_used_at(key_id=key.id, stored=key.last_used_at, noted=key_use_noted(key_id=key.id)),
    }, status=200 if request.method == "GET" else 400)
