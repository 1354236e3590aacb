"""API keys in the web UI: create (the raw key is shown once, on the response
to the POST, never stored or put in a cookie) and revoke; and rotating the
tenant's job-callback signing secret."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from tenants.access import api_key_of_tenant, tenant_for_user_or_404, workload_of_tenant
from tenants.keys import KEY_EXPIRY_DAYS
from tenants.models import ApiKey, Workload
from tenants.services import api_key_create, api_key_revoke, tenant_callback_secret_rotate
from tenants.text_numbers import ascii_int


@login_required
@require_POST
@never_cache
def api_key_new(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    workload_id = ascii_int(request.POST.get("workload"))
    try:
        workload = None if workload_id is None else workload_of_tenant(tenant=tenant, workload_id=workload_id)
    except Workload.DoesNotExist:
        workload = None
    if workload is None:
        return render(request, "tenants/api_key_created.html",
                      {"tenant": tenant, "error": "Choose one of this tenant's workloads."}, status=400)
    days = ascii_int(request.POST.get("expires_in_days") or "0", max_digits=4)
    if days is None or days not in KEY_EXPIRY_DAYS:
        return render(request, "tenants/api_key_created.html",
                      {"tenant": tenant, "error": "Choose when the key expires from the list."}, status=400)
    name = (request.POST.get("name") or "").strip()[:200]
    expires_at = timezone.now() + timedelta(days=days) if days else None
    created = api_key_create(workload=workload, name=name, expires_at=expires_at)
    return render(request, "tenants/api_key_created.html", {"tenant": tenant, "created": created})


@login_required
@require_http_methods(["GET", "POST"])
def api_key_revoke_view(request, slug: str, key_id: int):
    """GET: a page that says what revoking does and asks to confirm. POST
    with ``confirm=revoke``: revoke. A POST without it (a stale form, a
    script) is shown the confirmation, never acted on."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        key = api_key_of_tenant(tenant=tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.")
    if request.method == "POST" and request.POST.get("confirm") == "revoke":
        api_key_revoke(api_key=key)
        messages.success(request, f"Key {key.prefix}… of {key.workload.slug} is revoked: calls with it are refused "
                                  f"within a second on every gateway process.")
        return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#keys")
    return render(request, "tenants/api_key_revoke.html", {
        "tenant": tenant, "key": key, "poll_s": settings.SLUICE_AUTH_REVOCATION_POLL_S,
    }, status=200 if request.method == "GET" else 400)


@login_required
@require_POST
def callback_secret_rotate_view(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    tenant_callback_secret_rotate(tenant=tenant)
    return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#callbacks")
