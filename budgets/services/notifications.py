"""Telling a tenant's members what happened: a Notification row they see on
their page, a log line, and, where the tenant set them up, an e-mail and a
signed webhook (budgets/services/alerts.py)."""

from __future__ import annotations

import logging

from django.db import IntegrityError, transaction
from django.dispatch import Signal

from tenants.models import Tenant, Workload

from budgets.models import Notification
from budgets.services.alerts import alert_enqueue

logger = logging.getLogger(__name__)

# Sent once per notification, after its row is committed. Receivers get
# ``notification`` (a Notification).
notification_created = Signal()


def notification_create(*, tenant: Tenant, kind: str, message: str, dedupe_key: str,
                        workload: Workload | None = None) -> Notification | None:
    """Create the notification unless one with ``dedupe_key`` exists; returns
    it when this call created it, else None."""
    try:
        with transaction.atomic():
            notification = Notification.objects.create(
                tenant=tenant, workload=workload, kind=kind, message=message[:500], dedupe_key=dedupe_key[:200]
            )
    except IntegrityError:
        return None
    logger.warning("notification for tenant %s: %s", tenant.slug, message)
    alert_enqueue(notification=notification)
    transaction.on_commit(lambda: notification_created.send(sender=Notification, notification=notification))
    return notification


def notifications_of_tenant(*, tenant: Tenant, limit: int = 10) -> list[Notification]:
    return list(Notification.objects.filter(tenant=tenant).select_related("workload")[:limit])
