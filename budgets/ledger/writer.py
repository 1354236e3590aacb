"""The append-only ledger: one row per request, written once, whoever (web or
worker, first delivery or redelivery) gets there first."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import connections, router
from django.db.models import F, Q

from budgets.models import ModelPrice, UsageRecord

MILLION = Decimal(1_000_000)


def price_in_force(*, model: str, at: datetime, pool_id: int | None = None) -> ModelPrice | None:
    """The model's price in force at ``at`` on the pool: the pool's own
    price if it has one, else the model's price on every pool."""
    prices = ModelPrice.objects.filter(model=model, effective_from__lte=at)
    prices = prices.filter(Q(pool_id=pool_id) | Q(pool__isnull=True)) if pool_id else prices.filter(pool__isnull=True)
    return prices.order_by(F("pool").asc(nulls_last=True), "-effective_from").first()



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
    overflow: bool = False  # served by an overflow slice (UsageRecord.overflow)
    failed_over: bool = False  # moved here after a failed call on another pool
    actual_input_tokens: int = 0
    actual_output_tokens: int = 0
    queue_wait_ms: int = 0
    upstream_ms: int = 0
    ttft_ms: int | None = None  # streams: admission to the pool's first chunk
    total_ms: int = 0
    attempts: int = 0
    error: str = ""
    api_key_id: int | None = None  # the key that made the request (None: a cron firing)
    # Where the actual tokens come from (UsageRecord.UsageSource): the pool's
    # usage, counted by the gateway (a stream cut short), or the estimate.
    usage_source: str = ""
    completion_id: str = ""  # the pool's id for the answer (chatcmpl-...), "" when none came back
    # The price the gateway resolved at admission (the price in force when the
    # request arrived), so settlement needs no lookup: (id, input, output per
    # million), or None when the model had no price. Unset: look it up.
    price: tuple[int, Decimal, Decimal] | None | bool = False
    endpoint: str = UsageRecord.CHAT_COMPLETIONS  # the /v1 endpoint it came through


def usage_record_write(*, entry: LedgerEntry) -> None:
    """Insert the row unless one with the same request id exists: one
    INSERT ... ON CONFLICT DO NOTHING, so any number of writers (web, worker,
    a redelivered task) leave exactly one row."""
    row = dict(entry.__dict__)
    known = row.pop("price")
    row["error"] = row["error"][:500]
    row["completion_id"] = row["completion_id"][:128]
    if known is False:
        price = price_in_force(model=entry.model, at=entry.created_at, pool_id=entry.pool_id)
        known = (price.pk, price.input_per_million, price.output_per_million) if price is not None else None
    price_id, cost = None, Decimal("0")
    if known is not None:
        price_id, input_per_million, output_per_million = known
        cost = (Decimal(entry.actual_input_tokens) * input_per_million
                + Decimal(entry.actual_output_tokens) * output_per_million) / MILLION
    row["price_id"], row["cost"] = price_id, cost
    _insert_ignoring_conflicts(row)


# Per database alias: the INSERT's text and its fields, built once.
_inserts: dict[str, tuple[str, list]] = {}


def _insert_ignoring_conflicts(row: dict) -> None:
    """One INSERT ... ON CONFLICT DO NOTHING in autocommit: bulk_create wraps
    even one row in a transaction (BEGIN, INSERT, COMMIT: two more round
    trips per request). The values go straight from ``row`` (keyed by column
    attribute names: ``tenant_id``) through each field's own preparation for
    this database, without building a model instance; a field the row leaves out gets its
    default, as the model would give it."""
    alias = router.db_for_write(UsageRecord)
    connection = connections[alias]
    insert = _inserts.get(alias)
    if insert is None:
        fields = [f for f in UsageRecord._meta.concrete_fields if not f.primary_key]
        quote = connection.ops.quote_name
        sql = (f"INSERT INTO {quote(UsageRecord._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
               f"VALUES ({', '.join(['%s'] * len(fields))}) ON CONFLICT DO NOTHING")
        insert = _inserts[alias] = (sql, fields)
    sql, fields = insert
    values = [f.get_db_prep_save(row[f.attname] if f.attname in row else f.get_default(), connection)
              for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
