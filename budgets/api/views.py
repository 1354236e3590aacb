from __future__ import annotations

from dataclasses import asdict

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.access import tenant_for_user_or_404, tenant_ids_for_user, workload_of_tenant, workloads_of_tenant
from tenants.api_permissions import IsPlatformAdmin, ReadOnlyForFinance
from tenants.roles import user_is_platform_admin

from budgets.services.budget_requests import budget_request_approve, budget_request_reject, budget_request_submit
from budgets.services.spend_budgets import spend_budget_set
from budgets.web.dashboards import spend_statuses_all
from budgets.ledger.export import ledger_csv_response
from budgets.web.live_metrics import pool_live_metrics
from budgets.models import BudgetRequest
from budgets.selectors.pools import budget_request_preview, pool_for_user, pool_headrooms, pools_for_user
from budgets.selectors.requests import budget_request_for_review, budget_request_for_user, budget_requests_for_user
from budgets.selectors.reservations import reservations_of_pool
from budgets.selectors.usage import GROUPS, ledger_rows, usage_summary
from budgets.ledger.spend import spend_statuses
from budgets.api.serializers import (
    BudgetRequestCreateSerializer,
    BudgetRequestQuerySerializer,
    BudgetRequestSerializer,
    DecisionSerializer,
    HeadroomSerializer,
    PoolReservationSerializer,
    PoolSerializer,
    SpendBudgetWriteSerializer,
    SpendStatusSerializer,
    UsageQuerySerializer,
    UsageSummarySerializer,
    WorkloadSerializer,
)

# A tenant, workload, pool or request the caller may not see raises Http404 or
# DoesNotExist from its selector; llm_platform/api_errors.py answers both with
# DRF's 404 (see tenants/access.py for why never 403).

WRITERS = [IsAuthenticated, ReadOnlyForFinance]


# --- workloads ---------------------------------------------------------------------


class WorkloadList(APIView):
    @extend_schema(responses=WorkloadSerializer(many=True), summary="The tenant's workloads and their reservations")
    def get(self, request, slug: str):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug)
        return Response(WorkloadSerializer(workloads_of_tenant(tenant=tenant).prefetch_related("slices__pool"),
                                           many=True).data)


class WorkloadDetail(APIView):
    @extend_schema(responses=WorkloadSerializer)
    def get(self, request, slug: str, workload_id: int):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug)
        return Response(WorkloadSerializer(workload_of_tenant(tenant=tenant, workload_id=workload_id)).data)


# --- pools ------------------------------------------------------------------------------


class PoolList(APIView):
    @extend_schema(responses=PoolSerializer(many=True), summary="Active pools and their free capacity")
    def get(self, request):
        pools = list(pools_for_user(user=request.user))
        context = {"headroom": pool_headrooms(pools=pools)}
        return Response(PoolSerializer(pools, many=True, context=context).data)


class PoolDetail(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT,
                   summary="A pool; platform admins also get its reservations and live metrics")
    def get(self, request, slug: str):
        pool = pool_for_user(user=request.user, slug=slug)
        data = PoolSerializer(pool, context={"headroom": pool_headrooms(pools=[pool])}).data
        if user_is_platform_admin(request.user):
            data["reservations"] = PoolReservationSerializer(reservations_of_pool(pool=pool), many=True).data
            data["live"] = asdict(pool_live_metrics(pool_id=pool.id))
        return Response(data)


# --- budget requests ---------------------------------------------------------------------


class BudgetRequestList(APIView):
    permission_classes = WRITERS

    @extend_schema(
        parameters=[OpenApiParameter("status", str, enum=BudgetRequest.Status.values),
                    OpenApiParameter("tenant", str)],
        responses=BudgetRequestSerializer(many=True), summary="Budget requests you can see",
    )
    def get(self, request):
        query = BudgetRequestQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        queryset = budget_requests_for_user(user=request.user, status=query.validated_data.get("status"),
                                            tenant_slug=query.validated_data.get("tenant"))
        return Response(BudgetRequestSerializer(queryset[:500], many=True).data)

    @extend_schema(request=BudgetRequestCreateSerializer, responses={201: BudgetRequestSerializer},
                   summary="Ask for a budget slice")
    def post(self, request):
        payload = BudgetRequestCreateSerializer(data=request.data, context={"user": request.user})
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        created = budget_request_submit(
            tenant=data["tenant"], user=request.user, pool=data["pool"], workload=data["workload"],
            new_workload_name=data.get("new_workload_name") or "", new_workload_class=data.get("new_workload_class") or "",
            reserved_tpm=data["reserved_tpm"], ceiling_tpm=data["ceiling_tpm"], rpm=data["rpm"],
            lend_fraction=data["lend_fraction"], justification=data["justification"], ends_on=data.get("ends_on"),
            monthly_spend_budget=data.get("monthly_spend_budget"), spend_soft_threshold=data["spend_soft_threshold"],
            spend_hard_cap=data["spend_hard_cap"],
        )
        return Response(BudgetRequestSerializer(budget_request_for_user(user=request.user, request_id=created.pk)).data,
                        status=201)


class BudgetRequestDetail(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT,
                   summary="A budget request with its history; admins also get the approval preview")
    def get(self, request, request_id: int):
        budget_request = budget_request_for_user(user=request.user, request_id=request_id)
        data = BudgetRequestSerializer(budget_request).data
        if user_is_platform_admin(request.user):
            preview = budget_request_preview(request=budget_request)
            data["preview"] = {
                "fits": preview.fits, "problems": preview.problems,
                "headroom_now": HeadroomSerializer(preview.headroom).data,
                "headroom_after": HeadroomSerializer(preview.after).data,
            }
        return Response(data)


class BudgetRequestDecision(APIView):
    permission_classes = [IsAuthenticated, IsPlatformAdmin]
    decision = "approve"

    @extend_schema(request=DecisionSerializer, responses=BudgetRequestSerializer,
                   summary="Approve (against the pool's headroom) or reject a pending request")
    def post(self, request, request_id: int):
        payload = DecisionSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        # A missing request is a 404 before the decision's own checks (a
        # rejection without a comment would otherwise answer 400).
        budget_request_for_review(request_id=request_id)
        comment = payload.validated_data["comment"]
        if self.decision == "approve":
            budget_request_approve(request_id=request_id, approver=request.user, comment=comment,
                                   reserved_tpm=payload.validated_data["reserved_tpm"])
        else:
            budget_request_reject(request_id=request_id, reviewer=request.user, comment=comment)
        return Response(BudgetRequestSerializer(budget_request_for_user(user=request.user, request_id=request_id)).data)


# --- usage, ledger, spend ------------------------------------------------------------


def _usage_query(request) -> dict:
    """The usage filters of the query string, resolved for the caller."""
    query = UsageQuerySerializer(data={**request.query_params.dict(), "group_by": request.query_params.getlist("group_by")},
                                 context={"user": request.user})
    query.is_valid(raise_exception=True)
    return query.validated_data


USAGE_PARAMETERS = [
    OpenApiParameter("start", OpenApiTypes.DATE, required=True, description="First UTC day (included)"),
    OpenApiParameter("end", OpenApiTypes.DATE, required=True, description="Last UTC day (included)"),
    OpenApiParameter("tenant", str), OpenApiParameter("cost_center", str), OpenApiParameter("workload", str),
    OpenApiParameter("model", str), OpenApiParameter("pool", str),
]


class UsageSummaryView(APIView):
    @extend_schema(
        parameters=[*USAGE_PARAMETERS, OpenApiParameter("group_by", str, many=True, enum=list(GROUPS))],
        responses=UsageSummarySerializer, summary="Tokens and spend, grouped (from the daily rollups)",
    )
    def get(self, request):
        query = _usage_query(request)
        filters, group_by = query["filters"], query["group_by"]
        summary = usage_summary(filters=filters, group_by=group_by)
        rows = [{**row.__dict__, "key": {k: (str(v) if v is not None else None) for k, v in row.key.items()}}
                for row in summary.rows]
        total = {**summary.total.__dict__, "key": {}}
        return Response(UsageSummarySerializer({"group_by": list(group_by), "rows": rows, "total": total}).data)


class LedgerExportView(APIView):
    @extend_schema(parameters=USAGE_PARAMETERS, responses={(200, "text/csv"): OpenApiTypes.STR},
                   summary="Ledger rows as CSV, streamed (same filters as the usage summary)")
    def get(self, request):
        filters = _usage_query(request)["filters"]
        return ledger_csv_response(request=request, queryset=ledger_rows(filters=filters),
                                   filename=f"sluice-ledger-{filters.start:%Y%m%d}-{filters.end:%Y%m%d}.csv")


class SpendBudgetList(APIView):
    permission_classes = WRITERS

    @extend_schema(responses=SpendStatusSerializer(many=True),
                   summary="Spend budgets with month-to-date spend and the projected month end")
    def get(self, request):
        scope = tenant_ids_for_user(user=request.user)
        return Response(SpendStatusSerializer(spend_statuses_all(tenant_ids=scope, now=timezone.now()), many=True).data)

    @extend_schema(request=SpendBudgetWriteSerializer, responses={200: SpendStatusSerializer},
                   summary="Set a tenant's or a workload's monthly spend budget (platform admins)")
    def post(self, request):
        if not user_is_platform_admin(request.user):
            raise PermissionDenied("Platform admins only.")
        payload = SpendBudgetWriteSerializer(data=request.data, context={"user": request.user})
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        budget = spend_budget_set(tenant=data["tenant"], workload=data["workload"], monthly_amount=data["monthly_amount"],
                                  soft_threshold=data["soft_threshold"], hard_cap=data["hard_cap"])
        return Response(SpendStatusSerializer(spend_statuses(budgets=[budget])[0]).data)
