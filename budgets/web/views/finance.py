"""Finance: spend by tenant, cost center, workload, model, day and month, and
the ledger export with the same filters (read-only, admins and auditors)."""

from __future__ import annotations

from datetime import datetime, timedelta

from urllib.parse import urlencode

from django.http import HttpResponseBadRequest
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from tenants.access import tenants_for_user
from tenants.decorators import auditor_required

from budgets.web.charts import bar_chart
from budgets.web.dashboards import spend_statuses_all
from budgets.web.forms import PERIODS, SpendFilterForm
from budgets.ledger.export import ledger_csv_response
from budgets.ledger.pricing import price_table_currency
from budgets.selectors.usage import UsageFilters, ledger_rows, spend_by_time, usage_models, usage_summary
from budgets.web.ranges import BUCKETS, TimeRange, bucket_floor, bucket_label
from budgets.web.views import presenters


# Past this span a day-bucketed chart would be too dense: months instead.
MONTH_BUCKETS_AFTER = timedelta(days=92)

# Drill-down: a row of the first grouping opens the page again filtered to
# it and grouped by the second. A model row (and any row already filtered to
# a workload) opens the request log instead. A grouping without a step here
# (pool, day, month) shows plain rows.
DRILL_NEXT = {"tenant": "workload", "cost_center": "tenant", "workload": "model"}
DRILL_FILTER = {"tenant": "tenant", "cost_center": "cost_center", "workload": "workload"}


def _filters(request, *, now: datetime) -> tuple[SpendFilterForm, UsageFilters | None]:
    """The page's and the export's one filter (so the CSV's rows are the
    page's totals, for every range)."""
    tenants = tenants_for_user(user=request.user)
    form = SpendFilterForm(request.GET or {"period": "this_month", "group_by": "tenant"}, tenants=tenants,
                           models=usage_models(), now=now)
    if not form.is_valid():
        return form, None
    data = form.cleaned_data
    return form, UsageFilters(
        start=data["start"], end=data["end"], start_at=data["start_at"], end_at=data["end_at"],
        tenant_id=data["tenant"].id if data.get("tenant") else None,
        cost_center=data.get("cost_center") or None,
        workload_id=data["workload"].id if data.get("workload") else None,
        model=data.get("model") or None,
    )


def _bucket_starts(*, start: datetime, end: datetime, bucket: str) -> list[datetime]:
    """Every UTC minute, hour, day or month that starts before ``end`` and
    ends after ``start``, oldest first."""
    at, out = bucket_floor(start, "day" if bucket == "month" else bucket), []
    at = at.replace(day=1) if bucket == "month" else at
    while at < end:
        out.append(at)
        at = (at + timedelta(days=32)).replace(day=1) if bucket == "month" else at + BUCKETS[bucket]
    return out


def _spend_chart(*, filters: UsageFilters, currency: str, whole_days: bool):
    """Spend per UTC minute, hour, day or month: the resolution the range
    picks (budgets/web/ranges.py), months past MONTH_BUCKETS_AFTER. A range
    of whole UTC days is charted per day at the finest, from the rollups like
    its totals (no ledger scan of every tenant's week for hour bars)."""
    time_range = TimeRange(start=filters.start_at, end=filters.end_at, preset="custom", label="")
    bucket = "day" if whole_days and time_range.bucket != "day" else time_range.bucket
    bucket = "month" if bucket == "day" and time_range.span > MONTH_BUCKETS_AFTER else bucket
    starts = _bucket_starts(start=time_range.start, end=time_range.end, bucket=bucket)
    spent = spend_by_time(filters=filters, bucket=bucket)
    labels = [f"{at:%Y-%m}" if bucket == "month" else bucket_label(at, bucket) for at in starts]
    chart = bar_chart(labels=labels, values=[float(spent.get(at, 0)) for at in starts],
                      title=f"Spend ({currency}) per UTC {bucket}", color="#16a34a",
                      width=presenters.FULL_WIDTH, height=220)
    return chart, bucket, len(starts)


def _row_links(*, form: SpendFilterForm, summary, group_by: str) -> list[dict]:
    """Each summary row with the link that drills into it (None: no link)."""
    base = {**form.range_params(), **form.filter_params()}
    rows = []
    for row in summary.rows:
        value = row.key.get(group_by)
        href = None
        if group_by == "model" and value:
            href = _request_log_href(form=form, model=value)
        elif group_by in DRILL_NEXT and value is not None:
            # Filters name tenants and workloads by slug: the row's label.
            param = row.label if group_by in ("tenant", "workload") else value
            params = {**base, DRILL_FILTER[group_by]: param, "group_by": DRILL_NEXT[group_by]}
            href = "?" + urlencode(params)
        rows.append({"row": row, "href": href})
    return rows


def _request_log_href(*, form: SpendFilterForm, model: str) -> str:
    """The cross-tenant request log over the page's exact range, narrowed to
    the page's tenant, workload and this model."""
    data = form.cleaned_data
    params = {"range": "custom", "from": form.range_params()["start"], "to": form.range_params()["end"]}
    if data.get("tenant"):
        params["tenant"] = data["tenant"].slug
    if data.get("workload"):
        params["workload"] = data["workload"].id
    params["model"] = model
    return f"{reverse('request-log')}?{urlencode(params)}"


@auditor_required
def finance(request):
    form, filters = _filters(request, now=timezone.now())
    context = {"form": form, "periods": PERIODS, "currency": price_table_currency()}
    if filters is not None:
        group_by = form.cleaned_data["group_by"]
        summary = usage_summary(filters=filters, group_by=(group_by,))
        chart, bucket, buckets = _spend_chart(filters=filters, currency=context["currency"],
                                             whole_days=form.cleaned_data["whole_days"])
        context.update({
            "filters": filters, "summary": summary, "group_by": group_by,
            "whole_days": form.cleaned_data["whole_days"],
            "spend_chart": chart, "bucket": bucket, "bucket_count": buckets,
            "spend_rows": [{"status": s, "bar": presenters.spend_bar(s)}
                           for s in spend_statuses_all(tenant_ids=None, now=timezone.now())],
            "rows": _row_links(form=form, summary=summary, group_by=group_by),
            "export_query": urlencode({**form.range_params(), **form.filter_params(), "group_by": group_by}),
        })
    return render(request, "budgets/finance.html", context, status=200 if filters is not None else 400)


@auditor_required
def finance_export(request):
    """The ledger rows behind the page's totals, as a streamed CSV."""
    form, filters = _filters(request, now=timezone.now())
    if filters is None:
        return HttpResponseBadRequest("Invalid filters.")
    span = (f"{filters.start:%Y%m%d}-{filters.end:%Y%m%d}" if form.cleaned_data["whole_days"]
            else f"{filters.start_at:%Y%m%dT%H%M}-{filters.end_at:%Y%m%dT%H%M}")
    return ledger_csv_response(request=request, queryset=ledger_rows(filters=filters),
                               filename=f"sluice-ledger-{span}.csv")
