"""Finance: spend by tenant, cost center, workload, model, day and month, and
the ledger export with the same filters (read-only, admins and auditors)."""

from __future__ import annotations

from django.http import HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone

from tenants.access import tenants_for_user
from tenants.decorators import auditor_required

from budgets.web.charts import bar_chart
from budgets.web.dashboards import spend_statuses_all
from budgets.web.forms import PERIODS, SpendFilterForm
from budgets.ledger.export import ledger_csv_response
from budgets.ledger.pricing import price_table_currency
from budgets.selectors.usage import UsageFilters, ledger_rows, usage_models, usage_summary
from budgets.web.views import presenters


def _filters(request) -> tuple[SpendFilterForm, UsageFilters | None]:
    tenants = tenants_for_user(user=request.user)
    form = SpendFilterForm(request.GET or {"period": "this_month", "group_by": "tenant"}, tenants=tenants,
                           models=usage_models())
    if not form.is_valid():
        return form, None
    data = form.cleaned_data
    return form, UsageFilters(
        start=data["start"], end=data["end"],
        tenant_id=data["tenant"].id if data.get("tenant") else None,
        cost_center=data.get("cost_center") or None,
        workload_id=data["workload"].id if data.get("workload") else None,
        model=data.get("model") or None,
    )


@auditor_required
def finance(request):
    form, filters = _filters(request)
    context = {"form": form, "periods": PERIODS, "currency": price_table_currency()}
    if filters is not None:
        group_by = form.cleaned_data["group_by"]
        summary = usage_summary(filters=filters, group_by=(group_by,))
        days = (filters.end - filters.start).days + 1
        by_time = usage_summary(filters=filters, group_by=("day",) if days <= 92 else ("month",))
        context.update({
            "filters": filters, "summary": summary, "group_by": group_by,
            "spend_chart": bar_chart(labels=[r.label for r in by_time.rows], values=[float(r.cost) for r in by_time.rows],
                                     title=f"Spend ({context['currency']}) per " + ("UTC day" if days <= 92 else "month"),
                                     color="#16a34a",
                                     width=presenters.FULL_WIDTH, height=220),
            "spend_rows": [{"status": s, "bar": presenters.spend_bar(s)}
                           for s in spend_statuses_all(tenant_ids=None, now=timezone.now())],
            "query": request.GET.urlencode(),
        })
    return render(request, "budgets/finance.html", context, status=200 if filters is not None else 400)


@auditor_required
def finance_export(request):
    """The ledger rows behind the page's totals, as a streamed CSV."""
    _form, filters = _filters(request)
    if filters is None:
        return HttpResponseBadRequest("Invalid filters.")
    return ledger_csv_response(request=request, queryset=ledger_rows(filters=filters),
                               filename=f"sluice-ledger-{filters.start:%Y%m%d}-{filters.end:%Y%m%d}.csv")
