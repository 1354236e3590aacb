from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from gateway.web import batches as batch_views
from gateway.web import views as gateway_views
from llm_platform import observability
from llm_platform.login import SluiceLoginView, login_throttled

urlpatterns = [
    path("v1/chat/completions", gateway_views.chat_completions, name="chat-completions"),
    path("v1/completions", gateway_views.completions, name="completions"),
    path("v1/embeddings", gateway_views.embeddings, name="embeddings"),
    path("v1/models", gateway_views.models, name="models"),
    path("v1/jobs", gateway_views.jobs, name="jobs"),
    path("v1/jobs/<uuid:job_id>", gateway_views.job_detail, name="job-detail"),
    path("v1/files", batch_views.files, name="files"),
    path("v1/files/<str:file_id>", batch_views.file_detail, name="file-detail"),
    path("v1/files/<str:file_id>/content", batch_views.file_content, name="file-content"),
    path("v1/batches", batch_views.batches, name="batches"),
    path("v1/batches/<str:batch_id>", batch_views.batch_detail, name="batch-detail"),
    path("v1/batches/<str:batch_id>/cancel", batch_views.batch_cancel_view, name="batch-cancel"),
    path("healthz", gateway_views.healthz, name="healthz"),
    path("readyz", gateway_views.readyz, name="readyz"),
    path("metrics", observability.metrics, name="metrics"),
    path("api/pools/<int:pool_id>/metrics", gateway_views.pool_metrics, name="pool-metrics"),
    # Admin's own login, throttled like ours (matched before admin's urls).
    path("admin/login/", login_throttled(admin.site.login)),
    path("admin/", admin.site.urls),
    # Web UI and management API (issue 5)
    path("accounts/login/", login_throttled(SluiceLoginView.as_view()), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("llm_platform.api_urls")),
    path("", include("tenants.urls")),
    path("", include("gateway.web.urls")),
    path("", include("budgets.web.urls")),
]
