"""The ledger's writer (budgets/ledger/writer.py) writes, without a model
instance, exactly the row the ORM writes for the same entry; a second write
of a request id leaves the first row; the price comes from the entry, or is
looked up when the entry has none, and a model without a price costs 0."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.forms.models import model_to_dict

from budgets.ledger.writer import LedgerEntry, usage_record_write
from budgets.models import ModelPrice, UsageRecord
from tests.people import world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

AT = datetime(2026, 11, 20, 12, 30, 15, 123456, tzinfo=dt_timezone.utc)


def _entry(world, **changes) -> LedgerEntry:
    entry = LedgerEntry(
        request_id="req_" + uuid.uuid4().hex, created_at=AT, tenant_id=world.tenant_a.id, workload_id=world.wl_a.id,
        pool_id=world.pool.id, model="sim-small", lane="interactive-long", status="ok", borrowed=True,
        estimated_input_tokens=1200, estimated_output_tokens=300, actual_input_tokens=1187, actual_output_tokens=251,
        queue_wait_ms=12, upstream_ms=3400, ttft_ms=88, total_ms=3420, attempts=2, error="x" * 600,
        api_key_id=None, usage_source="pool",
    )
    return replace(entry, **changes)


def _row(request_id: str) -> dict:
    record = UsageRecord.objects.get(request_id=request_id)
    row = model_to_dict(record, exclude=["id", "request_id"])
    row["created_at"] = record.created_at
    return row


def test_the_row_is_the_one_the_orm_writes_for_the_same_entry(world):
    price = ModelPrice.objects.create(model="sim-small", input_per_million=Decimal("0.15"),
                                      output_per_million=Decimal("0.60"), effective_from=AT.replace(day=1))
    entry = _entry(world, price=(price.pk, price.input_per_million, price.output_per_million))
    usage_record_write(entry=entry)
    # the ORM's row for the same values (another request id)
    fields = dict(entry.__dict__, request_id="req_" + uuid.uuid4().hex, error=entry.error[:500], price_id=price.pk,
                  cost=(Decimal(1187) * Decimal("0.15") + Decimal(251) * Decimal("0.60")) / Decimal(1_000_000))
    del fields["price"]
    UsageRecord.objects.create(**fields)
    ours, orms = _row(entry.request_id), _row(fields["request_id"])
    assert ours == orms
    assert ours["created_at"] == AT and ours["cost"] == Decimal("0.00032865") and len(ours["error"]) == 500
    assert (ours["tenant"], ours["price"], ours["ttft_ms"], ours["borrowed"]) == (world.tenant_a.id, price.pk, 88, True)


def test_a_second_write_of_a_request_id_leaves_the_first_row(world):
    entry = _entry(world, price=None)
    usage_record_write(entry=entry)
    usage_record_write(entry=replace(entry, actual_output_tokens=999, status="upstream_error"))
    assert UsageRecord.objects.filter(request_id=entry.request_id).count() == 1
    assert _row(entry.request_id)["actual_output_tokens"] == 251


def test_without_a_price_in_the_entry_it_is_looked_up_and_a_model_without_one_costs_nothing(world):
    ModelPrice.objects.create(model="sim-large", input_per_million=Decimal("1"), output_per_million=Decimal("2"),
                              effective_from=AT.replace(day=1))
    priced = _entry(world, model="sim-large", api_key_id=None, ttft_ms=None)
    unpriced = _entry(world, model="sim-unknown")
    usage_record_write(entry=priced)
    usage_record_write(entry=unpriced)
    assert _row(priced.request_id)["cost"] == Decimal("0.00168900") and _row(priced.request_id)["ttft_ms"] is None
    assert _row(unpriced.request_id)["cost"] == Decimal("0") and _row(unpriced.request_id)["price"] is None
