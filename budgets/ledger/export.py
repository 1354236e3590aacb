"""The ledger as CSV, streamed: rows come off a server-side cursor in chunks
(``.iterator(chunk_size=...)``) and leave as they come, so an export of a
year neither times out nor sits in memory. Under ASGI the rows are pulled in
batches through one thread-sensitive worker (Django would otherwise read a
synchronous iterator to the end before sending a byte)."""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from django.http import StreamingHttpResponse

CHUNK_ROWS = 2000

LEDGER_COLUMNS = [
    "request_id", "created_at", "tenant", "cost_center", "workload", "pool", "model", "lane", "status", "borrowed",
    "estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens", "actual_output_tokens", "cost",
    "currency", "queue_wait_ms", "upstream_ms", "total_ms", "attempts", "error", "usage_source",
    # Routing across pools (added last: scripts that read columns by position keep working).
    "overflow", "failed_over",
    # The /v1 endpoint (chat completions, legacy completions, embeddings); last, for the same reason.
    "endpoint",
]
_FIELDS = [
    "request_id", "created_at", "tenant__slug", "tenant__cost_center", "workload__slug", "pool__slug", "model", "lane",
    "status", "borrowed", "estimated_input_tokens", "estimated_output_tokens", "actual_input_tokens",
    "actual_output_tokens", "cost", "price__currency", "queue_wait_ms", "upstream_ms", "total_ms", "attempts", "error",
    "usage_source", "overflow", "failed_over", "endpoint",
]


def ledger_csv_rows(queryset: QuerySet) -> Iterator[list]:
    for values in queryset.order_by("created_at", "id").values_list(*_FIELDS).iterator(chunk_size=CHUNK_ROWS):
        row = list(values)
        row[1] = row[1].isoformat()
        row[9] = "true" if row[9] else "false"
        row[14] = format(row[14], "f")
        row[15] = row[15] or ""
        row[22] = "true" if row[22] else "false"
        row[23] = "true" if row[23] else "false"
        yield row


class _Echo:
    def write(self, value: str) -> str:
        return value


def _csv_lines(queryset: QuerySet) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(LEDGER_COLUMNS)
    for row in ledger_csv_rows(queryset):
        yield writer.writerow(row)


def _next_batch(lines: Iterator[str], size: int) -> str:
    batch = []
    for line in lines:
        batch.append(line)
        if len(batch) >= size:
            break
    return "".join(batch)


async def _csv_lines_async(queryset: QuerySet) -> AsyncIterator[str]:
    lines = _csv_lines(queryset)
    # thread_sensitive: every batch runs on the request's one thread, so the
    # server-side cursor stays on the connection that opened it.
    next_batch = sync_to_async(_next_batch, thread_sensitive=True)
    while True:
        chunk = await next_batch(lines, CHUNK_ROWS)
        if not chunk:
            break
        yield chunk


def _under_asgi(request) -> bool:
    """Whether the request came in through ASGI. Django's ASGIRequest
    carries its ``scope``; a DRF Request hands on the attributes of the
    HttpRequest it wraps, so the API's views pass their own request."""
    return getattr(request, "scope", None) is not None


def ledger_csv_response(*, request, queryset: QuerySet, filename: str) -> StreamingHttpResponse:
    """``request``: a Django HttpRequest, or a DRF Request wrapping one."""
    content = _csv_lines_async(queryset) if _under_asgi(request) else _csv_lines(queryset)
    response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response
