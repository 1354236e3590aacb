"""Routing across pools as the pages, finance and approvals see it: the pool
that served each request, whether it spilled or failed over, overflow spend
apart (live ledger and daily rollups alike), each model's share of a pool's
traffic, and a budget request on a second pool adding a slice behind the
workload's primary instead of moving it."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from budgets.ledger.rollups import daily_usage_rebuild_day
from budgets.ledger.writer import LedgerEntry, usage_record_write
from budgets.models import DailyUsage, InferencePool, ModelPrice, Reservation, UsageRecord
from budgets.selectors.pools import model_shares_of_pool
from budgets.selectors.request_log import ledger_entry_of
from budgets.selectors.usage import UsageFilters, usage_summary
from budgets.services.budget_requests import budget_request_approve, budget_request_submit
from budgets.services.reservations import reservation_save

pytestmark = pytest.mark.django_db

AT = datetime(2026, 11, 10, 10, 0, tzinfo=timezone.utc)


@pytest.fixture
def overflow(world) -> InferencePool:
    pool = InferencePool(name="Overflow", slug=f"overflow-{uuid.uuid4().hex[:6]}", base_url="http://127.0.0.1:9/v1",
                         served_models=["sim-small"], provider_tpm=100_000, provider_rpm=1_000)
    pool.full_clean()
    pool.save()
    reservation_save(reservation=Reservation(workload=world.wl_a, pool=pool, rank=1, reserved_tpm=10_000,
                                             ceiling_tpm=40_000, rpm=100))
    effective = datetime(2026, 1, 1, tzinfo=timezone.utc)
    ModelPrice.objects.create(model="sim-small", input_per_million=Decimal("1"), output_per_million=Decimal("2"),
                              effective_from=effective)
    ModelPrice.objects.create(model="sim-small", pool=pool, input_per_million=Decimal("10"),
                              output_per_million=Decimal("20"), effective_from=effective)
    return pool


def row(world, pool, *, overflow=False, failed_over=False, minutes=0, model="sim-small") -> str:
    request_id = "req_" + uuid.uuid4().hex
    usage_record_write(entry=LedgerEntry(
        request_id=request_id, created_at=AT + timedelta(minutes=minutes), tenant_id=world.tenant_a.id,
        workload_id=world.wl_a.id, pool_id=pool.id, model=model, lane="interactive", status="ok", borrowed=False,
        overflow=overflow, failed_over=failed_over, estimated_input_tokens=100, estimated_output_tokens=100,
        actual_input_tokens=100, actual_output_tokens=50))
    return request_id


def test_each_row_is_priced_at_its_pool_and_overflow_spend_is_apart_live_and_rolled_up(world, overflow):
    # given two rows on the primary and two on the overflow (one spilled, one failed over)
    row(world, world.pool)
    row(world, world.pool, minutes=1)
    row(world, overflow, overflow=True, minutes=2)
    row(world, overflow, overflow=True, failed_over=True, minutes=3)
    primary_cost = (100 * Decimal(1) + 50 * Decimal(2)) / 1_000_000
    overflow_cost = (100 * Decimal(10) + 50 * Decimal(20)) / 1_000_000
    assert sorted(UsageRecord.objects.values_list("cost", flat=True)) == [primary_cost] * 2 + [overflow_cost] * 2
    filters = UsageFilters(start=AT.date(), end=AT.date(), start_at=AT, end_at=AT + timedelta(hours=1))
    # when finance sums them by pool from the ledger
    live = usage_summary(filters=filters, group_by=("pool",))
    by_pool = {r.key["pool"]: r for r in live.rows}
    assert (by_pool[world.pool.id].cost, by_pool[world.pool.id].overflow_cost) == (2 * primary_cost, Decimal(0))
    assert (by_pool[overflow.id].overflow_cost, by_pool[overflow.id].overflow_requests) == (2 * overflow_cost, 2)
    assert live.total.overflow_cost == 2 * overflow_cost
    # then the daily rollup keeps the same split
    daily_usage_rebuild_day(day=AT.date())
    rolled = DailyUsage.objects.get(day=AT.date(), pool=overflow)
    assert (rolled.overflow_requests, rolled.overflow_cost, rolled.cost) == (2, 2 * overflow_cost, 2 * overflow_cost)
    assert DailyUsage.objects.get(day=AT.date(), pool=world.pool).overflow_cost == 0


def test_the_request_log_names_the_pool_and_how_the_request_got_there(world, overflow):
    ids = [row(world, world.pool), row(world, overflow, overflow=True), row(world, overflow, overflow=True,
                                                                             failed_over=True)]
    entries = [ledger_entry_of(UsageRecord.objects.select_related("pool", "workload", "price", "api_key")
                               .get(request_id=i)) for i in ids]
    assert [(e.pool_slug, e.route) for e in entries] == [
        (world.pool.slug, ""), (overflow.slug, "spilled over"), (overflow.slug, "failed over")]


def test_the_pool_page_shows_each_models_share_and_the_csv_marks_overflow(world, overflow, login):
    for minutes in range(3):
        row(world, world.pool, minutes=minutes)
    row(world, overflow, overflow=True, minutes=4)
    shares = {s.model: s for s in model_shares_of_pool(pool=overflow, since=AT)}
    assert (shares["sim-small"].pool_tokens, shares["sim-small"].all_tokens) == (150, 600)
    assert shares["sim-small"].share == 0.25
    # the finance export carries the routing columns last
    client = login(world.finance)
    body = b"".join(client.get("/finance/ledger.csv?start=2026-11-10T10:00&end=2026-11-10T11:00").streaming_content)
    rows = list(csv.DictReader(io.StringIO(body.decode())))
    assert sorted((r["pool"], r["overflow"], r["failed_over"]) for r in rows) == sorted(
        [(world.pool.slug, "false", "false")] * 3 + [(overflow.slug, "true", "false")])
    page = client.get("/finance/?start=2026-11-10T10:00&end=2026-11-10T11:00&group_by=pool").content.decode()
    assert 'id="total-overflow-cost"' in page and "Overflow spend" in page


def test_a_request_on_another_pool_adds_a_slice_behind_the_primary(world, overflow):
    third = InferencePool(name="Third", slug=f"third-{uuid.uuid4().hex[:6]}", base_url="http://127.0.0.1:9/v1",
                          served_models=["sim-small"], provider_tpm=100_000, provider_rpm=1_000)
    third.full_clean()
    third.save()
    request = budget_request_submit(tenant=world.tenant_b, user=world.member_b, pool=third, reserved_tpm=20_000,
                                    ceiling_tpm=40_000, rpm=50, justification="a second pool", workload=world.wl_b)
    budget_request_approve(request_id=request.id, approver=world.admin)
    slices = list(Reservation.objects.filter(workload=world.wl_b).order_by("rank").values_list("pool_id", "rank"))
    assert slices == [(world.pool.id, 0), (third.id, 1)]
    # and a second request on the same pool changes that slice, not adds one
    again = budget_request_submit(tenant=world.tenant_b, user=world.member_b, pool=third, reserved_tpm=30_000,
                                  ceiling_tpm=40_000, rpm=50, justification="more", workload=world.wl_b)
    budget_request_approve(request_id=again.id, approver=world.admin)
    assert Reservation.objects.get(workload=world.wl_b, pool=third).reserved_tpm == 30_000
    assert Reservation.objects.filter(workload=world.wl_b).count() == 2


def test_a_request_for_a_pool_that_serves_none_of_the_workloads_models_is_refused_at_the_form(world):
    from django.core.exceptions import ValidationError

    other = InferencePool(name="Large only", slug=f"large-{uuid.uuid4().hex[:6]}", base_url="http://127.0.0.1:9/v1",
                          served_models=["sim-large"], provider_tpm=100_000, provider_rpm=1_000)
    other.full_clean()
    other.save()
    world.wl_b.allowed_models = ["sim-small"]
    world.wl_b.save()
    with pytest.raises(ValidationError) as refused:
        budget_request_submit(tenant=world.tenant_b, user=world.member_b, pool=other, reserved_tpm=1_000,
                              ceiling_tpm=40_000, rpm=10, justification="wrong pool", workload=world.wl_b)
    assert "serves none of the models this workload may call (sim-small)" in str(refused.value.message_dict["pool"])
    assert not world.wl_b.slices.filter(pool=other).exists()
