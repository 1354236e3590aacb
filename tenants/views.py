"""API keys in the web UI: create (the raw key is shown once, on the response
to the POST, never stored or put in a cookie) and change their expiry; and
rotating the tenant's job-callback signing secret. Revoking is a gateway page
(gateway/web/pages.py): its confirmation shows the key's last use, which the
gateway buffers before the database has it."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.utils import timezone
from django.views.decorators.http import require_POST

from tenants.access import api_key_of_tenant, tenant_for_user_or_404, workload_of_tenant
from tenants.keys import KEY_EXPIRY_DAYS
from tenants.models import ApiKey, Workload
from tenants.services import api_key_create, api_key_expiry_set, tenant_callback_secret_rotate
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
@require_POST
def api_key_expiry_view(request, slug: str, key_id: int):
    """Set a key's expiry to one of the creation form's choices, counted from
    now (0: never)."""
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        key = api_key_of_tenant(tenant=tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.")
    days = ascii_int(request.POST.get("expires_in_days"), max_digits=4)
    back = reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#keys"
    if days not in KEY_EXPIRY_DAYS:
        messages.error(request, "Choose when the key expires from the list.")
        return redirect(back)
    try:
        api_key_expiry_set(api_key=key, expires_at=timezone.now() + timedelta(days=days) if days else None)
    except ValidationError as exc:
        messages.error(request, " ".join(m for ms in exc.message_dict.values() for m in ms))
        return redirect(back)
    when = f"on {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "never"
    messages.success(request, f"Key {key.prefix}… of {key.workload.slug} now expires {when}.")
    return redirect(back)


@login_required
@require_POST
def callback_secret_rotate_view(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    tenant_callback_secret_rotate(tenant=tenant)
    return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#callbacks")
