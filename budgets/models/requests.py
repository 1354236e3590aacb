"""Budget-slice requests and their audit history.

A member asks for a slice of a pool (reserved TPM, ceiling TPM, RPM, an
optional monthly spend budget) for a new or an existing workload; a platform
admin approves it against the pool's real headroom or rejects it. What was
asked is never rewritten, a decision is final once taken, and every step is an
append-only ``BudgetRequestEvent``. The ORM guards below are the first line; a
PostgreSQL trigger (migration 0004) refuses the same edits from any client."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class AuditImmutable(Exception):
    """An edit or delete of audit history was attempted."""


# Fields of a request that record what was asked: never changed after submit.
REQUESTED_FIELDS = (
    "tenant_id", "requested_by_id", "pool_id", "new_workload_name", "new_workload_class", "reserved_tpm",
    "ceiling_tpm", "rpm", "lend_fraction", "monthly_spend_budget", "spend_soft_threshold", "spend_hard_cap",
    "justification", "ends_on", "created_at",
)


ALLOWED_TRANSITIONS = {
    ("pending", "pending"), ("pending", "approved"), ("pending", "rejected"),
    ("approved", "approved"), ("approved", "expired"), ("rejected", "rejected"), ("expired", "expired"),
    ("pending", "withdrawn"), ("withdrawn", "withdrawn"),  # a member takes a pending request back
}
DECISION_FIELDS = ("decided_by_id", "decided_at", "decision_comment")


class BudgetRequestQuerySet(models.QuerySet):
    def delete(self):
        raise AuditImmutable("Budget requests are audit history: they cannot be deleted.")


class BudgetRequest(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"
        EXPIRED = "expired", "Expired"
        WITHDRAWN = "withdrawn", "Withdrawn"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="budget_requests")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    pool = models.ForeignKey("budgets.InferencePool", on_delete=models.PROTECT, related_name="budget_requests")
    workload = models.ForeignKey(
        "tenants.Workload", null=True, blank=True, on_delete=models.PROTECT, related_name="budget_requests",
        help_text="The workload the slice is for; empty for a new workload, filled in when it is approved.",
    )
    new_workload_name = models.CharField(max_length=200, blank=True)
    new_workload_class = models.CharField(max_length=20, blank=True)
    reserved_tpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    ceiling_tpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    rpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    lend_fraction = models.FloatField(default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    monthly_spend_budget = models.DecimalField(
        max_digits=18, decimal_places=6, null=True, blank=True, validators=[MinValueValidator(Decimal("0.000001"))],
        help_text="Optional monthly spend budget for the workload, in the price table's currency.",
    )
    spend_soft_threshold = models.FloatField(
        default=0.8, validators=[MinValueValidator(0.01), MaxValueValidator(1.0)]
    )
    spend_hard_cap = models.BooleanField(default=False)
    justification = models.TextField()
    ends_on = models.DateField(null=True, blank=True, help_text="The slice lapses after this day (UTC).")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING, db_index=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_comment = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = BudgetRequestQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(ceiling_tpm__gte=models.F("reserved_tpm")), name="budget_request_ceiling_gte_reserved"
            ),
            models.CheckConstraint(
                condition=~models.Q(workload__isnull=True, new_workload_name="", status="pending"),
                name="budget_request_names_a_workload",
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.tenant} on {self.pool}: {self.reserved_tpm}/{self.ceiling_tpm} TPM ({self.status})"

    @property
    def workload_label(self) -> str:
        if self.workload_id:
            return str(self.workload.slug)
        return f"{self.new_workload_name} (new)"

    @property
    def is_pending(self) -> bool:
        return self.status == self.Status.PENDING

    def clean(self) -> None:
        if self.ceiling_tpm is not None and self.reserved_tpm is not None and self.ceiling_tpm < self.reserved_tpm:
            raise ValidationError({"ceiling_tpm": "The ceiling must be at least the reserved rate."})

    def save(self, *args, **kwargs):
        if not self._state.adding and self.pk:
            self._refuse_rewrites()
        super().save(*args, **kwargs)

    def _refuse_rewrites(self) -> None:
        stored = (
            type(self).objects.filter(pk=self.pk)
            .values(*REQUESTED_FIELDS, "status", "workload_id", *DECISION_FIELDS).first()
        )
        if stored is None:
            return
        changed = [f for f in REQUESTED_FIELDS if stored[f] != getattr(self, f)]
        if changed:
            raise AuditImmutable(f"A budget request's contents cannot change (tried {', '.join(changed)}).")
        if (stored["status"], self.status) not in ALLOWED_TRANSITIONS:
            raise AuditImmutable(f"A budget request cannot go from {stored['status']} to {self.status}.")
        if stored["decided_at"] is not None and any(stored[f] != getattr(self, f) for f in DECISION_FIELDS):
            raise AuditImmutable("A decision, once taken, cannot be rewritten.")
        if stored["workload_id"] is not None and stored["workload_id"] != self.workload_id:
            raise AuditImmutable("A budget request cannot move to another workload.")

    def delete(self, *args, **kwargs):
        raise AuditImmutable("Budget requests are audit history: they cannot be deleted.")


class AppendOnlyQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AuditImmutable("Audit history is append-only: rows cannot be updated.")

    def delete(self):
        raise AuditImmutable("Audit history is append-only: rows cannot be deleted.")


class BudgetRequestEvent(models.Model):
    """One step in a request's life, written once: who did what, when, and the
    pool's headroom they saw."""

    class Action(models.TextChoices):
        SUBMITTED = "submitted", "Submitted"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"
        EXPIRED = "expired", "Expired"
        WITHDRAWN = "withdrawn", "Withdrawn"

    request = models.ForeignKey(BudgetRequest, on_delete=models.PROTECT, related_name="events")
    action = models.CharField(max_length=20, choices=Action.choices)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    actor_name = models.CharField(max_length=150, blank=True, help_text="The actor's username when it happened.")
    comment = models.TextField(blank=True)
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"request #{self.request_id} {self.action} by {self.actor_name or 'system'}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AuditImmutable("Audit history is append-only: rows cannot be updated.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AuditImmutable("Audit history is append-only: rows cannot be deleted.")
