"""What the web UI's batches pages read (gateway/web/batch_pages.py): a
workload's batches a page at a time, each with its lines by state and what
the ledger bills for it; one batch of a tenant with the first lines of its
error file; a file of a tenant. A page costs a few grouped queries, however
many batches or lines it shows; every lookup takes the tenant, so another
tenant's id is simply not found."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal

from django.db.models import Count, OuterRef, Subquery, Sum

from budgets.models import UsageRecord
from gateway.core.batches.lifecycle import LINE_FAILED, output_line_item, request_counts
from gateway.core.errors import bad_request
from gateway.core.paging import newest_first_page
from gateway.models import Batch, BatchFile, Job
from tenants.text_numbers import ascii_int

PAGE_DEFAULT, PAGE_MAX = 20, 100
ERROR_LINES_SHOWN = 50
# The ids Sluice gives batches and files (``batch_<hex>``, ``file-<hex>``):
# anything else is refused before it reaches a query.
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


@dataclass(frozen=True)
class BatchUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class BatchRow:
    """A batch as the pages show it: OpenAI's request counts, its lines by
    state (queued lines are on the batch lane, running or about to), and the
    ledger's tokens and cost for it."""

    batch: Batch
    counts: dict[str, int]
    usage: BatchUsage = field(default_factory=BatchUsage)

    @property
    def request_counts(self) -> dict[str, int]:
        return request_counts(self.batch, self.counts)

    @property
    def lines(self) -> dict[str, int]:
        return {"pending": self.counts.get(Job.Status.PENDING, 0), "delayed": self.counts.get(Job.Status.DELAYED, 0),
                "running": self.counts.get(Job.Status.QUEUED, 0),
                "done": sum(n for status, n in self.counts.items() if status in Job.FINAL)}

    @property
    def active(self) -> bool:
        """Whether a cancel would change anything."""
        return self.batch.status not in Batch.FINAL and self.batch.status != Batch.Status.CANCELLING


@dataclass(frozen=True)
class BatchPage:
    rows: list[BatchRow]
    has_more: bool


@dataclass(frozen=True)
class ErrorLine:
    """One line of the error file, read from its job: the HTTP status the
    pool (or Sluice's refusal) gave, if it ran; the error's code and message;
    the ledger row's request id when the line has one."""

    line: int
    custom_id: str
    status_code: int | None
    code: str
    message: str
    request_id: str
    billed: bool


def batch_page_params(*, status: str | None, after: str | None, limit: str | None) -> tuple[str, str, int]:
    """The batches page's query checked: (status, after, limit). Raises
    Rejected (the page answers 400) for anything else."""
    status = status or ""
    if status and status not in Batch.Status.values:
        raise bad_request(f"'status' must be one of {', '.join(Batch.Status.values)}.", param="status",
                          code="invalid_status")
    after = after or ""
    if after and not BATCH_ID.fullmatch(after):
        raise bad_request("'after' must be a batch id from an earlier page.", param="after", code="invalid_cursor")
    count = ascii_int(limit) if limit not in (None, "") else PAGE_DEFAULT
    if count is None or not 1 <= count <= PAGE_MAX:
        raise bad_request(f"'limit' must be an integer from 1 to {PAGE_MAX}.", param="limit", code="invalid_limit")
    return status, after, count


def batches_of_workload(*, workload_id: int, status: str = "", after: str = "", limit: int = PAGE_DEFAULT) -> BatchPage:
    """A workload's batches, newest first, keyset-paged on (created_at, id)
    like GET /v1/batches: ``after`` is the last batch of the previous page
    (one of this workload's, else a 400: never a probe of other ids)."""
    batches = Batch.objects.filter(workload_id=workload_id).select_related("workload")
    if status:
        batches = batches.filter(status=status)
    found, more = newest_first_page(batches, scope=Batch.objects.filter(workload_id=workload_id), after=after,
                                    limit=limit, noun="batches")
    return BatchPage(rows=batch_rows(found), has_more=more)


def batch_rows(batches: list[Batch]) -> list[BatchRow]:
    """Each batch with its lines by status and its ledger usage: two grouped
    queries for all of them."""
    ids = [batch.id for batch in batches]
    counts: dict[str, dict[str, int]] = {batch_id: {} for batch_id in ids}
    for batch_id, status, n in (Job.objects.filter(batch_id__in=ids).values("batch_id", "status")
                                .annotate(n=Count("id")).values_list("batch_id", "status", "n")):
        counts[batch_id][status] = n
    usage = _usage_by_batch(ids)
    return [BatchRow(batch=batch, counts=counts[batch.id], usage=usage.get(batch.id, BatchUsage()))
            for batch in batches]


def _usage_by_batch(batch_ids: list[str]) -> dict[str, BatchUsage]:
    """The ledger's tokens and cost per batch (what ``batch_usage`` sums for
    one), grouped by the batch of the line whose request each row is."""
    if not batch_ids:
        return {}
    lines = Job.objects.filter(batch_id__in=batch_ids).exclude(request_id="")
    line_batch = Subquery(lines.filter(request_id=OuterRef("request_id")).values("batch_id")[:1])
    totals = (UsageRecord.objects.filter(request_id__in=lines.values("request_id"))
              .annotate(line_batch=line_batch).values("line_batch")
              .annotate(input_tokens=Sum("actual_input_tokens"), output_tokens=Sum("actual_output_tokens"),
                        cost=Sum("cost")))
    return {row["line_batch"]: BatchUsage(input_tokens=row["input_tokens"] or 0,
                                          output_tokens=row["output_tokens"] or 0, cost=row["cost"] or Decimal(0))
            for row in totals}


def batch_of_tenant(*, tenant_id: int, batch_id: str) -> Batch | None:
    """A batch of the tenant (None for another's, or a malformed id: a 404)."""
    if not BATCH_ID.fullmatch(batch_id):
        return None
    return (Batch.objects.select_related("workload", "input_file", "output_file", "error_file")
            .filter(pk=batch_id, tenant_id=tenant_id).first())


def file_of_tenant(*, tenant_id: int, file_id: str) -> BatchFile | None:
    """A file of the tenant, any of its workloads' (None for another tenant's: a 404)."""
    return BatchFile.objects.filter(pk=file_id, tenant_id=tenant_id).first()


def batch_error_lines(batch: Batch, *, limit: int = ERROR_LINES_SHOWN) -> list[ErrorLine]:
    """The first ``limit`` lines of the batch's error file, in file order,
    from its ended lines that did not succeed (before finalization: those
    the file will hold). One query for the lines, one for their ledger rows."""
    jobs = list(Job.objects.filter(batch=batch, status__in=LINE_FAILED).order_by("line")
                .only("id", "line", "custom_id", "status", "reason", "result", "result_status", "request_id")[:limit])
    billed = set(UsageRecord.objects.filter(tenant_id=batch.tenant_id,
                                            request_id__in=[job.request_id for job in jobs if job.request_id])
                 .values_list("request_id", flat=True))
    return [_error_line(job, billed=job.request_id in billed) for job in jobs]


def _error_line(job: Job, *, billed: bool) -> ErrorLine:
    item = output_line_item(job)
    response = item["response"]
    if response is None:
        error = item["error"] or {}
    else:
        body = response["body"] if isinstance(response["body"], dict) else {}
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
    return ErrorLine(line=job.line or 0, custom_id=job.custom_id,
                     status_code=response["status_code"] if response else None,
                     code=str(error.get("code") or job.reason or ""), message=str(error.get("message") or ""),
                     request_id=job.request_id, billed=billed)
