"""Web UI pages of the Batch API: a workload's batches, one batch (its
lines, errors and plan, and a cancel for those who may change the tenant),
and a batch file's download. Members see their own tenant's; admins and
finance any, finance read-only. The data comes from
gateway/core/batches/selectors.py."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from budgets.errors import Rejected
from budgets.ledger.pricing import price_table_currency
from gateway.core.batches.lifecycle import batch_cancel
from gateway.core.batches.selectors import (
    ERROR_LINES_SHOWN,
    batch_error_lines,
    batch_of_tenant,
    batch_page_params,
    batch_rows,
    batches_of_workload,
    file_of_tenant,
)
from gateway.models import Batch
from gateway.web.batches import file_streamed
from tenants.access import tenant_for_user_or_404, tenant_is_writable
from tenants.models import Tenant, Workload

# Each status's time, in the order a batch passes them.
STATUS_TIMES = (("created_at", "Created"), ("in_progress_at", "In progress"), ("finalizing_at", "Finalizing"),
                ("completed_at", "Completed"), ("failed_at", "Failed"), ("expired_at", "Expired"),
                ("cancelling_at", "Cancelling"), ("cancelled_at", "Cancelled"))


@login_required
def workload_batches(request, slug: str, workload_slug: str):
    """A workload's batches, newest first, paged like GET /v1/batches, with
    a status filter. Read-only for everyone (the cancel is on each batch's page)."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    try:
        workload = Workload.objects.get(tenant=tenant, slug=workload_slug)
    except Workload.DoesNotExist:
        raise Http404("No such workload.")
    context = {"tenant": tenant, "workload": workload, "statuses": Batch.Status.choices,
               "currency": price_table_currency()}
    try:
        status, after, limit = batch_page_params(status=request.GET.get("status"), after=request.GET.get("after"),
                                                 limit=request.GET.get("limit"))
        page = batches_of_workload(workload_id=workload.id, status=status, after=after, limit=limit)
    except Rejected as rejected:
        return render(request, "gateway/batches.html", {**context, "error": rejected.message}, status=400)
    return render(request, "gateway/batches.html", {
        **context, "rows": page.rows, "status": status,
        "next_after": page.rows[-1].batch.id if page.has_more else None,
    })


def _batch_or_404(tenant: Tenant, batch_id: str) -> Batch:
    batch = batch_of_tenant(tenant_id=tenant.id, batch_id=batch_id)
    if batch is None:
        raise Http404("No such batch.")
    return batch


@login_required
def batch_detail_page(request, slug: str, batch_id: str):
    """One batch: its counts, plan, usage and files, its validation errors,
    each status's time, and the first lines of its error file (from its
    lines, linked to their requests' pages)."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    batch = _batch_or_404(tenant, batch_id)
    return render(request, "gateway/batch_detail.html", _detail_context(request, tenant, batch))


def _detail_context(request, tenant: Tenant, batch: Batch) -> dict:
    return {
        "tenant": tenant, "batch": batch, "row": batch_rows([batch])[0], "currency": price_table_currency(),
        "times": [(label, getattr(batch, name)) for name, label in STATUS_TIMES if getattr(batch, name)],
        "error_lines": batch_error_lines(batch), "error_lines_shown": ERROR_LINES_SHOWN,
        "writable": tenant_is_writable(user=request.user, slug=tenant.slug),
    }


@login_required
@require_http_methods(["GET", "POST"])
def batch_cancel_page(request, slug: str, batch_id: str):
    """GET: what cancelling does, and a confirmation. POST with
    ``confirm=cancel``: cancel (POST /v1/batches/{id}/cancel's service). A
    POST without it (a stale form, a script) is shown the confirmation,
    never acted on. Finance and other tenants' members get a 404."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    batch = _batch_or_404(tenant, batch_id)
    if request.method == "POST" and request.POST.get("confirm") == "cancel":
        if batch_rows([batch])[0].active:
            cancelled = batch_cancel(batch)
            messages.success(request, f"Batch {batch.id} is {cancelled.get_status_display().lower()}: no new line "
                                      f"starts; lines already running finish and are billed.")
        else:
            messages.info(request, f"Batch {batch.id} is already {batch.get_status_display().lower()}: "
                                   f"nothing to cancel.")
        return redirect(reverse("batch-detail", kwargs={"slug": tenant.slug, "batch_id": batch.id}))
    return render(request, "gateway/batch_cancel.html", {"tenant": tenant, "batch": batch,
                                                          "row": batch_rows([batch])[0]},
                  status=200 if request.method == "GET" else 400)


@login_required
@require_GET
async def batch_file_download(request, slug: str, file_id: str):
    """A batch file (input, output or errors) as an attachment, streamed;
    any file of the tenant's workloads, another tenant's is a 404."""
    user = await request.auser()
    tenant = await sync_to_async(tenant_for_user_or_404)(user=user, slug=slug)
    stored = await sync_to_async(file_of_tenant)(tenant_id=tenant.id, file_id=file_id)
    if stored is None:
        raise Http404("No such file.")
    return await file_streamed(stored)
