from django import forms
from django.contrib import admin

from gateway.models import Batch, BatchFile, Job, JobCallbackDelivery, JobSchedule
from gateway.core.jobs.schedules import schedule_delete, schedule_sync


class JobScheduleForm(forms.ModelForm):
    """A new schedule names the key its firings are made with, so their
    ledger rows count under it (JobSchedule.clean checks it is the workload's)."""

    class Meta:
        model = JobSchedule
        fields = "__all__"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["api_key"].required = self.instance.pk is None


@admin.register(JobSchedule)
class JobScheduleAdmin(admin.ModelAdmin):
    form = JobScheduleForm
    list_display = ("name", "workload", "api_key", "crontab", "jobs_per_run", "enabled")
    list_filter = ("enabled",)
    raw_id_fields = ("api_key",)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        schedule_sync(schedule=obj)

    def delete_model(self, request, obj):
        schedule_delete(schedule=obj)


class JobCallbackDeliveryInline(admin.TabularInline):
    model = JobCallbackDelivery
    extra = 0
    can_delete = False
    fields = readonly_fields = ("attempt", "at", "address", "status_code", "delivered", "error", "duration_ms",
                                "next_attempt_at")

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "workload", "status", "reason", "created_at", "release_at", "released_at", "finished_at",
                    "callback_status")
    list_filter = ("status", "workload")
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobCallbackDeliveryInline]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # DELETE /v1/files removes the content with the row


@admin.register(JobCallbackDelivery)
class JobCallbackDeliveryAdmin(admin.ModelAdmin):
    """The callback delivery log: read-only, it records what was sent."""

    list_display = ("job", "attempt", "at", "status_code", "delivered", "error", "address")
    list_filter = ("delivered",)
    search_fields = ("job__id",)
    readonly_fields = [f.name for f in JobCallbackDelivery._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # DELETE /v1/files removes the content with the row

    def has_delete_permission(self, request, obj=None):
        return False


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown, never changed by hand: a batch changes through the Batch API
    and the pacer, a file through DELETE /v1/files (which removes its
    content with its row)."""

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = ("id", "workload", "endpoint", "status", "total", "created_at", "expires_at")
    list_filter = ("status", "endpoint")
    search_fields = ("id",)


@admin.register(BatchFile)
class BatchFileAdmin(ReadOnlyAdmin):
    list_display = ("id", "workload", "purpose", "filename", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "filename")
