"""Platform admin pages: pools and the budget-request review queue."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from tenants.decorators import staff_required

from budgets.selectors.reservations import reservation_of_workload

from budgets.admission.capacity import capacity_state
from budgets.admission.pool_status import PoolStatus, pool_statuses
from budgets.redis.clients import REDIS_UNAVAILABLE, unavailable_note
from budgets.services.budget_requests import budget_request_approve, budget_request_reject
from budgets.web.dashboards import pool_overview, pool_range
from budgets.web.ranges import PRESETS, RangeError, time_range_from
from budgets.web.forms import DecisionForm
from budgets.models import InferencePool
from budgets.models import BudgetRequest
from budgets.selectors.pools import budget_request_preview, pool_by_slug, pool_headroom, pools_for_user
from budgets.selectors.usage import workload_minute_use
from budgets.selectors.requests import (
    budget_request_for_review,
    budget_request_history,
    budget_requests_for_review,
    budget_requests_pending_count,
)
from budgets.web.views import presenters

LIVE_REFRESH_S = 5


def _reachability(pools: list[InferencePool]) -> dict[int, PoolStatus]:
    """Each pool's last probe; without Redis the page says so and shows none."""
    try:
        return pool_statuses(pool_ids=[p.id for p in pools])
    except REDIS_UNAVAILABLE:
        unavailable_note("pool reachability")
        return {}


@staff_required
def pool_list(request):
    # Staff only, so every pool, the inactive ones included.
    pools = list(pools_for_user(user=request.user))
    statuses = _reachability(pools)
    rows = [{"pool": p, "headroom": pool_headroom(pool=p), "status": statuses.get(p.id)} for p in pools]
    return render(request, "budgets/pool_list.html", {"pools": rows, "pending": budget_requests_pending_count()})


def _overview_context(slug: str) -> dict:
    try:
        pool = pool_by_slug(slug=slug)
    except InferencePool.DoesNotExist:
        raise Http404("No such pool.")
    overview = pool_overview(pool=pool, now=timezone.now())
    return {
        "pool": pool, "overview": overview, "capacity_chart": presenters.pool_capacity_chart(overview),
        "rejections_chart": presenters.rejections_chart(
            overview.rejection_minutes, overview.rejections_per_minute, "Rejections per minute by reason, last hour"),
        "refresh_s": LIVE_REFRESH_S, "now": timezone.now(),
    }


@staff_required
def pool_detail(request, slug: str):
    context = _overview_context(slug)
    try:
        time_range = time_range_from(request.GET, now=context["now"])
    except RangeError as exc:
        return render(request, "budgets/range_error.html", {"error": str(exc)}, status=400)
    pool = context["pool"]
    context.update({
        "range": time_range, "presets": PRESETS, "keep": [],
        "range_chart": presenters.pool_range_chart(pool_range(pool=pool, time_range=time_range), pool.admission_tpm),
    })
    return render(request, "budgets/pool_detail.html", context)


@staff_required
def pool_live(request, slug: str):
    """The overview's live part alone; the page swaps it in every few seconds."""
    response = render(request, "budgets/_pool_live.html", _overview_context(slug))
    response["Cache-Control"] = "no-store"
    return response


@staff_required
def review_list(request):
    status = request.GET.get("status") or ""
    if status and status not in BudgetRequest.Status.values:
        status = ""
    requests = list(budget_requests_for_review(status=status or None)[:200])
    return render(request, "budgets/review_list.html", {
        "requests": requests, "status": status, "statuses": BudgetRequest.Status.choices,
    })


def _effective_capacity(pool: InferencePool, *, now) -> dict | None:
    """What admission runs the pool at now (the adaptive factor of
    budgets/admission/capacity.py times its admission budget), and why;
    None when Redis cannot say."""
    try:
        state = capacity_state(pool_id=pool.id)
    except REDIS_UNAVAILABLE:
        unavailable_note("pool capacity")
        return None
    now_ms = now.timestamp() * 1000
    factor = state.effective_factor(now_ms=now_ms)
    return {"factor": factor, "tpm": int(pool.admission_tpm * factor + 1e-9),
            "rpm": int(pool.admission_rpm * factor + 1e-9), "reason": state.reason(now_ms=now_ms)}


def _review_context(request_id: int, form: DecisionForm | None = None, errors: dict | None = None) -> dict:
    try:
        budget_request = budget_request_for_review(request_id=request_id)
    except BudgetRequest.DoesNotExist:
        raise Http404("No such request.")
    preview = budget_request_preview(request=budget_request)
    before, after = presenters.approval_charts(preview, budget_request.workload_label)
    now = timezone.now()
    return {
        "use": ([workload_minute_use(workload_id=budget_request.workload_id, now=now, days=days) for days in (7, 30)]
                if budget_request.workload_id else []),
        "capacity": _effective_capacity(budget_request.pool, now=now),
        "req": budget_request, "preview": preview, "before_chart": before, "after_chart": after,
        "history": budget_request_history(request=budget_request), "form": form or DecisionForm(),
        "errors": errors or {},
        "preview_current": (reservation_of_workload(workload=budget_request.workload)
                            if budget_request.workload_id else None),
    }


@staff_required
def review_detail(request, request_id: int):
    return render(request, "budgets/review_detail.html", _review_context(request_id))


@staff_required
@require_POST
def review_decide(request, request_id: int, decision: str):
    form = DecisionForm(request.POST)
    if not form.is_valid():
        return render(request, "budgets/review_detail.html", _review_context(request_id, form), status=400)
    comment = form.cleaned_data.get("comment") or ""
    try:
        if decision == "approve":
            budget_request_approve(request_id=request_id, approver=request.user, comment=comment,
                                   reserved_tpm=form.cleaned_data.get("reserved_tpm"))
        else:
            budget_request_reject(request_id=request_id, reviewer=request.user, comment=comment)
    except BudgetRequest.DoesNotExist:
        raise Http404("No such request.")
    except ValidationError as exc:
        # A missing comment or a granted amount is the reviewer's input: the form again, with
        # what they typed. Anything else (no headroom, already decided)
        # conflicts with the current state: back to the request's page (its
        # URL, not /approve), which shows why once: the headroom problems
        # box when the request no longer fits, else this message.
        typed = {"comment"} | ({"reserved_tpm"} if form.cleaned_data.get("reserved_tpm") is not None else set())
        if set(exc.message_dict) <= typed:
            return render(request, "budgets/review_detail.html",
                          _review_context(request_id, form, errors=exc.message_dict), status=400)
        context = _review_context(request_id)
        if not (context["req"].is_pending and not context["preview"].fits):
            for problems in exc.message_dict.values():
                for problem in problems:
                    messages.error(request, problem)
        return redirect("review-detail", request_id=request_id)
    messages.success(request, f"Request #{request_id} {'approved' if decision == 'approve' else 'rejected'}.")
    return redirect("review-detail", request_id=request_id)
