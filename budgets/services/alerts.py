"""Alerts that reach people: each Notification whose event the tenant chose
goes out by e-mail (Django's e-mail backend) to the tenant's recipients and
as a signed JSON POST to the tenant's webhook, from the housekeeping lane.

Every attempt is one AlertDelivery row, written after it (the delivery log the
alerts page shows); an attempt that failed parks the next one in a Redis
sorted set keyed by when it is due (never a Celery countdown: with the Redis
broker a task held past visibility_timeout is delivered twice) and the
pacer (gateway/worker/pacer.py) enqueues due ones. It reads the set's head
before each of its waits, which last at most a second, so a parked attempt
needs no wake-up: it leaves at its time, or within a second of being parked
when due sooner. Attempts, backoff and the webhook URL guard are the
job callbacks' (tenants.outbound): https only unless allowed, public hosts
only, checked again and pinned at each attempt. At least once: a receiver
dedupes on the ``id`` and X-Sluice-Attempt.

The webhook body: ``{"id", "object": "alert", "event", "kind", "tenant",
"workload", "message", "created_at"}``, signed ``X-Sluice-Signature:
t=<unix seconds>,v1=<hex HMAC-SHA256(callback secret, "<t>." + body)>``."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timezone as dt_timezone

from celery import current_app
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.utils import timezone

import httpx

from budgets.admission import keys
from budgets.redis.clients import get_redis, parked_release, redis_now_ms
from budgets.models import AlertDelivery, AlertEvent, AlertSettings, Notification
from tenants.models import Tenant
from tenants.outbound import (SIGNATURE_HEADER, CallbackRefused, callback_signature, callback_target_resolve,
                              callback_url_check, outbound_post, webhook_backoff_s)

logger = logging.getLogger(__name__)

DELIVER_ALERT_TASK = "budgets.deliver_alert"
USER_AGENT = "Sluice-Alerts/1"
MAX_RECIPIENTS = 20

# Which event a notification kind belongs to.
EVENT_OF_KIND = {
    Notification.Kind.SPEND_SOFT_THRESHOLD: AlertEvent.SPEND_SOFT,
    Notification.Kind.SPEND_HARD_CAP: AlertEvent.SPEND_HARD,
    Notification.Kind.REQUEST_APPROVED: AlertEvent.REQUEST_DECISION,
    Notification.Kind.REQUEST_REJECTED: AlertEvent.REQUEST_DECISION,
    Notification.Kind.REQUEST_EXPIRED: AlertEvent.REQUEST_DECISION,
    Notification.Kind.REJECTION_SPIKE: AlertEvent.REJECTION_SPIKE,
    # Not an event a tenant chooses: sent on request to every channel set up.
    Notification.Kind.ALERT_TEST: "test",
}


# --- settings -------------------------------------------------------------------------------


def alert_settings_of_tenant(*, tenant: Tenant) -> AlertSettings:
    """The tenant's settings, unsaved defaults (nothing sent) when it has none."""
    return AlertSettings.objects.filter(tenant=tenant).first() or AlertSettings(tenant=tenant, events=[])


def alert_settings_save(*, tenant: Tenant, email_recipients: str, webhook_url: str, events: list[str]) -> AlertSettings:
    """Check and save where the tenant's alerts go. Raises ValidationError
    (field errors): a bad address, too many, an unknown event, or a webhook
    URL the job callbacks' guard refuses (the host is resolved: not in the
    event loop)."""
    errors: dict[str, str] = {}
    recipients = [a.strip() for a in (email_recipients or "").replace(",", "\n").splitlines() if a.strip()]
    for address in recipients:
        try:
            validate_email(address)
        except ValidationError:
            errors["email_recipients"] = f"{address!r} is not an e-mail address."
            break
    if len(recipients) > MAX_RECIPIENTS:
        errors["email_recipients"] = f"At most {MAX_RECIPIENTS} recipients."
    unknown = sorted(set(events) - set(AlertEvent.values))
    if unknown:
        errors["events"] = f"Unknown events: {', '.join(unknown)}."
    webhook_url = (webhook_url or "").strip()
    if webhook_url:
        try:
            callback_url_check(url=webhook_url, field="webhook_url")
        except CallbackRefused as refused:
            errors["webhook_url"] = refused.message
    if errors:
        raise ValidationError(errors)
    config = alert_settings_of_tenant(tenant=tenant)
    config.email_recipients = "\n".join(recipients)
    config.webhook_url = webhook_url
    config.events = [e for e in AlertEvent.values if e in set(events)]
    config.save()
    return config


# --- sending --------------------------------------------------------------------------------


def _send(notification_id: int, channel: str, attempt: int) -> None:
    current_app.send_task(DELIVER_ALERT_TASK, args=[notification_id, channel, attempt])


def alert_enqueue(*, notification: Notification) -> list[str]:
    """After the notification commits: its first attempt on each channel the
    tenant set up for its event. Returns the channels."""
    config = AlertSettings.objects.filter(tenant_id=notification.tenant_id).first()
    event = EVENT_OF_KIND.get(notification.kind)
    if config is None or event not in config.events:
        return []
    return _channels_enqueue(notification=notification, channels=_channels(config))


def _channels(config: AlertSettings | None) -> list[str]:
    channels = []
    if config is not None and config.recipients:
        channels.append(AlertDelivery.Channel.EMAIL)
    if config is not None and config.webhook_url:
        channels.append(AlertDelivery.Channel.WEBHOOK)
    return channels


def _channels_enqueue(*, notification: Notification, channels: list[str]) -> list[str]:
    def send() -> None:
        for channel in channels:
            try:
                _send(notification.id, channel, 1)
            except Exception:  # the broker: let the retry set carry it
                logger.warning("could not enqueue %s alert %s; retrying from Redis", channel, notification.id,
                               exc_info=True)
                try:
                    alert_retry_schedule(notification_id=notification.id, channel=channel, attempt=1, delay_s=1.0)
                except Exception:
                    logger.error("%s alert %s lost: neither broker nor Redis answered", channel, notification.id,
                                 exc_info=True)

    transaction.on_commit(send)
    return channels


def alert_test_send(*, tenant: Tenant, user) -> list[str]:
    """A test alert to every channel the tenant set up, whatever events it
    chose: a notification of its own kind, sent, logged and retried exactly
    like a real one (the delivery log shows how it went). Returns the
    channels; raises ValidationError when none is set up."""
    channels = _channels(AlertSettings.objects.filter(tenant=tenant).first())
    if not channels:
        raise ValidationError({"alerts": "Save e-mail recipients or a webhook URL first."})
    with transaction.atomic():
        notification = Notification.objects.create(
            tenant=tenant, kind=Notification.Kind.ALERT_TEST, dedupe_key=f"alert-test:{uuid.uuid4().hex}",
            message=f"Test alert for {tenant.name}, sent by {getattr(user, 'username', '') or 'someone'} from the "
                    "alerts page. Nothing happened: this checks that alerts reach you.")
        _channels_enqueue(notification=notification, channels=channels)
    return channels


def alert_body(notification: Notification) -> dict:
    return {
        "id": notification.id, "object": "alert", "event": EVENT_OF_KIND.get(notification.kind),
        "kind": notification.kind, "tenant": notification.tenant.slug,
        "workload": notification.workload.slug if notification.workload_id else None,
        "message": notification.message, "created_at": notification.created_at.isoformat(),
    }


def alert_retry_schedule(*, notification_id: int, channel: str, attempt: int, delay_s: float) -> float:
    client = get_redis()
    due_ms = redis_now_ms(client) + delay_s * 1000
    client.zadd(keys.ALERT_RETRIES, {f"{notification_id}:{channel}:{attempt}": due_ms})
    return due_ms


def alert_retries_release(*, now_ms: float | None = None, limit: int = 100) -> int:
    """The pacer's step for alerts (gateway/worker/pacer.py): enqueue every
    attempt due by ``now_ms`` (Redis's clock; now when not given). ZREM is
    the claim, so several pacers send each once; returns how many."""
    def send(member: str) -> None:
        notification_id, channel, attempt = member.split(":")
        _send(int(notification_id), channel, int(attempt))

    now_ms = redis_now_ms() if now_ms is None else now_ms
    return parked_release(key=keys.ALERT_RETRIES, now_ms=now_ms, send=send, what="alert", limit=limit)


def _email(notification: Notification, recipients: list[str]) -> None:
    subject = f"[Sluice] {notification.tenant.name}: {notification.get_kind_display()}"
    send_mail(subject, notification.message + "\n\nSee the tenant's page in Sluice for details.",
              settings.DEFAULT_FROM_EMAIL, recipients)


def _webhook(notification: Notification, url: str, attempt: int) -> tuple[int | None, str]:
    target = callback_target_resolve(url=url, field="webhook_url")  # CallbackRefused goes to the caller
    body = json.dumps(alert_body(notification), separators=(",", ":")).encode()
    headers = {
        "Content-Type": "application/json", "User-Agent": USER_AGENT,
        SIGNATURE_HEADER: callback_signature(secret=notification.tenant.callback_secret, timestamp=int(time.time()),
                                             body=body),
        "X-Sluice-Event": str(EVENT_OF_KIND.get(notification.kind) or ""),
        "X-Sluice-Alert-Id": str(notification.id), "X-Sluice-Attempt": str(attempt),
    }
    return outbound_post(target, body=body, headers=headers), ""


def alert_deliver(*, notification_id: int, channel: str, attempt: int) -> str:
    """Make attempt ``attempt`` on ``channel``. Idempotent per (notification,
    channel, attempt): a redelivered task finds its log row and stops."""
    notification = Notification.objects.select_related("tenant", "workload").filter(pk=notification_id).first()
    config = AlertSettings.objects.filter(tenant_id=notification.tenant_id).first() if notification else None
    if notification is None or config is None:
        return "skipped"
    done = AlertDelivery.objects.filter(notification=notification, channel=channel)
    if done.filter(attempt=attempt).exists() or done.filter(delivered=True).exists():
        return "duplicate"
    at = timezone.now()
    retryable = True
    status_code: int | None = None
    error = ""
    if channel == AlertDelivery.Channel.EMAIL:
        target = ", ".join(config.recipients)
        try:
            _email(notification, config.recipients)
        except Exception as exc:  # SMTP refused, timed out, ...
            error = f"{type(exc).__name__}: {exc}"
    else:
        target = config.webhook_url
        try:
            status_code, error = _webhook(notification, config.webhook_url, attempt)
            if not 200 <= status_code < 300:
                error = f"HTTP {status_code}"
        except CallbackRefused as refused:
            error, retryable = refused.message, refused.retryable
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
    delivered = not error
    next_at = None
    if not delivered and retryable and attempt < settings.SLUICE_CALLBACK_MAX_ATTEMPTS:
        due_ms = alert_retry_schedule(notification_id=notification.id, channel=channel, attempt=attempt + 1,
                                      delay_s=webhook_backoff_s(failed_attempt=attempt))
        next_at = datetime.fromtimestamp(due_ms / 1000, tz=dt_timezone.utc)
    try:
        with transaction.atomic():
            AlertDelivery.objects.create(notification=notification, tenant_id=notification.tenant_id, channel=channel,
                                         attempt=attempt, at=at, target=target[:1000], status_code=status_code,
                                         error=error[:500], delivered=delivered, next_attempt_at=next_at)
    except IntegrityError:  # a redelivered task that got this far before
        return "duplicate"
    if not delivered:
        logger.warning("%s alert %s attempt %s failed: %s", channel, notification.id, attempt, error)
    return "delivered" if delivered else "failed"


def alert_deliveries_of_tenant(*, tenant: Tenant, limit: int = 50) -> list[AlertDelivery]:
    return list(AlertDelivery.objects.filter(tenant=tenant).select_related("notification")[:limit])
