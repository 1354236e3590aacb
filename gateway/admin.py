from django.contrib import admin

from gateway.models import Job, JobSchedule
from gateway.core.schedules import schedule_delete, schedule_sync


@admin.register(JobSchedule)
class JobScheduleAdmin(admin.ModelAdmin):
    list_display = ("name", "workload", "crontab", "jobs_per_run", "enabled")
    list_filter = ("enabled",)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        schedule_sync(schedule=obj)

    def delete_model(self, request, obj):
        schedule_delete(schedule=obj)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "workload", "status", "reason", "created_at", "release_at", "released_at", "finished_at")
    list_filter = ("status", "workload")
    readonly_fields = [f.name for f in Job._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
