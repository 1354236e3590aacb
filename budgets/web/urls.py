"""Web UI routes of the pages whose data lives in budgets."""

from django.urls import path

from budgets.web.views import alerts, finance, home, ops, request_log, tenant_pages

urlpatterns = [
    path("", home.home, name="home"),
    path("t/", home.tenant_list, name="tenant-list"),
    path("t/<slug:slug>/", tenant_pages.tenant_detail, name="tenant-detail"),
    path("t/<slug:slug>/requests/new", tenant_pages.budget_request_new, name="budget-request-new"),
    path("t/<slug:slug>/requests/<int:request_id>/", tenant_pages.budget_request_detail, name="budget-request-detail"),
    path("t/<slug:slug>/requests/<int:request_id>/withdraw", tenant_pages.budget_request_withdraw_view,
         name="budget-request-withdraw"),
    path("t/<slug:slug>/alerts", alerts.tenant_alerts, name="tenant-alerts"),
    path("t/<slug:slug>/alerts/test", alerts.tenant_alerts_test, name="tenant-alerts-test"),
    path("ops/pools/", ops.pool_list, name="pool-list"),
    path("ops/pools/<slug:slug>/", ops.pool_detail, name="pool-detail"),
    path("ops/pools/<slug:slug>/live", ops.pool_live, name="pool-live"),
    path("ops/requests/", ops.review_list, name="review-list"),
    path("ops/requests/<int:request_id>/", ops.review_detail, name="review-detail"),
    path("ops/requests/<int:request_id>/approve", ops.review_decide, {"decision": "approve"}, name="review-approve"),
    path("ops/requests/<int:request_id>/reject", ops.review_decide, {"decision": "reject"}, name="review-reject"),
    path("t/<slug:slug>/log/", request_log.tenant_request_log, name="tenant-request-log"),
    path("t/<slug:slug>/log/<str:request_id>/", request_log.tenant_request_detail, name="tenant-request-detail"),
    path("log/", request_log.all_request_log, name="request-log"),
    path("log/<str:request_id>/", request_log.any_request_detail, name="request-detail"),
    path("finance/", finance.finance, name="finance"),
    path("finance/ledger.csv", finance.finance_export, name="finance-export"),
]
