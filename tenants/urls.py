from django.urls import path

from tenants import views

urlpatterns = [
    path("t/<slug:slug>/keys/new", views.api_key_new, name="api-key-new"),
    path("t/<slug:slug>/keys/<int:key_id>/expiry", views.api_key_expiry_view, name="api-key-expiry"),
    path("t/<slug:slug>/callback-secret/rotate", views.callback_secret_rotate_view, name="callback-secret-rotate"),
]
