"""Web UI pages whose data lives in gateway: a workload's jobs."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render

from budgets.errors import Rejected
from budgets.ledger.pricing import price_table_currency
from budgets.models import UsageRecord
from gateway.core.jobs.lifecycle import job_list_params, jobs_of_workload, jobs_running
from gateway.models import Job
from tenants.access import tenant_for_user_or_404
from tenants.models import Workload


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
                                                      "statuses": Job.Status.choices}, status=400)
    # Each job's ledger row (one query for the page): its tokens, cost and a link to its request's page.
    request_ids = [job.request_id for job in page.jobs if job.request_id]
    rows = {row.request_id: row for row in UsageRecord.objects.filter(tenant=tenant, request_id__in=request_ids)}
    return render(request, "gateway/jobs.html", {
        "tenant": tenant, "workload": workload, "running": jobs_running(jobs=page.jobs), "has_more": page.has_more,
        "status": status, "statuses": Job.Status.choices, "next_after": page.jobs[-1].id if page.has_more else None,
        "jobs": [(job, rows.get(job.request_id)) for job in page.jobs], "currency": price_table_currency(),
    })
