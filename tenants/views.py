"""API keys in the web UI: create (the raw key is shown once, on the response
to the POST, never stored or put in a cookie) and revoke; and rotating the
tenant's job-callback signing secret."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from tenants.access import api_key_of_tenant, tenant_for_user_or_404, workload_of_tenant
from tenants.models import ApiKey, Workload
from tenants.services import api_key_create, api_key_revoke, tenant_callback_secret_rotate


@login_required
@require_POST
@never_cache
def api_key_new(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        workload = workload_of_tenant(tenant=tenant, workload_id=int(request.POST.get("workload", "")))
    except (ValueError, Workload.DoesNotExist):
        return render(request, "tenants/api_key_created.html",
                      {"tenant": tenant, "error": "Choose one of this tenant's workloads."}, status=400)
    name = (request.POST.get("name") or "").strip()[:200]
    created = api_key_create(workload=workload, name=name)
    return render(request, "tenants/api_key_created.html", {"tenant": tenant, "created": created})


@login_required
@require_POST
def api_key_revoke_view(request, slug: str, key_id: int):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        key = api_key_of_tenant(tenant=tenant, key_id=key_id)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.")
    api_key_revoke(api_key=key)
    return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#keys")


@login_required
@require_POST
def callback_secret_rotate_view(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    tenant_callback_secret_rotate(tenant=tenant)
    return redirect(reverse("tenant-detail", kwargs={"slug": tenant.slug}) + "#callbacks")
