from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from django.utils import timezone
from rest_framework import serializers

from tenants.access import (
    tenant_for_user_or_404,
    tenant_ids_for_user,
    workload_for_user,
    workload_for_user_by_slug,
    workload_of_tenant,
)
from tenants.models import Workload

from budgets.models import InferencePool, Reservation
from budgets.models import BudgetRequest, BudgetRequestEvent
from budgets.selectors.pools import pool_active_by_slug, pool_by_slug
from budgets.selectors.usage import GROUPS, UsageFilters, usage_day_problem


class ReservationSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = Reservation
        fields = ["pool", "rank", "reserved_tpm", "ceiling_tpm", "lend_fraction", "rpm", "max_concurrency",
                  "updated_at"]


class WorkloadSerializer(serializers.ModelSerializer):
    """``reservation``: its primary slice (as before slices); ``slices``: its
    whole route, primary first."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    reservation = serializers.SerializerMethodField()
    slices = serializers.SerializerMethodField()

    class Meta:
        model = Workload
        fields = ["id", "tenant", "slug", "name", "workload_class", "prompt_tokens_cap", "max_tokens_cap",
                  "max_tokens_default", "queue_timeout_s", "is_active", "allowed_models", "allow_overflow",
                  "overflow_monthly_cap", "reservation", "slices"]

    def _slices(self, workload) -> list:
        return sorted(workload.slices.all(), key=lambda s: (s.rank, s.id))

    def get_reservation(self, workload) -> dict | None:
        slices = self._slices(workload)
        return ReservationSerializer(slices[0]).data if slices else None

    def get_slices(self, workload) -> list[dict]:
        return ReservationSerializer(self._slices(workload), many=True).data


class HeadroomSerializer(serializers.Serializer):
    admission_tpm = serializers.IntegerField()
    admission_rpm = serializers.IntegerField()
    reserved_tpm = serializers.IntegerField()
    reserved_rpm = serializers.IntegerField()
    free_tpm = serializers.IntegerField()
    free_rpm = serializers.IntegerField()


class PoolSerializer(serializers.ModelSerializer):
    admission = serializers.SerializerMethodField(help_text="Admission budget, reserved and free capacity.")

    class Meta:
        model = InferencePool
        fields = ["id", "slug", "name", "served_models", "provider_tpm", "provider_rpm", "provider_input_tpm",
                  "provider_output_tpm", "headroom", "burst_seconds", "max_concurrency", "is_active", "admission"]

    def get_admission(self, pool) -> dict:
        return HeadroomSerializer(self.context["headroom"][pool.id]).data


class PoolReservationSerializer(serializers.ModelSerializer):
    workload = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    tenant = serializers.CharField(source="workload.tenant.slug", read_only=True)

    class Meta:
        model = Reservation
        fields = ["workload", "tenant", "reserved_tpm", "ceiling_tpm", "lend_fraction", "rpm"]


class BudgetRequestEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = BudgetRequestEvent
        fields = ["action", "actor_name", "comment", "details", "created_at"]


class BudgetRequestSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    workload = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    requested_by = serializers.CharField(source="requested_by.username", read_only=True)
    decided_by = serializers.CharField(source="decided_by.username", read_only=True, default=None)
    history = BudgetRequestEventSerializer(source="events", many=True, read_only=True)

    class Meta:
        model = BudgetRequest
        fields = ["id", "tenant", "pool", "workload", "new_workload_name", "new_workload_class", "reserved_tpm",
                  "ceiling_tpm", "rpm", "lend_fraction", "monthly_spend_budget", "spend_soft_threshold",
                  "spend_hard_cap", "justification", "ends_on", "status", "requested_by", "created_at",
                  "decided_by", "decided_at", "decision_comment", "history"]


class BudgetRequestCreateSerializer(serializers.Serializer):
    """Needs ``context["user"]``. Once the fields are valid, ``tenant`` and
    ``pool`` become the objects and ``workload`` is added (None: a new one);
    a tenant the user may not change is a 404, like on every other endpoint."""

    tenant = serializers.SlugField()
    pool = serializers.SlugField()
    workload_id = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    new_workload_name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    new_workload_class = serializers.ChoiceField(choices=Workload.WorkloadClass.choices, required=False,
                                                 allow_blank=True, default="")
    reserved_tpm = serializers.IntegerField(min_value=1, max_value=2_000_000_000)
    ceiling_tpm = serializers.IntegerField(min_value=1, max_value=2_000_000_000)
    rpm = serializers.IntegerField(min_value=1, max_value=2_000_000_000)
    lend_fraction = serializers.FloatField(min_value=0.0, max_value=1.0, default=0.0)
    justification = serializers.CharField(max_length=5000)
    ends_on = serializers.DateField(required=False, allow_null=True)
    monthly_spend_budget = serializers.DecimalField(max_digits=18, decimal_places=6, min_value=Decimal("0.000001"),
                                                    required=False, allow_null=True)
    spend_soft_threshold = serializers.FloatField(min_value=0.01, max_value=1.0, default=0.8)
    spend_hard_cap = serializers.BooleanField(default=False)

    def validate(self, data):
        if data["ceiling_tpm"] < data["reserved_tpm"]:
            raise serializers.ValidationError({"ceiling_tpm": ["The ceiling must be at least the reserved rate."]})
        if not data.get("workload_id") and not (data.get("new_workload_name") or "").strip():
            raise serializers.ValidationError({"workload_id": ["Give a workload id or a new workload name."]})
        if data.get("ends_on") and data["ends_on"] <= timezone.now().date():
            raise serializers.ValidationError({"ends_on": ["The end date must be in the future."]})
        if data.get("ends_on") and data["ends_on"] > timezone.now().date() + timedelta(days=3 * 366):
            # As on the web form: a slice is reviewed against today's pool, not the next decade's.
            raise serializers.ValidationError({"ends_on": ["Pick an end date within three years."]})
        data["tenant"] = tenant_for_user_or_404(user=self.context["user"], slug=data["tenant"], write=True)
        try:
            data["pool"] = pool_active_by_slug(slug=data["pool"])
        except InferencePool.DoesNotExist:
            raise serializers.ValidationError({"pool": ["Unknown or inactive pool."]})
        data["workload"] = None
        if data.get("workload_id"):
            try:
                data["workload"] = workload_of_tenant(tenant=data["tenant"], workload_id=data["workload_id"])
            except Workload.DoesNotExist:
                raise serializers.ValidationError({"workload_id": ["Unknown workload."]})
        return data


class BudgetRequestQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=BudgetRequest.Status.choices, required=False)
    tenant = serializers.SlugField(required=False)


class DecisionSerializer(serializers.Serializer):
    comment = serializers.CharField(max_length=5000, required=False, allow_blank=True, default="")
    reserved_tpm = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=1, max_value=10**12,
        help_text="Approve: grant this reserved TPM instead of the figure asked (at most that figure).")


def _usage_day(day):
    problem = usage_day_problem(day)
    if problem:
        raise serializers.ValidationError(problem)
    return day


class UsageQuerySerializer(serializers.Serializer):
    """Needs ``context["user"]``; adds ``filters`` (UsageFilters, scoped to
    the tenants the user may read) and turns ``group_by`` into an ordered
    tuple (default: by tenant)."""

    start = serializers.DateField()
    end = serializers.DateField()
    group_by = serializers.MultipleChoiceField(choices=GROUPS, required=False)
    tenant = serializers.SlugField(required=False)
    cost_center = serializers.CharField(required=False, max_length=100)
    workload = serializers.SlugField(required=False)
    model = serializers.CharField(required=False, max_length=200)
    pool = serializers.SlugField(required=False)

    MAX_DAYS = 400

    def validate_start(self, day):
        return _usage_day(day)

    def validate_end(self, day):
        return _usage_day(day)

    def validate(self, data):
        if data["end"] < data["start"]:
            raise serializers.ValidationError({"end": ["The end date is before the start date."]})
        if (data["end"] - data["start"]).days > self.MAX_DAYS:
            raise serializers.ValidationError({"start": [f"Choose at most {self.MAX_DAYS} days."]})
        user = self.context["user"]
        scope = tenant_ids_for_user(user=user)
        tenant_id = workload_id = pool_id = None
        if data.get("tenant"):
            tenant_id = tenant_for_user_or_404(user=user, slug=data["tenant"]).id
        if data.get("workload"):
            try:
                workload_id = workload_for_user_by_slug(user=user, slug=data["workload"]).id
            except Workload.DoesNotExist:
                raise serializers.ValidationError({"workload": ["Unknown workload."]})
        if data.get("pool"):
            try:
                pool_id = pool_by_slug(slug=data["pool"]).id
            except InferencePool.DoesNotExist:
                raise serializers.ValidationError({"pool": ["Unknown pool."]})
        data["filters"] = UsageFilters(
            start=data["start"], end=data["end"], tenant_ids=frozenset(scope) if scope is not None else None,
            tenant_id=tenant_id, cost_center=data.get("cost_center") or None, workload_id=workload_id,
            model=data.get("model") or None, pool_id=pool_id,
        )
        data["group_by"] = tuple(g for g in GROUPS if g in (data.get("group_by") or {"tenant"}))
        return data


class UsageRowSerializer(serializers.Serializer):
    key = serializers.DictField()
    label = serializers.CharField()
    requests = serializers.IntegerField()
    ok_requests = serializers.IntegerField()
    estimated_input_tokens = serializers.IntegerField()
    estimated_output_tokens = serializers.IntegerField()
    actual_input_tokens = serializers.IntegerField()
    actual_output_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=24, decimal_places=8)


class UsageSummarySerializer(serializers.Serializer):
    group_by = serializers.ListField(child=serializers.CharField())
    rows = UsageRowSerializer(many=True)
    total = UsageRowSerializer()


class SpendStatusSerializer(serializers.Serializer):
    id = serializers.IntegerField(source="budget.id")
    tenant = serializers.SerializerMethodField()
    workload = serializers.SerializerMethodField()
    monthly_amount = serializers.DecimalField(source="budget.monthly_amount", max_digits=18, decimal_places=6)
    currency = serializers.CharField(source="budget.currency")
    soft_threshold = serializers.FloatField(source="budget.soft_threshold")
    hard_cap = serializers.BooleanField(source="budget.hard_cap")
    month_to_date = serializers.DecimalField(max_digits=18, decimal_places=6)
    projected_month_end = serializers.DecimalField(source="projected", max_digits=18, decimal_places=6)
    state = serializers.CharField()

    def get_tenant(self, status) -> str:
        budget = status.budget
        return budget.tenant.slug if budget.tenant_id else budget.workload.tenant.slug

    def get_workload(self, status) -> str | None:
        return status.budget.workload.slug if status.budget.workload_id else None


class SpendBudgetWriteSerializer(serializers.Serializer):
    """Needs ``context["user"]``; ``tenant`` becomes the Tenant (or None) and
    ``workload`` (the Workload, or None) is added."""

    tenant = serializers.SlugField(required=False)
    workload_id = serializers.IntegerField(required=False, min_value=1)
    monthly_amount = serializers.DecimalField(max_digits=18, decimal_places=6, min_value=Decimal("0.000001"))
    soft_threshold = serializers.FloatField(min_value=0.01, max_value=1.0, default=0.8)
    hard_cap = serializers.BooleanField(default=False)

    def validate(self, data):
        if bool(data.get("tenant")) == bool(data.get("workload_id")):
            raise serializers.ValidationError({"non_field_errors": ["Give exactly one of tenant or workload_id."]})
        user = self.context["user"]
        data["workload"] = None
        if data.get("tenant"):
            data["tenant"] = tenant_for_user_or_404(user=user, slug=data["tenant"])
        else:
            data["tenant"] = None
            try:
                data["workload"] = workload_for_user(user=user, workload_id=data["workload_id"])
            except Workload.DoesNotExist:
                raise serializers.ValidationError({"workload_id": ["Unknown workload."]})
        return data
