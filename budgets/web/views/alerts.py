"""The alerts page of a tenant: where its alerts go (e-mail recipients, a
signed webhook, which events) and the log of every delivery attempt.
Members and admins change it; finance reads it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from tenants.access import tenant_for_user_or_404, tenant_is_writable

from budgets.models import AlertEvent
from budgets.services.alerts import (
    alert_deliveries_of_tenant,
    alert_settings_of_tenant,
    alert_settings_save,
    alert_test_send,
)


@login_required
@require_POST
def tenant_alerts_test(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
    try:
        channels = alert_test_send(tenant=tenant, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(m for ms in exc.message_dict.values() for m in ms))
    else:
        messages.success(request, f"Test alert sent by {' and '.join(channels)}: its deliveries show below "
                                  "within seconds.")
    return redirect("tenant-alerts", slug=tenant.slug)


@login_required
@require_http_methods(["GET", "POST"])
def tenant_alerts(request, slug: str):
    tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=request.method == "POST")
    config = alert_settings_of_tenant(tenant=tenant)
    values = {"email_recipients": config.email_recipients, "webhook_url": config.webhook_url, "events": config.events}
    errors: dict[str, list[str]] = {}
    if request.method == "POST":
        values = {"email_recipients": request.POST.get("email_recipients", "")[:5000],
                  "webhook_url": request.POST.get("webhook_url", "")[:2000],
                  "events": request.POST.getlist("events")}
        try:
            alert_settings_save(tenant=tenant, **values)
        except ValidationError as exc:
            errors = exc.message_dict
        else:
            messages.success(request, "Alert settings saved.")
            return redirect("tenant-alerts", slug=tenant.slug)
    return render(request, "budgets/alerts.html", {
        "tenant": tenant, "values": values, "errors": errors, "events": AlertEvent.choices,
        "deliveries": alert_deliveries_of_tenant(tenant=tenant),
        "can_write": tenant_is_writable(user=request.user, slug=slug),
    }, status=400 if errors else 200)
