from django.contrib import admin

from .models import InferencePool, ModelPrice, Reservation, UsageRecord


@admin.register(InferencePool)
class InferencePoolAdmin(admin.ModelAdmin):
    list_display = ("slug", "base_url", "provider_tpm", "provider_rpm", "headroom", "burst_seconds", "max_concurrency", "is_active")
    prepopulated_fields = {"slug": ("name",)}


@admin.register(Reservation)
class ReservationAdmin(admin.ModelAdmin):
    list_display = ("workload", "pool", "reserved_tpm", "ceiling_tpm", "lend_fraction", "rpm", "max_concurrency")
    list_filter = ("pool",)


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    list_display = ("model", "input_per_million", "output_per_million", "currency", "effective_from")


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    """Read-only: the ledger is append-only."""

    list_display = ("request_id", "created_at", "tenant", "workload", "model", "lane", "status", "borrowed",
                    "estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens", "actual_output_tokens", "cost")
    list_filter = ("status", "lane", "borrowed", "tenant")
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
