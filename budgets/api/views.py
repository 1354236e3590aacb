from __future__ import annotations

from dataclasses import asdict


from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.access import tenant_ids_for_user, tenant_for_user, tenant_for_writer, tenants_for_user, workload_of_tenant, workloads_of_tenant
from tenants.api_permissions import IsPlatformAdmin, ReadOnlyForFinance
from tenants.models import Tenant, Workload
from tenants.roles import user_is_platform_admin

from ..budget_requests import budget_request_approve, budget_request_reject, budget_request_submit
from ..dashboards import spend_statuses_all
from ..ledger_export import ledger_csv_response
from ..live_metrics import pool_live_metrics
from ..models import InferencePool, Reservation
from ..models_requests import BudgetRequest
from ..models_spend import SpendBudget
from ..selectors_pool import budget_request_preview, pool_headroom
from ..selectors_usage import UsageFilters, ledger_rows, usage_summary
from ..spend import spend_statuses
from .serializers import (
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

WRITERS = [IsAuthenticated, ReadOnlyForFinance]


def _readable_tenant(request, slug: str) -> Tenant:
    try:
        return tenant_for_user(user=request.user, slug=slug)
    except Tenant.DoesNotExist:
        raise NotFound()


def _writable_tenant(request, slug: str) -> Tenant:
    try:
        return tenant_for_writer(user=request.user, slug=slug)
    except Tenant.DoesNotExist:
        raise NotFound()


# --- workloads ---------------------------------------------------------------------


class WorkloadList(APIView):
    @extend_schema(responses=WorkloadSerializer(many=True), summary="The tenant's workloads and their reservations")
    def get(self, request, slug: str):
        tenant = _readable_tenant(request, slug)
        workloads = workloads_of_tenant(tenant=tenant).select_related("tenant", "reservation", "reservation__pool")
        return Response(WorkloadSerializer(workloads, many=True).data)


class WorkloadDetail(APIView):
    @extend_schema(responses=WorkloadSerializer)
    def get(self, request, slug: str, workload_id: int):
        tenant = _readable_tenant(request, slug)
        try:
            workload = workload_of_tenant(tenant=tenant, workload_id=workload_id)
        except Workload.DoesNotExist:
            raise NotFound()
        return Response(WorkloadSerializer(workload).data)


# --- pools ------------------------------------------------------------------------------


class PoolList(APIView):
    @extend_schema(responses=PoolSerializer(many=True), summary="Active pools and their free capacity")
    def get(self, request):
        pools = InferencePool.objects.order_by("slug")
        if not user_is_platform_admin(request.user):
            pools = pools.filter(is_active=True)
        pools = list(pools)
        context = {"headroom": {p.id: pool_headroom(pool=p) for p in pools}}
        return Response(PoolSerializer(pools, many=True, context=context).data)


class PoolDetail(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT,
                   summary="A pool; platform admins also get its reservations and live metrics")
    def get(self, request, slug: str):
        pool = InferencePool.objects.filter(slug=slug).first()
        if pool is None or (not pool.is_active and not user_is_platform_admin(request.user)):
            raise NotFound()
        data = PoolSerializer(pool, context={"headroom": {pool.id: pool_headroom(pool=pool)}}).data
        if user_is_platform_admin(request.user):
            reservations = Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant")
            data["reservations"] = PoolReservationSerializer(reservations, many=True).data
            data["live"] = asdict(pool_live_metrics(pool_id=pool.id))
        return Response(data)


# --- budget requests ---------------------------------------------------------------------


def _requests_for(user):
    queryset = BudgetRequest.objects.select_related("tenant", "pool", "workload", "requested_by", "decided_by")
    tenant_ids = tenant_ids_for_user(user=user)
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=tenant_ids)
    return queryset.prefetch_related("events").order_by("-created_at")


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
        queryset = _requests_for(request.user)
        if query.validated_data.get("status"):
            queryset = queryset.filter(status=query.validated_data["status"])
        if query.validated_data.get("tenant"):
            queryset = queryset.filter(tenant__slug=query.validated_data["tenant"])
        return Response(BudgetRequestSerializer(queryset[:500], many=True).data)

    @extend_schema(request=BudgetRequestCreateSerializer, responses={201: BudgetRequestSerializer},
                   summary="Ask for a budget slice")
    def post(self, request):
        payload = BudgetRequestCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        tenant = _writable_tenant(request, data["tenant"])
        pool = InferencePool.objects.filter(slug=data["pool"], is_active=True).first()
        if pool is None:
            raise serializers.ValidationError({"pool": ["Unknown or inactive pool."]})
        workload = None
        if data.get("workload_id"):
            try:
                workload = workload_of_tenant(tenant=tenant, workload_id=data["workload_id"])
            except Workload.DoesNotExist:
                raise serializers.ValidationError({"workload_id": ["Unknown workload."]})
        created = budget_request_submit(
            tenant=tenant, user=request.user, pool=pool, workload=workload,
            new_workload_name=data.get("new_workload_name") or "", new_workload_class=data.get("new_workload_class") or "",
            reserved_tpm=data["reserved_tpm"], ceiling_tpm=data["ceiling_tpm"], rpm=data["rpm"],
            lend_fraction=data["lend_fraction"], justification=data["justification"], ends_on=data.get("ends_on"),
            monthly_spend_budget=data.get("monthly_spend_budget"), spend_soft_threshold=data["spend_soft_threshold"],
            spend_hard_cap=data["spend_hard_cap"],
        )
        return Response(BudgetRequestSerializer(_requests_for(request.user).get(pk=created.pk)).data, status=201)


class BudgetRequestDetail(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT,
                   summary="A budget request with its history; admins also get the approval preview")
    def get(self, request, request_id: int):
        budget_request = _requests_for(request.user).filter(pk=request_id).first()
        if budget_request is None:
            raise NotFound()
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
        if not BudgetRequest.objects.filter(pk=request_id).exists():
            raise NotFound()
        comment = payload.validated_data["comment"]
        if self.decision == "approve":
            budget_request_approve(request_id=request_id, approver=request.user, comment=comment)
        else:
            budget_request_reject(request_id=request_id, reviewer=request.user, comment=comment)
        return Response(BudgetRequestSerializer(_requests_for(request.user).get(pk=request_id)).data)


# --- usage, ledger, spend ------------------------------------------------------------


def _usage_filters(request) -> tuple[UsageFilters, tuple[str, ...]]:
    query = UsageQuerySerializer(data={**request.query_params.dict(),
                                       "group_by": request.query_params.getlist("group_by")})
    query.is_valid(raise_exception=True)
    data = query.validated_data
    scope = tenant_ids_for_user(user=request.user)
    tenant_id = workload_id = pool_id = None
    if data.get("tenant"):
        tenant_id = _readable_tenant(request, data["tenant"]).id
    if data.get("workload"):
        workload = Workload.objects.filter(slug=data["workload"], tenant__in=tenants_for_user(user=request.user)).first()
        if workload is None:
            raise serializers.ValidationError({"workload": ["Unknown workload."]})
        workload_id = workload.id
    if data.get("pool"):
        pool = InferencePool.objects.filter(slug=data["pool"]).first()
        if pool is None:
            raise serializers.ValidationError({"pool": ["Unknown pool."]})
        pool_id = pool.id
    filters = UsageFilters(
        start=data["start"], end=data["end"], tenant_ids=frozenset(scope) if scope is not None else None,
        tenant_id=tenant_id, cost_center=data.get("cost_center") or None, workload_id=workload_id,
        model=data.get("model") or None, pool_id=pool_id,
    )
    order = ["tenant", "cost_center", "workload", "model", "pool", "day", "month"]
    group_by = tuple(g for g in order if g in (data.get("group_by") or {"tenant"}))
    return filters, group_by


USAGE_PARAMETERS = [
    OpenApiParameter("start", OpenApiTypes.DATE, required=True, description="First UTC day (included)"),
    OpenApiParameter("end", OpenApiTypes.DATE, required=True, description="Last UTC day (included)"),
    OpenApiParameter("tenant", str), OpenApiParameter("cost_center", str), OpenApiParameter("workload", str),
    OpenApiParameter("model", str), OpenApiParameter("pool", str),
]


class UsageSummaryView(APIView):
    @extend_schema(
        parameters=[*USAGE_PARAMETERS, OpenApiParameter("group_by", str, many=True, enum=["tenant", "cost_center",
                    "workload", "model", "pool", "day", "month"])],
        responses=UsageSummarySerializer, summary="Tokens and spend, grouped (from the daily rollups)",
    )
    def get(self, request):
        filters, group_by = _usage_filters(request)
        summary = usage_summary(filters=filters, group_by=group_by)
        rows = [{**row.__dict__, "key": {k: (str(v) if v is not None else None) for k, v in row.key.items()}}
                for row in summary.rows]
        total = {**summary.total.__dict__, "key": {}}
        return Response(UsageSummarySerializer({"group_by": list(group_by), "rows": rows, "total": total}).data)


class LedgerExportView(APIView):
    @extend_schema(parameters=USAGE_PARAMETERS, responses={(200, "text/csv"): OpenApiTypes.STR},
                   summary="Ledger rows as CSV, streamed (same filters as the usage summary)")
    def get(self, request):
        filters, _group_by = _usage_filters(request)
        return ledger_csv_response(request=request._request, queryset=ledger_rows(filters=filters),
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
        payload = SpendBudgetWriteSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        values = {"monthly_amount": data["monthly_amount"], "soft_threshold": data["soft_threshold"],
                  "hard_cap": data["hard_cap"]}
        if data.get("tenant"):
            tenant = _readable_tenant(request, data["tenant"])
            budget, _ = SpendBudget.objects.update_or_create(tenant=tenant, defaults=values)
        else:
            workload = Workload.objects.filter(pk=data["workload_id"]).first()
            if workload is None:
                raise serializers.ValidationError({"workload_id": ["Unknown workload."]})
            budget, _ = SpendBudget.objects.update_or_create(workload=workload, defaults=values)
        budget = SpendBudget.objects.select_related("tenant", "workload", "workload__tenant").get(pk=budget.pk)
        return Response(SpendStatusSerializer(spend_statuses(budgets=[budget])[0]).data)
