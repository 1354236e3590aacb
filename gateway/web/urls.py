"""Web UI routes of the pages whose data lives in gateway."""

from django.urls import path

from gateway.web import batch_pages, find, pages

urlpatterns = [
    path("t/<slug:slug>/keys/<int:key_id>/revoke", pages.api_key_revoke_page, name="api-key-revoke"),
    path("t/<slug:slug>/log/find", find.tenant_request_find, name="tenant-request-find"),
    path("log/find", find.any_request_find, name="request-find"),
    path("t/<slug:slug>/workloads/<slug:workload_slug>/jobs", pages.workload_jobs, name="workload-jobs"),
    path("t/<slug:slug>/workloads/<slug:workload_slug>/batches", batch_pages.workload_batches,
         name="workload-batches"),
    path("t/<slug:slug>/batches/<slug:batch_id>", batch_pages.batch_detail_page, name="batch-detail"),
    path("t/<slug:slug>/batches/<slug:batch_id>/cancel", batch_pages.batch_cancel_page, name="batch-cancel"),
    path("t/<slug:slug>/files/<slug:file_id>/content", batch_pages.batch_file_download, name="batch-file-content"),
]
