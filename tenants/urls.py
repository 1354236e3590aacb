from django.urls import path

from tenants import views

urlpatterns = [
    path("t/<slug:slug>/keys/new", views.api_key_new, name="api-key-new"),
    path("t/<slug:slug>/keys/<int:key_id>/revoke", views.api_key_revoke_view, name="api-key-revoke"),
    path("t/<slug:slug>/callback-secret/rotate", views.callback_secret_rotate_view, name="callback-secret-rotate"),
]
