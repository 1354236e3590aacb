"""The append-only ledger: one row per request, written once, whoever (web or
worker, first delivery or redelivery) gets there first."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from .models import ModelPrice, UsageRecord


def price_in_force(*, model: str, at: datetime) -> ModelPrice | None:
    return ModelPrice.objects.filter(model=model, effective_from__lte=at).order_by("-effective_from").first()


@dataclass(frozen=True)
class LedgerEntry:
    request_id: str
    created_at: datetime
    tenant_id: int
    workload_id: int
    pool_id: int
    model: str
    lane: str
    status: str
    borrowed: bool
    estimated_input_tokens: int
    estimated_output_tokens: int
    actual_input_tokens: int = 0
    actual_output_tokens: int = 0
    queue_wait_ms: int = 0
    upstream_ms: int = 0
    total_ms: int = 0
    attempts: int = 0
    error: str = ""


def usage_record_write(*, entry: LedgerEntry) -> None:
    """Insert the row unless one with the same request id exists: one
    INSERT ... ON CONFLICT DO NOTHING, so any number of writers (web, worker,
    a redelivered task) leave exactly one row."""
    price = price_in_force(model=entry.model, at=entry.created_at)
    cost = (
        price.cost(input_tokens=entry.actual_input_tokens, output_tokens=entry.actual_output_tokens)
        if price is not None
        else Decimal("0")
    )
    fields = dict(entry.__dict__)
    fields["error"] = fields["error"][:500]
    UsageRecord.objects.bulk_create([UsageRecord(price=price, cost=cost, **fields)], ignore_conflicts=True)
