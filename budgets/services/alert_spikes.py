"""A sustained spike of rejections becomes a notification (and so an alert),
read from the flushed per-minute rejection counts, not from the request path."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from budgets.models import Notification, RejectionStat
from budgets.services.notifications import notification_create
from tenants.models import Tenant


def rejection_spikes_check(*, now: datetime | None = None) -> int:
    """Notify each tenant that had at least SLUICE_ALERT_REJECTION_SPIKE_PER_MINUTE
    rejections in every one of the last SLUICE_ALERT_REJECTION_SPIKE_MINUTES
    flushed minutes; once per tenant per hour. Returns how many were notified."""
    now = now or timezone.now()
    minutes = settings.SLUICE_ALERT_REJECTION_SPIKE_MINUTES
    threshold = settings.SLUICE_ALERT_REJECTION_SPIKE_PER_MINUTE
    # The current minute is still counting and the last closed one may not
    # be flushed yet (budgets.flush_rejections runs every 15 s): both left out.
    end = now.replace(second=0, microsecond=0) - timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    per_minute = (RejectionStat.objects.filter(minute__gte=start, minute__lt=end)
                  .values("tenant_id", "minute").annotate(total=Sum("count")).filter(total__gte=threshold))
    busy: dict[int, int] = {}
    totals: dict[int, int] = {}
    for row in per_minute:
        busy[row["tenant_id"]] = busy.get(row["tenant_id"], 0) + 1
        totals[row["tenant_id"]] = totals.get(row["tenant_id"], 0) + row["total"]
    notified = 0
    for tenant in Tenant.objects.filter(pk__in=[t for t, n in busy.items() if n >= minutes]):
        created = notification_create(
            tenant=tenant, kind=Notification.Kind.REJECTION_SPIKE, dedupe_key=f"rejection_spike:{tenant.id}:{end:%Y%m%d%H}",
            message=(f"{totals[tenant.id]:,} requests of {tenant.name} were rejected in the last {minutes} minutes "
                     f"(at least {threshold:,} every minute). See the rejections on the tenant page."),
        )
        notified += created is not None
    return notified
