"""Read models that keep the pages fast: daily usage rolled up from the
ledger, and rejection counts flushed from Redis per minute."""

from __future__ import annotations

from decimal import Decimal

from django.db import models

from budgets.models.pools import UsageRecord


class DailyUsage(models.Model):
    """Ledger totals for one UTC day and one (tenant, workload, pool, model, endpoint).
    Rebuilt idempotently from the ledger by ``budgets.rollups``."""

    day = models.DateField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey("tenants.Workload", on_delete=models.CASCADE, related_name="+")
    pool = models.ForeignKey("budgets.InferencePool", on_delete=models.CASCADE, related_name="+")
    model = models.CharField(max_length=200)
    endpoint = models.CharField(max_length=64, default=UsageRecord.CHAT_COMPLETIONS)  # UsageRecord.endpoint
    requests = models.PositiveIntegerField(default=0)
    ok_requests = models.PositiveIntegerField(default=0)
    borrowed_requests = models.PositiveIntegerField(default=0)
    estimated_input_tokens = models.BigIntegerField(default=0)
    estimated_output_tokens = models.BigIntegerField(default=0)
    actual_input_tokens = models.BigIntegerField(default=0)
    actual_output_tokens = models.BigIntegerField(default=0)
    cost = models.DecimalField(max_digits=22, decimal_places=8, default=Decimal("0"))
    # Of which on overflow slices (UsageRecord.overflow): finance shows it apart.
    overflow_requests = models.PositiveIntegerField(default=0)
    overflow_cost = models.DecimalField(max_digits=22, decimal_places=8, default=Decimal("0"))

    class Meta:
        ordering = ["day"]
        constraints = [
            models.UniqueConstraint(fields=["day", "tenant", "workload", "pool", "model", "endpoint"],
                                    name="uniq_daily_usage_endpoint"),
        ]
        indexes = [
            models.Index(fields=["tenant", "day"]),
            models.Index(fields=["workload", "day"]),
            models.Index(fields=["day"]),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.workload_id} {self.model}: {self.cost}"


class RollupState(models.Model):
    """Where the daily rollup stands. ``final_through``: every day up to and
    including it is complete in DailyUsage (no ledger row can still arrive
    for it); later days are read live from the ledger."""

    name = models.CharField(max_length=50, primary_key=True)
    last_ledger_id = models.BigIntegerField(default=0)
    final_through = models.DateField(null=True, blank=True)
    refreshed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name}: ledger id {self.last_ledger_id}, final through {self.final_through}"


class RejectionStat(models.Model):
    """How many requests one workload had refused for one reason in one minute."""

    minute = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey("tenants.Workload", on_delete=models.CASCADE, related_name="+")
    pool = models.ForeignKey("budgets.InferencePool", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    reason = models.CharField(max_length=64)
    count = models.PositiveIntegerField()

    class Meta:
        ordering = ["-minute"]
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "pool", "workload", "reason"], name="uniq_rejection_stat", nulls_distinct=False
            ),
        ]
        indexes = [
            models.Index(fields=["pool", "minute"]),
            models.Index(fields=["workload", "minute"]),
            models.Index(fields=["tenant", "minute"]),
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} wl {self.workload_id} {self.reason} x{self.count}"


class RejectionSample(models.Model):
    """A detailed example of a rejection (the first few per minute per
    workload and reason), so members can see what was refused and why.
    ``sample_id`` is the refused request's id (its ``x-request-id``) when it
    had one, so a caller's report finds the sample."""

    sample_id = models.CharField(max_length=64, unique=True)
    at = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    workload = models.ForeignKey("tenants.Workload", on_delete=models.CASCADE, related_name="+")
    pool = models.ForeignKey("budgets.InferencePool", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    reason = models.CharField(max_length=64)
    estimated_tokens = models.PositiveIntegerField(default=0)
    # 64-bit: a spend cap refused early in a month says retry in weeks, past
    # a 32-bit column's 24.8 days of milliseconds.
    retry_after_ms = models.PositiveBigIntegerField(null=True, blank=True)
    # The refusal as the caller read it, with its numbers ("at most 2000
    # tokens; your prompt ... resulted in 9008 tokens").
    message = models.CharField(max_length=300, blank=True)
    # The key that made the refused request (None: a job's or cron firing's
    # refusal without one, or a sample from before keys were recorded).
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-at"]
        indexes = [
            models.Index(fields=["workload", "-at"]),
            models.Index(fields=["tenant", "-at"]),
            models.Index(fields=["at"]),
        ]

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S} wl {self.workload_id} {self.reason}"
