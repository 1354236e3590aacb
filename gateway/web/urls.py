"""Web UI routes of the pages whose data lives in gateway."""

from django.urls import path

from gateway.web import find, pages

urlpatterns = [
    path("t/<slug:slug>/keys/<int:key_id>/revoke", pages.api_key_revoke_page, name="api-key-revoke"),
    path("t/<slug:slug>/log/find", find.tenant_request_find, name="tenant-request-find"),
    path("log/find", find.any_request_find, name="request-find"),
    path("t/<slug:slug>/workloads/<slug:workload_slug>/jobs", pages.workload_jobs, name="workload-jobs"),
]
