from django.contrib import admin

from tenants.models import ApiKey, Membership, Tenant, Workload


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "cost_center")
    search_fields = ("name", "slug", "cost_center")
    prepopulated_fields = {"slug": ("name",)}
    inlines = [MembershipInline]


@admin.register(Workload)
class WorkloadAdmin(admin.ModelAdmin):
    list_display = ("slug", "tenant", "workload_class", "prompt_tokens_cap", "max_tokens_cap", "queue_timeout_s", "is_active")
    list_filter = ("workload_class", "tenant")
    search_fields = ("slug", "name", "tenant__slug")
    prepopulated_fields = {"slug": ("name",)}


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "workload", "name", "created_at", "revoked_at")
    list_filter = ("revoked_at",)
    # The hash is never shown or edited; keys are created through the UI/API,
    # which shows the raw key once.
    exclude = ("key_hash",)
    readonly_fields = ("prefix", "created_at", "last_used_at")

    def has_add_permission(self, request):
        return False
