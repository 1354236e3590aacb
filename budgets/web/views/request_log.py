"""The request log: a tenant's (members, admins, finance) or every tenant's
(admins, finance), filtered, paged by keyset; a request's own page with its
timeline and ledger row; latency percentiles and outcome rates over the
same filters. Read-only for everyone. A request's page is a ledger row's,
or a refusal's (its reason, message, Retry-After, key, workload, time)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_safe

from tenants.access import tenant_for_user_or_404
from tenants.selectors import tenant_slugs_by_id
from tenants.decorators import auditor_required

from budgets.ledger.pricing import price_table_currency
from budgets.models import RejectionSample, UsageRecord
from budgets.selectors.latency import PERCENTILES, latency_by_workload_lane
from budgets.selectors.request_log import (
    TIMING_LABELS,
    TIMINGS,
    Cursor,
    LogFilters,
    log_entry_of_tenants,
    refusal_of_tenants,
    request_log_page,
)
from budgets.web.forms import RequestLogForm
from budgets.web.ranges import PRESETS, RangeError, time_range_from


def _log(request, *, tenant, tenant_ids: frozenset[int] | None):
    form = RequestLogForm(request.GET or None, tenant_ids=tenant_ids)
    context = {"tenant": tenant, "form": form, "presets": PRESETS, "timings": [(t, TIMING_LABELS[t]) for t in TIMINGS],
               "percentiles": PERCENTILES, "currency": price_table_currency(), "errors": []}
    try:
        time_range = time_range_from(request.GET, now=timezone.now())
    except RangeError as exc:
        context["errors"].append(str(exc))
        time_range = None
    if request.GET and not form.is_valid():
        context["errors"].extend(f"{name}: {' '.join(messages)}" for name, messages in form.errors.items())
    if context["errors"]:
        return render(request, "budgets/request_log.html", context, status=400)
    data = form.cleaned_data if request.GET else {}
    if data.get("tenant") is not None:  # only offered on the cross-tenant log
        tenant_ids = frozenset({data["tenant"].id})
    filters = LogFilters(
        start=time_range.start, end=time_range.end, tenant_ids=tenant_ids,
        workload_id=data["workload"].id if data.get("workload") else None,
        api_key_id=data["key"].id if data.get("key") else None, status=data.get("status") or None,
        reason=data.get("reason") or None, lane=data.get("lane") or None, model=data.get("model") or None,
        endpoint=data.get("endpoint") or None,
    )
    raw_cursor = request.GET.get("after") or ""
    cursor = Cursor.decode(raw_cursor) if raw_cursor else None
    page = request_log_page(filters=filters, cursor=cursor)
    query = request.GET.copy()
    query.pop("after", None)
    context.update({
        "range": time_range, "filters": filters, "page": page, "query": query.urlencode(),
        "tenant_slugs": tenant_slugs_by_id(tenant_ids={e.tenant_id for e in page.entries}) if tenant is None else {},
        "latency": latency_by_workload_lane(filters=filters) if cursor is None else None,
    })
    return render(request, "budgets/request_log.html", context)


@login_required
@require_safe
def tenant_request_log(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    return _log(request, tenant=tenant, tenant_ids=frozenset({tenant.id}))


@auditor_required
@require_safe
def all_request_log(request):
    return _log(request, tenant=None, tenant_ids=None)


def _detail(request, *, tenant, tenant_ids: frozenset[int] | None, request_id: str):
    try:
        detail = log_entry_of_tenants(tenant_ids=tenant_ids, request_id=request_id)
    except UsageRecord.DoesNotExist:
        # Not in the ledger: a refusal (sampled, or kept by id for 24 hours).
        try:
            refusal = refusal_of_tenants(tenant_ids=tenant_ids, request_id=request_id)
        except RejectionSample.DoesNotExist:
            raise Http404("No such request.")
        return render(request, "budgets/refusal_detail.html", {"tenant": tenant, "refusal": refusal})
    fields = [(f.name, getattr(detail.row, f.attname)) for f in UsageRecord._meta.concrete_fields]
    return render(request, "budgets/request_detail.html", {
        "tenant": tenant, "detail": detail, "entry": detail.entry, "fields": fields,
        "currency": price_table_currency(), "timings": [(t, TIMING_LABELS[t]) for t in TIMINGS],
    })


@login_required
@require_safe
def tenant_request_detail(request, slug: str, request_id: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug)
    return _detail(request, tenant=tenant, tenant_ids=frozenset({tenant.id}), request_id=request_id)


@auditor_required
@require_safe
def any_request_detail(request, request_id: str):
    return _detail(request, tenant=None, tenant_ids=None, request_id=request_id)
