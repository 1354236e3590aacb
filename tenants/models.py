"""Who calls the pool: tenants, their members, their workloads and keys.

This app knows nothing of budgets or the request path (docs/architecture.md, "Dependencies point one way")."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from tenants.keys import callback_secret_generate


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    cost_center = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    callback_secret = models.CharField(
        max_length=100, default=callback_secret_generate, editable=False,
        help_text="Signs this tenant's job callbacks (X-Sluice-Signature). Rotate it from the tenant page or API.",
    )
    callback_secret_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["slug"]
        permissions = [
            ("audit_all_tenants", "Can read every tenant's usage, spend and ledger (finance auditor, read-only)"),
        ]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        MEMBER = "member", "Member"
        OWNER = "owner", "Owner"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="uniq_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class Workload(models.Model):
    """One caller of the pool with its own limits: a chat assistant, a nightly
    enrichment job. Its budget slice lives in budgets.Reservation."""

    class WorkloadClass(models.TextChoices):
        INTERACTIVE = "interactive", "Interactive"
        BATCH = "batch", "Batch"
        SCHEDULED = "scheduled", "Scheduled"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="workloads")
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    workload_class = models.CharField(
        "class", max_length=20, choices=WorkloadClass.choices, default=WorkloadClass.INTERACTIVE
    )
    prompt_tokens_cap = models.PositiveIntegerField(
        default=8000, validators=[MinValueValidator(1)], help_text="Prompts above this are rejected (400)."
    )
    max_tokens_cap = models.PositiveIntegerField(
        default=1024, validators=[MinValueValidator(1)], help_text="max_tokens above this is clamped."
    )
    max_tokens_default = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1)], help_text="Applied when a request sets no max_tokens."
    )
    queue_timeout_s = models.FloatField(
        default=10.0,
        validators=[MinValueValidator(0.05)],
        help_text="A request still queued after this long is dropped without reaching the pool.",
    )
    allowed_models = models.JSONField(
        default=list, blank=True,
        help_text='Models this workload may call, e.g. ["sim-small"]; empty: any model its slices\' pools serve.')
    allow_overflow = models.BooleanField(
        default=True, help_text="May requests spill over to overflow slices (a rank above the primary)?")
    overflow_monthly_cap = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True,
        help_text="Most this workload may spend on overflow slices in a month (blank: no cap of its own).")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "slug"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.slug}"

    def clean(self) -> None:
        if self.max_tokens_default and self.max_tokens_cap and self.max_tokens_default > self.max_tokens_cap:
            raise ValidationError({"max_tokens_default": "The default cannot exceed the max_tokens cap."})


class ApiKey(models.Model):
    """A workload's credential. Only a SHA-256 digest and a short display
    prefix are stored; the full key is shown once, when it is created."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True)
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Indexed: every web process asks twice a second which keys were revoked
    # lately (gateway/web/auth.py).
    revoked_at = models.DateTimeField(null=True, blank=True, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True,
                                      help_text="The key stops working at this time; empty: it never expires.")
    last_used_at = models.DateTimeField(null=True, blank=True,
                                        help_text="Written in batches (about once a minute), not per request.")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.workload})"

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired
