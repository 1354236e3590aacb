"""The management API (/api/*): DRF views of tenants and budgets, token
authentication, the OpenAPI schema and its browsable docs."""

from django.urls import path, re_path
from drf_spectacular.views import SpectacularSwaggerSplitView

from budgets.api import views as budgets_api
from gateway.web import api as gateway_api
from llm_platform.login import ThrottledObtainAuthToken
from llm_platform.schema_view import SchemaView
from tenants import api as tenants_api

urlpatterns = [
    path("auth/token/", ThrottledObtainAuthToken.as_view(), name="api-token"),
    path("tenants/", tenants_api.TenantList.as_view(), name="api-tenant-list"),
    path("tenants/<slug:slug>/", tenants_api.TenantDetail.as_view(), name="api-tenant-detail"),
    path("tenants/<slug:slug>/keys/", tenants_api.ApiKeyList.as_view(), name="api-key-list"),
    path("tenants/<slug:slug>/keys/<int:key_id>/revoke/", tenants_api.ApiKeyRevoke.as_view(), name="api-key-revoke"),
    path("tenants/<slug:slug>/callback-secret/", tenants_api.CallbackSecret.as_view(), name="api-callback-secret"),
    path("tenants/<slug:slug>/callback-secret/rotate/", tenants_api.CallbackSecretRotate.as_view(),
         name="api-callback-secret-rotate"),
    path("tenants/<slug:slug>/workloads/", budgets_api.WorkloadList.as_view(), name="api-workload-list"),
    path("tenants/<slug:slug>/workloads/<int:workload_id>/", budgets_api.WorkloadDetail.as_view(),
         name="api-workload-detail"),
    path("pools/", budgets_api.PoolList.as_view(), name="api-pool-list"),
    path("pools/<slug:slug>/", budgets_api.PoolDetail.as_view(), name="api-pool-detail"),
    path("budget-requests/", budgets_api.BudgetRequestList.as_view(), name="api-budget-request-list"),
    path("budget-requests/<int:request_id>/", budgets_api.BudgetRequestDetail.as_view(),
         name="api-budget-request-detail"),
    path("budget-requests/<int:request_id>/approve/", budgets_api.BudgetRequestDecision.as_view(decision="approve"),
         name="api-budget-request-approve"),
    path("budget-requests/<int:request_id>/reject/", budgets_api.BudgetRequestDecision.as_view(decision="reject"),
         name="api-budget-request-reject"),
    # Any id a caller holds: request id, chatcmpl- id or job id (with or without the trailing slash).
    re_path(r"^requests/(?P<request_id>[^/]{1,200})/?$", gateway_api.RequestLookup.as_view(), name="api-request-detail"),
    path("spend-budgets/", budgets_api.SpendBudgetList.as_view(), name="api-spend-budget-list"),
    path("usage/summary/", budgets_api.UsageSummaryView.as_view(), name="api-usage-summary"),
    path("ledger/export/", budgets_api.LedgerExportView.as_view(), name="api-ledger-export"),
    path("schema/", SchemaView.as_view(), name="api-schema"),
    # The split view serves Swagger UI's init script from its own URL: no
    # inline script, so the page works under the UI's Content-Security-Policy.
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
]
