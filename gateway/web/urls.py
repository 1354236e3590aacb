"""Web UI routes of the pages whose data lives in gateway."""

from django.urls import path

from gateway.web import pages

urlpatterns = [
    path("t/<slug:slug>/keys/<int:key_id>/revoke", pages.api_key_revoke_page, name="api-key-revoke"),
    path("t/<slug:slug>/workloads/<slug:workload_slug>/jobs", pages.workload_jobs, name="workload-jobs"),
]
