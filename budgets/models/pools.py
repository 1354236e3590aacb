"""How much: pools, reservations (a workload's slices, one per pool it may be
routed to), prices and the append-only ledger."""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Sum

from tenants.models import ApiKey, Tenant, Workload


class InferencePool(models.Model):
    """An OpenAI-compatible upstream (vLLM, TGI, a provider) and its limits."""

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    base_url = models.URLField(max_length=500, help_text="OpenAI-compatible base URL, e.g. http://vllm:8000/v1")
    api_key_env = models.CharField(
        max_length=100, blank=True, help_text="Name of the environment variable holding the pool's API key."
    )
    served_models = models.JSONField(default=list, help_text='Model ids the pool serves, e.g. ["sim-small"].')
    provider_tpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    provider_rpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    provider_input_tpm = models.PositiveIntegerField(null=True, blank=True)
    provider_output_tpm = models.PositiveIntegerField(null=True, blank=True)
    headroom = models.FloatField(
        default=0.8,
        validators=[MinValueValidator(0.05), MaxValueValidator(1.0)],
        help_text="Fraction of the provider limits admission may use per minute.",
    )
    burst_seconds = models.FloatField(
        default=15.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(60.0)],
        help_text="Bucket capacity in seconds of refill.",
    )
    max_concurrency = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1)], help_text="In-flight requests the pool may hold."
    )
    tokenizer = models.CharField(max_length=50, default="cl100k_base")
    estimate_safety_factor = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(1.0), MaxValueValidator(3.0)],
        help_text="Multiplier on prompt estimates for models whose tokenizer is not the one above.",
    )
    is_active = models.BooleanField(default=True)
    is_simulator = models.BooleanField(
        default=False,
        help_text="A simulated pool (inference_sim): callers may use its test switches (the body's \"sim\") "
                  "where SLUICE_SIM_CONTROLS is on. Never set it on a real pool.",
    )

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.name

    @property
    def admission_tpm(self) -> float:
        return self.headroom * self.provider_tpm

    @property
    def admission_rpm(self) -> float:
        return self.headroom * self.provider_rpm

    def clean(self) -> None:
        # I1: a bucket refilling at headroom*TPM with burst_seconds of capacity
        # admits at most headroom*TPM*(1 + burst/60) in a 60 s window.
        if self.headroom is not None and self.burst_seconds is not None:
            worst_minute = self.headroom * (1 + self.burst_seconds / 60.0)
            if worst_minute > 1.0 + 1e-9:
                raise ValidationError(
                    {
                        "burst_seconds": (
                            f"headroom {self.headroom} with {self.burst_seconds}s of burst can admit "
                            f"{worst_minute:.2f}x the provider limit in one minute; keep "
                            "headroom x (1 + burst_seconds/60) <= 1."
                        )
                    }
                )
        if self.pk:
            reserved = self.reservations.aggregate(t=Sum("reserved_tpm"), r=Sum("rpm"))
            if self.provider_tpm and (reserved["t"] or 0) > self.admission_tpm:
                raise ValidationError({"provider_tpm": "Existing reservations exceed the new admission budget."})
            if self.provider_rpm and (reserved["r"] or 0) > self.admission_rpm:
                raise ValidationError({"provider_rpm": "Existing reservations' RPM exceed the new admission budget."})


class Reservation(models.Model):
    """A workload's slice of one pool. ``reserved_tpm`` is guaranteed (minus
    the lent part), ``ceiling_tpm`` is the most it may reach by borrowing idle
    capacity, ``lend_fraction`` of its idle reservation others may borrow.

    A workload holds at most one slice per pool and may hold slices on
    several pools: its route (docs/architecture.md, "Routing across pools").
    ``rank`` orders the route: the lowest rank is the primary; slices of
    equal rank share the traffic by headroom (replicas); a higher rank is
    overflow, tried only when every lower one refuses."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="slices")
    pool = models.ForeignKey(InferencePool, on_delete=models.PROTECT, related_name="reservations")
    rank = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)],
        help_text="Route order: the lowest is the primary, equal ranks share by headroom, higher ranks are overflow.")
    reserved_tpm = models.PositiveIntegerField()
    ceiling_tpm = models.PositiveIntegerField()
    lend_fraction = models.FloatField(default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    rpm = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    max_concurrency = models.PositiveIntegerField(
        default=0, help_text="In-flight requests this workload may hold (0 = only the pool's limit)."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["workload", "rank", "id"]
        constraints = [models.UniqueConstraint(fields=["workload", "pool"], name="uniq_slice_per_pool",
                                               violation_error_message="This workload already holds a slice of this pool.")]

    def __str__(self) -> str:
        return f"{self.workload} on {self.pool}: {self.reserved_tpm}/{self.ceiling_tpm} TPM"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.ceiling_tpm is not None and self.reserved_tpm is not None and self.ceiling_tpm < self.reserved_tpm:
            errors["ceiling_tpm"] = "The ceiling must be at least the reserved rate."
        if self.pool_id:
            pool = self.pool
            others = Reservation.objects.filter(pool=pool).exclude(pk=self.pk)
            sums = others.aggregate(t=Sum("reserved_tpm"), r=Sum("rpm"))
            if (sums["t"] or 0) + (self.reserved_tpm or 0) > pool.admission_tpm + 1e-9:
                errors["reserved_tpm"] = (
                    f"Reservations on {pool} would sum to {(sums['t'] or 0) + (self.reserved_tpm or 0)} TPM, "
                    f"above its admission budget of {pool.admission_tpm:.0f} TPM."
                )
            if (sums["r"] or 0) + (self.rpm or 0) > pool.admission_rpm + 1e-9:
                errors["rpm"] = (
                    f"Reservations on {pool} would sum to {(sums['r'] or 0) + (self.rpm or 0)} RPM, "
                    f"above its admission budget of {pool.admission_rpm:.0f} RPM."
                )
            largest = self.workload.prompt_tokens_cap + self.workload.max_tokens_cap if self.workload_id else 0
            ceiling_burst = (self.ceiling_tpm or 0) * pool.burst_seconds / 60.0
            if largest > ceiling_burst:
                errors["ceiling_tpm"] = (
                    f"The workload's largest request ({largest} tokens: prompt cap + max_tokens cap) does not fit "
                    f"the ceiling's burst capacity ({ceiling_burst:.0f} tokens = ceiling x {pool.burst_seconds:g}s); "
                    "raise the ceiling or lower the workload's caps."
                )
            served = set(pool.served_models or ())
            wanted = set(self.workload.allowed_models or ()) if self.workload_id else set()
            if not served:
                errors["pool"] = f"{pool} serves no model; a slice of it could never be used."
            elif wanted and not served & wanted:
                errors["pool"] = (f"{pool} serves {', '.join(sorted(served))}, none of the models this workload may "
                                  f"call ({', '.join(sorted(wanted))}).")
            if not pool.is_active and "pool" not in errors:
                errors["pool"] = f"{pool} is not active."
            if self.ceiling_tpm and self.ceiling_tpm > pool.admission_tpm + 1e-9:
                errors["ceiling_tpm"] = f"The ceiling cannot exceed the pool's admission budget ({pool.admission_tpm:.0f} TPM)."
        if errors:
            raise ValidationError(errors)


class ModelPrice(models.Model):
    """Price of a model per million tokens, from ``effective_from`` on; on one
    pool (an overflow provider costs more than the reserved pool), or, without
    a pool, on every pool that has no price of its own for the model."""

    model = models.CharField(max_length=200)
    pool = models.ForeignKey(InferencePool, null=True, blank=True, on_delete=models.PROTECT, related_name="prices",
                             help_text="Blank: the model's price on every pool without one of its own.")
    input_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    output_per_million = models.DecimalField(max_digits=12, decimal_places=6)
    currency = models.CharField(max_length=3, default="USD")
    effective_from = models.DateTimeField()

    class Meta:
        ordering = ["model", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_from"], condition=models.Q(pool__isnull=True),
                                    name="uniq_price_version"),
            models.UniqueConstraint(fields=["model", "pool", "effective_from"], condition=models.Q(pool__isnull=False),
                                    name="uniq_pool_price_version"),
        ]

    def __str__(self) -> str:
        on = f" on {self.pool.slug}" if self.pool_id else ""
        return f"{self.model}{on} from {self.effective_from:%Y-%m-%d}"

    def cost(self, *, input_tokens: int, output_tokens: int) -> Decimal:
        million = Decimal(1_000_000)
        return (Decimal(input_tokens) * self.input_per_million + Decimal(output_tokens) * self.output_per_million) / million


class LedgerImmutable(Exception):
    pass


class UsageRecordQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise LedgerImmutable("The ledger is append-only: rows cannot be updated.")

    def delete(self):
        raise LedgerImmutable("The ledger is append-only: rows cannot be deleted.")


class UsageRecord(models.Model):
    """One append-only ledger row per request (docs/architecture.md, "Ledger")."""

    class Status(models.TextChoices):
        OK = "ok", "Completed"
        QUEUE_TIMEOUT = "queue_timeout", "Queue timeout"
        UPSTREAM_ERROR = "upstream_error", "Upstream error"
        LEASE_EXPIRED = "lease_expired", "Lease expired"
        # The pool refused the request as malformed (its 400/404/413/422): the
        # caller's error, relayed to it, not a pool failure.
        INVALID_REQUEST = "invalid_request", "Invalid request (refused by the pool)"
        # The worker failed on this request for a reason of its own (not
        # Redis or the database away): settled and answered at once.
        WORKER_ERROR = "worker_error", "Gateway error"
        # Its worker was lost mid-call and no other could take it over in
        # time: the pool may have run it, so it is charged on its estimate.
        WORKER_LOST = "worker_lost", "Worker lost"
        # A stream whose caller went away: the pool call was closed and it is
        # charged the tokens produced until then.
        CANCELLED = "cancelled", "Cancelled by the caller"

    class UsageSource(models.TextChoices):
        POOL = "pool", "Reported by the pool"
        # A stream cut short without the pool's usage: its text counted with
        # the pool's tokenizer.
        COUNTED = "counted", "Counted by the gateway"
        # The pool may have run it and nobody knows how far: the estimate.
        ESTIMATE = "estimate", "Estimate"
        NONE = "", "Nothing charged"

    request_id = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(db_index=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    workload = models.ForeignKey(Workload, on_delete=models.PROTECT, related_name="usage_records")
    pool = models.ForeignKey(InferencePool, on_delete=models.PROTECT, related_name="usage_records")
    model = models.CharField(max_length=200)
    lane = models.CharField(max_length=32)
    status = models.CharField(max_length=32, choices=Status.choices)
    borrowed = models.BooleanField(default=False)
    # Served by an overflow slice (a rank above its route's primary): it
    # spilled over because the lower ones refused, or failed over to it.
    overflow = models.BooleanField(default=False)
    # Moved to this pool after its call failed on another before any token.
    failed_over = models.BooleanField(default=False)
    estimated_input_tokens = models.PositiveIntegerField()
    estimated_output_tokens = models.PositiveIntegerField()
    actual_input_tokens = models.PositiveIntegerField(default=0)
    actual_output_tokens = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=18, decimal_places=8, default=Decimal("0"))
    price = models.ForeignKey(ModelPrice, null=True, blank=True, on_delete=models.PROTECT)
    queue_wait_ms = models.PositiveIntegerField(default=0)
    upstream_ms = models.PositiveIntegerField(default=0)
    # Streams only: ms from admission to the pool's first chunk (time to first token).
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(default=0)
    attempts = models.PositiveSmallIntegerField(default=0)
    error = models.CharField(max_length=500, blank=True)
    # The key that made the request (None: a cron firing, a row from before
    # keys were recorded). PROTECT: keys are revoked, never deleted, once used.
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.PROTECT, related_name="usage_records",
                                db_index=False)  # ledger_key_at_id leads with it
    usage_source = models.CharField(max_length=16, choices=UsageSource.choices, blank=True, default="")
    # The pool's own id for the answer (``chatcmpl-...``, what the SDK
    # returns), so a caller's report finds the row; "" when none came back.
    completion_id = models.CharField(max_length=128, blank=True, default="")
    # The /v1 endpoint the request came through (every row before this
    # column existed was a chat completion).
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    # Each endpoint and the short name pages show it by.
    ENDPOINT_LABELS = {CHAT_COMPLETIONS: "chat/completions", COMPLETIONS: "completions", EMBEDDINGS: "embeddings"}
    endpoint = models.CharField(max_length=64, default=CHAT_COMPLETIONS)

    objects = UsageRecordQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        # The request log pages newest first by (created_at, id) within a
        # scope (budgets/selectors/request_log.py): each scope it filters on
        # has an index ending in (created_at, id), so a page of 10 M rows is
        # an index range scan, however deep the cursor.
        indexes = [
            models.Index(fields=["tenant", "created_at", "id"], name="ledger_tenant_at_id"),
            models.Index(fields=["workload", "created_at", "id"], name="ledger_workload_at_id"),
            models.Index(fields=["api_key", "created_at", "id"], name="ledger_key_at_id"),
            models.Index(fields=["tenant", "status", "created_at", "id"], name="ledger_tenant_status_at_id"),
            models.Index(fields=["pool", "created_at", "id"], name="ledger_pool_at_id"),
            models.Index(fields=["created_at", "id"], name="ledger_at_id"),
            models.Index(fields=["completion_id"], condition=~models.Q(completion_id=""), name="ledger_completion_id"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise LedgerImmutable("The ledger is append-only: rows cannot be updated.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise LedgerImmutable("The ledger is append-only: rows cannot be deleted.")



class ReservationVersion(models.Model):
    """A reservation as it was from ``valid_from`` on, written by the
    reservation services on every save and delete (``deleted``: none from
    then on), so charts draw the reserved and ceiling lines as they were at
    each time rather than today's numbers across the whole range."""

    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="reservation_versions")
    pool = models.ForeignKey(InferencePool, on_delete=models.CASCADE, related_name="+")
    reserved_tpm = models.PositiveIntegerField()
    ceiling_tpm = models.PositiveIntegerField()
    rpm = models.PositiveIntegerField()
    lend_fraction = models.FloatField(default=0.0)
    deleted = models.BooleanField(default=False)
    valid_from = models.DateTimeField()

    class Meta:
        ordering = ["workload", "valid_from", "id"]
        indexes = [models.Index(fields=["workload", "valid_from"], name="reservation_version_wl_from")]

    def __str__(self) -> str:
        return f"{self.workload_id} from {self.valid_from:%Y-%m-%d %H:%M}: {self.reserved_tpm}/{self.ceiling_tpm} TPM"
