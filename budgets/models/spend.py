"""Cost guardrails: monthly spend budgets per tenant or per workload, and the
notifications the UI shows (spend thresholds crossed, request decisions)."""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class SpendBudget(models.Model):
    """A monthly spend budget (UTC calendar month) in the price table's
    currency. Crossing ``soft_threshold`` x amount flags it on the pages and
    fires a notification; with ``hard_cap`` admission refuses new requests
    (reason ``spend_budget``) once month-to-date spend reaches the amount."""

    tenant = models.OneToOneField(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="spend_budget"
    )
    workload = models.OneToOneField(
        "tenants.Workload", null=True, blank=True, on_delete=models.CASCADE, related_name="spend_budget"
    )
    monthly_amount = models.DecimalField(
        max_digits=18, decimal_places=6, validators=[MinValueValidator(Decimal("0.000001"))]
    )
    currency = models.CharField(max_length=3, default="USD")
    soft_threshold = models.FloatField(
        default=0.8, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Fraction of the monthly amount at which the budget is flagged and a notification is sent.",
    )
    hard_cap = models.BooleanField(
        default=False, help_text="Admission rejects requests (reason spend_budget) once the monthly amount is spent."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(tenant__isnull=False, workload__isnull=True)
                           | models.Q(tenant__isnull=True, workload__isnull=False)),
                name="spend_budget_one_scope",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope_label}: {self.monthly_amount} {self.currency}/month"

    @property
    def scope_label(self) -> str:
        return f"workload {self.workload}" if self.workload_id else f"tenant {self.tenant}"

    @property
    def owner_tenant_id(self) -> int:
        return self.tenant_id if self.tenant_id else self.workload.tenant_id

    @property
    def soft_amount(self) -> Decimal:
        return (self.monthly_amount * Decimal(str(self.soft_threshold))).quantize(Decimal("0.000001"))

    def clean(self) -> None:
        if bool(self.tenant_id) == bool(self.workload_id):
            raise ValidationError("A spend budget belongs to exactly one tenant or one workload.")


class Notification(models.Model):
    """Something a tenant's members should see on their page. ``dedupe_key``
    makes each notification happen once (one threshold crossing per budget per
    month, one outcome per request)."""

    class Kind(models.TextChoices):
        SPEND_SOFT_THRESHOLD = "spend_soft_threshold", "Spend above soft threshold"
        SPEND_HARD_CAP = "spend_hard_cap", "Spend reached hard cap"
        REQUEST_APPROVED = "request_approved", "Budget request approved"
        REQUEST_REJECTED = "request_rejected", "Budget request rejected"
        REQUEST_EXPIRED = "request_expired", "Budget slice expired"
        REJECTION_SPIKE = "rejection_spike", "Sustained rejection spike"
        ALERT_TEST = "alert_test", "Test alert"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="notifications")
    workload = models.ForeignKey(
        "tenants.Workload", null=True, blank=True, on_delete=models.CASCADE, related_name="notifications"
    )
    kind = models.CharField(max_length=40, choices=Kind.choices)
    message = models.CharField(max_length=500)
    dedupe_key = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.tenant}: {self.message}"
