"""Where a tenant's alerts go (e-mail recipients, a signed webhook, which
events) and the log of every delivery attempt. The alerts themselves are
Notifications (budgets.models.spend)."""

from __future__ import annotations

from django.db import models


class AlertEvent(models.TextChoices):
    """What a tenant can choose to be told about; each covers some Notification kinds."""

    SPEND_SOFT = "spend_soft", "Spend passes a soft threshold"
    SPEND_HARD = "spend_hard", "Spend reaches a hard cap"
    REQUEST_DECISION = "request_decision", "Budget request decided or slice expired"
    REJECTION_SPIKE = "rejection_spike", "Sustained spike of rejections"


class AlertSettings(models.Model):
    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="alert_settings")
    email_recipients = models.TextField(blank=True, help_text="E-mail addresses, one per line or comma-separated.")
    webhook_url = models.URLField(max_length=1000, blank=True,
                                  help_text="POSTed each alert as JSON, signed with the tenant's callback secret.")
    events = models.JSONField(default=list, blank=True, help_text="AlertEvent values to send.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "alert settings"
        verbose_name_plural = "alert settings"

    def __str__(self) -> str:
        return f"alerts of {self.tenant}"

    @property
    def recipients(self) -> list[str]:
        return [a.strip() for a in self.email_recipients.replace(",", "\n").splitlines() if a.strip()]


class AlertDelivery(models.Model):
    """One attempt to deliver one alert on one channel, written after the attempt."""

    class Channel(models.TextChoices):
        EMAIL = "email", "E-mail"
        WEBHOOK = "webhook", "Webhook"

    notification = models.ForeignKey("budgets.Notification", on_delete=models.CASCADE, related_name="deliveries")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    channel = models.CharField(max_length=10, choices=Channel.choices)
    attempt = models.PositiveSmallIntegerField()
    at = models.DateTimeField()
    target = models.CharField(max_length=1000, help_text="The recipients or the webhook URL, as sent.")
    status_code = models.IntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    delivered = models.BooleanField(default=False)
    next_attempt_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "alert deliveries"
        constraints = [models.UniqueConstraint(fields=["notification", "channel", "attempt"],
                                               name="uniq_alert_delivery_attempt")]
        indexes = [models.Index(fields=["tenant", "-at"])]

    def __str__(self) -> str:
        return f"{self.channel} #{self.attempt} of notification {self.notification_id}"
