"""Async jobs (POST /v1/jobs) and the cron schedules that create them."""

from __future__ import annotations

import uuid

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from gateway.core.jobs.callbacks import CallbackRefused, callback_url_check
from gateway.core.request.chat import validate_chat_request
from tenants.models import Tenant, Workload


class Job(models.Model):
    """One asynchronous chat completion. Over budget means *delayed* (a Redis
    sorted set keyed by release time, drained by the pacer), not rejected,
    unless the wait would outlive the job's deadline."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending (a batch line waiting for its turn)"
        DELAYED = "delayed", "Delayed (waiting for budget)"
        QUEUED = "queued", "Queued on its lane"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed upstream"
        REJECTED = "rejected", "Rejected"
        EXPIRED = "expired", "Deadline passed"
        CANCELLED = "cancelled", "Cancelled with its batch"

    FINAL = {Status.SUCCEEDED, Status.FAILED, Status.REJECTED, Status.EXPIRED, Status.CANCELLED}

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="jobs")
    status = models.CharField(max_length=16, choices=Status.choices, db_index=True)
    body = models.JSONField(help_text="The validated request body (of ``endpoint``).")
    endpoint = models.CharField(max_length=32, default="/v1/chat/completions")
    body_sha256 = models.CharField(max_length=64)
    idempotency_key = models.CharField(max_length=255, blank=True)
    callback_url = models.URLField(max_length=1000, blank=True)
    session_id = models.CharField(max_length=128, blank=True)
    request_id = models.CharField(max_length=64, blank=True, db_index=True, help_text="The ledger row's request id.")
    estimated_input_tokens = models.PositiveIntegerField(default=0)
    estimated_output_tokens = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    deadline = models.DateTimeField()
    release_at = models.DateTimeField(null=True, blank=True, help_text="When the pacer planned to release it.")
    released_at = models.DateTimeField(null=True, blank=True, help_text="When it went onto its lane.")
    finished_at = models.DateTimeField(null=True, blank=True)
    delays = models.PositiveIntegerField(default=0, help_text="Times admission sent it back to wait.")
    reason = models.CharField(max_length=64, blank=True)
    result = models.JSONField(null=True, blank=True)
    callback_status = models.IntegerField(null=True, blank=True)
    schedule = models.ForeignKey("JobSchedule", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    # The key that submitted the job (its schedule's key for a cron firing),
    # carried to the ledger row when the pacer releases it later.
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Each time it was sent back to wait: {"at", "reason", "release_at"} (ISO times).
    delay_history = models.JSONField(default=list, blank=True)
    # A line of a Batch API batch (gateway/core/batches): its batch, its
    # place in the input file and its custom_id; the pool's HTTP status for
    # the output file's line.
    batch = models.ForeignKey("Batch", null=True, blank=True, on_delete=models.CASCADE, related_name="lines")
    line = models.PositiveIntegerField(null=True, blank=True)
    custom_id = models.CharField(max_length=512, blank=True)
    result_status = models.PositiveSmallIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        # GET /v1/jobs and the jobs page: a workload's jobs newest first,
        # keyset-paged on (created_at, id): one index range per page.
        indexes = [models.Index(fields=["workload", "-created_at", "-id"], name="job_workload_newest"),
                   # A batch's lines by state, in file order: the feeder's next lines and the counts.
                   models.Index(fields=["batch", "status", "line"], name="job_batch_status_line")]
        constraints = [
            models.UniqueConstraint(fields=["batch", "line"], condition=models.Q(batch__isnull=False),
                                    name="uniq_batch_line"),
            models.UniqueConstraint(fields=["batch", "custom_id"], condition=models.Q(batch__isnull=False),
                                    name="uniq_batch_custom_id"),
            models.UniqueConstraint(
                fields=["workload", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="uniq_job_idempotency_key",
            )
        ]

    def __str__(self) -> str:
        return f"job {self.id} ({self.status})"


class JobCallbackDelivery(models.Model):
    """One attempt to POST a finished job to its callback URL: the delivery
    log, shown in Django admin and in the job's API view. Append-only in
    practice: one row per (job, attempt), written after the attempt."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="callback_deliveries")
    attempt = models.PositiveSmallIntegerField()
    at = models.DateTimeField(help_text="When the attempt was made.")
    address = models.GenericIPAddressField(null=True, blank=True, help_text="The checked address it connected to.")
    status_code = models.IntegerField(null=True, blank=True, help_text="The receiver's HTTP status; empty on error.")
    error = models.CharField(max_length=500, blank=True, help_text="Why no 2xx came back (refused, timeout, ...).")
    delivered = models.BooleanField(default=False)
    duration_ms = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True, help_text="When the next attempt is due, if any.")

    class Meta:
        ordering = ["job", "attempt"]
        verbose_name = "job callback delivery"
        verbose_name_plural = "job callback deliveries"
        constraints = [models.UniqueConstraint(fields=["job", "attempt"], name="uniq_job_callback_attempt")]

    def __str__(self) -> str:
        outcome = self.status_code if self.status_code is not None else (self.error[:40] or "?")
        return f"callback of job {self.job_id}, attempt {self.attempt}: {outcome}"


class JobSchedule(models.Model):
    """A cron schedule producing jobs for a scheduled workload. Stored as a
    django-celery-beat PeriodicTask (kept in step by gateway.services), so
    beat fires it and admins edit the crontab in Django admin."""

    name = models.CharField(max_length=200, unique=True)
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="job_schedules")
    crontab = models.ForeignKey(CrontabSchedule, on_delete=models.PROTECT)
    body = models.JSONField(help_text='A chat-completions body, e.g. {"model": "sim-small", "messages": [...]}')
    jobs_per_run = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1), MaxValueValidator(10_000)])
    deadline_seconds = models.PositiveIntegerField(default=3600, validators=[MinValueValidator(1)])
    callback_url = models.URLField(max_length=1000, blank=True)
    enabled = models.BooleanField(default=True)
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="The workload key its firings are made with: their ledger rows carry it.",
    )
    periodic_task = models.OneToOneField(PeriodicTask, null=True, blank=True, editable=False, on_delete=models.SET_NULL)

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.workload_id and self.workload.workload_class != Workload.WorkloadClass.SCHEDULED:
            raise ValidationError({"workload": "Schedules produce jobs for scheduled workloads only."})
        if self.api_key_id and self.workload_id and self.api_key.workload_id != self.workload_id:
            raise ValidationError({"api_key": "The key must belong to the schedule's workload."})
        try:
            validate_chat_request(self.body if isinstance(self.body, dict) else {})
        except Exception as exc:  # Rejected carries the OpenAI-style message
            raise ValidationError({"body": getattr(exc, "message", str(exc))}) from exc
        if isinstance(self.body, dict) and self.body.get("stream"):
            # Its jobs would be refused when they fire (jobs do not stream).
            raise ValidationError({"body": "A schedule's jobs do not stream: set stream to false."})
        if self.callback_url:
            try:
                callback_url_check(url=self.callback_url)
            except CallbackRefused as refused:
                raise ValidationError({"callback_url": refused.message}) from None


def _file_id() -> str:
    return "file-" + uuid.uuid4().hex


def _batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


class BatchFile(models.Model):
    """A file of the Files API: a batch's input (``batch``), written by a
    caller, or its output and error files, written by Sluice. The content
    lives in Django's storage (a directory under the var dir for make run);
    the row is scoped to one workload: only its keys see it."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "Batch input"
        BATCH_OUTPUT = "batch_output", "Batch output"
        BATCH_ERROR = "batch_error", "Batch errors"

    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batch_files")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    lines = models.PositiveIntegerField(default=0)
    content = models.FileField(upload_to="batch_files/%Y/%m/%d", max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["workload", "-created_at"], name="batchfile_workload_newest")]

    def __str__(self) -> str:
        return f"{self.id} ({self.purpose}, {self.bytes} bytes)"


class Batch(models.Model):
    """A Batch API batch: an input file's lines run as jobs on the batch lane
    (gateway/core/batches/lifecycle.py), within its completion window."""

    class Status(models.TextChoices):
        VALIDATING = "validating", "Validating"
        FAILED = "failed", "Failed validation"
        IN_PROGRESS = "in_progress", "In progress"
        FINALIZING = "finalizing", "Finalizing"
        COMPLETED = "completed", "Completed"
        EXPIRED = "expired", "Expired"
        CANCELLING = "cancelling", "Cancelling"
        CANCELLED = "cancelled", "Cancelled"

    FINAL = {Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED}

    id = models.CharField(primary_key=True, max_length=40, default=_batch_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    workload = models.ForeignKey(Workload, on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    endpoint = models.CharField(max_length=32)
    completion_window = models.CharField(max_length=8, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING, db_index=True)
    input_file = models.ForeignKey(BatchFile, null=True, on_delete=models.SET_NULL, related_name="+")
    output_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Validation's errors, in OpenAI's shape: [{"code", "message", "param", "line"}].
    errors = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    estimated_tokens = models.PositiveBigIntegerField(default=0)
    # Whether the workload's budget lets it finish within its window, and why not.
    plan = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["workload", "-created_at", "-id"], name="batch_workload_newest")]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"
