from django import forms
from django.contrib import admin

from budgets.models import InferencePool, ModelPrice, Reservation, UsageRecord
from budgets.services.reservations import pool_lock, pool_save, reservation_delete, reservation_save, reservations_delete

# Pools and reservations change here only through budgets/services/reservations.py,
# under the pool's row lock, like an approval on the review page. The admin
# runs a POST in one transaction, so the lock its form takes before the model
# validation (the pool's headroom: Reservation.clean, InferencePool.clean)
# is held until the row is saved: a second admin, an approval or the API on
# the same pool waits, then validates against what this one saved.


class InferencePoolAdminForm(forms.ModelForm):
    # Pools are mostly in-cluster http endpoints (vLLM): a URL typed without
    # a scheme keeps meaning http, as it always did (and Django 6 will not
    # silently change it).
    base_url = forms.URLField(max_length=500, assume_scheme="http",
                              help_text=InferencePool._meta.get_field("base_url").help_text)

    class Meta:
        model = InferencePool
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        if self.instance.pk:
            pool_lock(pool_id=self.instance.pk)
        return cleaned


@admin.register(InferencePool)
class InferencePoolAdmin(admin.ModelAdmin):
    form = InferencePoolAdminForm
    list_display = ("slug", "base_url", "provider_tpm", "provider_rpm", "headroom", "burst_seconds", "max_concurrency", "is_active", "is_simulator")
    prepopulated_fields = {"slug": ("name",)}

    def save_model(self, request, obj, form, change):
        pool_save(pool=obj)


class ReservationAdminForm(forms.ModelForm):
    class Meta:
        model = Reservation
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        pool = cleaned.get("pool")
        if pool is not None:
            # Validate against the pool as committed now, and keep it locked until the save.
            cleaned["pool"] = pool_lock(pool_id=pool.pk)
        return cleaned


@admin.register(Reservation)
class ReservationAdmin(admin.ModelAdmin):
    form = ReservationAdminForm
    list_display = ("workload", "pool", "rank", "reserved_tpm", "ceiling_tpm", "lend_fraction", "rpm", "max_concurrency")
    list_filter = ("pool",)

    def save_model(self, request, obj, form, change):
        reservation_save(reservation=obj)

    def delete_model(self, request, obj):
        reservation_delete(reservation=obj)

    def delete_queryset(self, request, queryset):
        reservations_delete(reservations=list(queryset))


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = ("model", "pool", "input_per_million", "output_per_million", "currency", "effective_from")


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Read-only: the ledger is append-only."""

    list_display = ("request_id", "created_at", "tenant", "workload", "pool", "model", "lane", "status", "borrowed",
                    "overflow", "failed_over",
                    "estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens", "actual_output_tokens", "cost")
    list_filter = ("status", "lane", "borrowed", "overflow", "failed_over", "pool", "tenant")
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# --- web UI models (issue 5) ----------------------------------------------------------
from budgets.models import (AlertDelivery, BudgetRequest, BudgetRequestEvent, DailyUsage, Notification,  # noqa: E402
                            RejectionStat, SpendBudget)


class ReadOnlyAdmin(admin.ModelAdmin):
    """History and read models: viewable, never edited here."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(SpendBudget)
class SpendBudgetAdmin(admin.ModelAdmin):
    list_display = ("scope_label", "monthly_amount", "currency", "soft_threshold", "hard_cap", "updated_at")
    list_filter = ("hard_cap",)
    # Searchable selects by name or slug, not raw ids (tenants/admin.py's search_fields).
    autocomplete_fields = ("tenant", "workload")


class BudgetRequestEventInline(admin.TabularInline):
    model = BudgetRequestEvent
    extra = 0
    can_delete = False
    readonly_fields = ("action", "actor_name", "comment", "details", "created_at")
    fields = readonly_fields

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(BudgetRequest)
class BudgetRequestAdmin(ReadOnlyAdmin):
    """Decisions are taken on the review page (/ops/requests/), which checks headroom."""

    list_display = ("id", "tenant", "workload", "new_workload_name", "pool", "reserved_tpm", "ceiling_tpm", "rpm",
                    "status", "created_at", "decided_at")
    list_filter = ("status", "pool")
    inlines = [BudgetRequestEventInline]


@admin.register(BudgetRequestEvent)
class BudgetRequestEventAdmin(ReadOnlyAdmin):
    list_display = ("request", "action", "actor_name", "created_at")
    list_filter = ("action",)


@admin.register(Notification)
class NotificationAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "kind", "message", "created_at")
    list_filter = ("kind",)


@admin.register(AlertDelivery)
class AlertDeliveryAdmin(ReadOnlyAdmin):
    list_display = ("at", "tenant", "notification", "channel", "attempt", "delivered", "status_code", "error")
    list_filter = ("channel", "delivered")


@admin.register(DailyUsage)
class DailyUsageAdmin(ReadOnlyAdmin):
    list_display = ("day", "tenant", "workload", "pool", "model", "requests", "actual_input_tokens",
                    "actual_output_tokens", "cost")
    list_filter = ("pool", "model")
    date_hierarchy = "day"


@admin.register(RejectionStat)
class RejectionStatAdmin(ReadOnlyAdmin):
    list_display = ("minute", "tenant", "workload", "pool", "reason", "count")
    list_filter = ("reason", "pool")
