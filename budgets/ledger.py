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


def usage_record_write(*, entry: LedgerEntry) -> bool:
    """Insert the row unless one with the same request id exists. Returns
    whether this call wrote it."""
    price = price_in_force(model=entry.model, at=entry.created_at)
    cost = (
        price.cost(input_tokens=entry.actual_input_tokens, output_tokens=entry.actual_output_tokens)
        if price is not None
        else Decimal("0")
    )
    fields = dict(entry.__dict__)
    request_id = fields.pop("request_id")
    fields["error"] = fields["error"][:500]
    # get_or_create inserts inside a savepoint and, on a unique-key race,
    # re-reads: exactly one row per request id, however many writers.
    _, created = UsageRecord.objects.get_or_create(request_id=request_id, defaults={"price": price, "cost": cost, **fields})
    return created
