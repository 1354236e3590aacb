"""Spend budgets: the Redis contract with admission (keys, caps in
micro-units), month-to-date reads with the ledger as fallback,
reconciliation from the ledger, projections and threshold notifications."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest

from budgets.ledger.rollups import daily_usage_refresh, rollup_final_through
from budgets.models import DailyUsage, InferencePool, Notification, SpendBudget, UsageRecord
from budgets.ledger.spend import (
    from_micro,
    spend_caps_of_tenants,
    spend_month,
    spend_month_key,
    spend_month_to_date,
    spend_projected_month_end,
    spend_reconcile,
    spend_threshold_crossed,
    to_micro,
)
from tests.people import build_world, ledger_add, world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 16, 0, 0, tzinfo=dt_timezone.utc)  # half-way through a 30-day month


def test_the_spend_month_is_right_on_each_side_of_a_boundary_in_any_order():
    def ms(*args) -> float:
        return datetime(*args, tzinfo=dt_timezone.utc).timestamp() * 1000

    feb_end, mar_end = ms(2028, 3, 1), ms(2028, 4, 1)  # 2028: a leap year
    asked = [
        (ms(2028, 2, 29, 23, 59, 59, 999_000), ("2028-02", feb_end)),
        (feb_end, ("2028-03", mar_end)),  # a month's first ms is its own
        (feb_end - 0.5, ("2028-02", feb_end)),  # back across the boundary
        (ms(2028, 2, 1), ("2028-02", feb_end)),
        (ms(2028, 2, 1) - 1, ("2028-01", ms(2028, 2, 1))),
        (ms(2028, 3, 15), ("2028-03", mar_end)),
        (ms(2028, 3, 15), ("2028-03", mar_end)),  # asked twice, the same answer
    ]
    assert [spend_month(at_ms=at) for at, _ in asked] == [answer for _, answer in asked]


def test_month_key_follows_the_contract():
    at = datetime(2026, 3, 5, 23, 59, tzinfo=dt_timezone.utc)
    # the tenant's own hash tag: its spend spans pools, and no script touches both
    assert spend_month_key(tenant_id=7, at=at) == "sluice:{tenant:7}:spend:2026-03"
    # a local time is read as the UTC month it falls in
    later = datetime(2026, 4, 1, 1, 0, tzinfo=dt_timezone(timedelta(hours=2)))
    assert spend_month_key(tenant_id=7, at=later) == "sluice:{tenant:7}:spend:2026-03"


def test_micro_units_round_half_up_and_back():
    assert to_micro(Decimal("1.25")) == 1_250_000
    assert to_micro(Decimal("0.0000005")) == 1
    assert to_micro(Decimal("0.00000049")) == 0
    assert from_micro(1_250_000) == Decimal("1.25")
    assert from_micro("42") == Decimal("0.000042")


def test_caps_of_tenants_are_their_hard_caps_and_their_workloads(world):
    other = build_world()
    SpendBudget.objects.create(tenant=world.tenant_a, monthly_amount=Decimal("100"), hard_cap=True)
    SpendBudget.objects.create(workload=world.wl_b, monthly_amount=Decimal("12.345678"), hard_cap=True)
    SpendBudget.objects.create(tenant=world.tenant_b, monthly_amount=Decimal("5"), hard_cap=False)  # soft only
    SpendBudget.objects.create(tenant=other.tenant_a, monthly_amount=Decimal("9"), hard_cap=True)  # not asked for
    assert spend_caps_of_tenants(tenant_ids=[world.tenant_a.id, world.tenant_b.id]) == {
        world.tenant_a.id: {f"T{world.tenant_a.id}": 100_000_000},
        world.tenant_b.id: {str(world.wl_b.id): 12_345_678},
    }


def test_month_to_date_reads_the_tenants_hash(world, redis_client):
    redis_client.hset(spend_month_key(tenant_id=world.tenant_a.id, at=NOW),
                      mapping={f"T{world.tenant_a.id}": 1_750_000, str(world.wl_a.id): 1_000_000})
    redis_client.hset(spend_month_key(tenant_id=world.tenant_b.id, at=NOW), mapping={str(world.wl_b.id): 250_000})
    assert spend_month_to_date(tenant=world.tenant_a, at=NOW) == Decimal("1.75")
    assert spend_month_to_date(workload=world.wl_a, at=NOW) == Decimal("1")
    assert spend_month_to_date(workload=world.wl_b, at=NOW) == Decimal("0.25")
    # a field Redis lacks is read from the ledger (nothing here)
    assert spend_month_to_date(tenant=world.tenant_b, at=NOW) == Decimal("0")


def test_month_to_date_falls_back_to_the_ledger(world):
    # given ledger rows this month and one last month, and nothing in Redis
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(days=2), input_tokens=1_000_000, output_tokens=0)
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW.replace(day=1, hour=0) - timedelta(seconds=1),
               input_tokens=1_000_000, output_tokens=0)
    # then month-to-date is this month's ledger cost (1M input tokens of sim-small = 0.15)
    assert spend_month_to_date(tenant=world.tenant_a, at=NOW) == Decimal("0.15")
    assert spend_month_to_date(workload=world.wl_a, at=NOW) == Decimal("0.15")
    assert spend_month_to_date(tenant=world.tenant_b, at=NOW) == Decimal("0")


def test_projection_is_linear_over_the_month():
    assert spend_projected_month_end(month_to_date=Decimal("10"), at=NOW) == Decimal("20.000000")
    # the first hour counts as a full hour
    start = NOW.replace(day=1, hour=0)
    assert spend_projected_month_end(month_to_date=Decimal("1"), at=start + timedelta(minutes=1)) == Decimal("720.000000")


def test_reconcile_overwrites_redis_from_the_ledger(world, redis_client):
    # given Redis drifted from the ledger, and a second pool the tenant also spends on
    key_a = spend_month_key(tenant_id=world.tenant_a.id, at=NOW)
    key_b = spend_month_key(tenant_id=world.tenant_b.id, at=NOW)
    redis_client.hset(key_a, mapping={f"T{world.tenant_a.id}": 999_999_999, str(world.wl_a.id): 1, "12345": 7})
    second = InferencePool.objects.create(name="second", slug=f"second-{world.pool.slug}", base_url="http://x/v1",
                                          provider_tpm=1000, provider_rpm=10)
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(hours=1), input_tokens=2_000_000, output_tokens=0)
    ledger_add(workload=world.wl_a, pool=second, at=NOW - timedelta(hours=2), input_tokens=1_000_000, output_tokens=0)
    ledger_add(workload=world.wl_b, pool=world.pool, at=NOW - timedelta(hours=1), model="sim-large",
               input_tokens=0, output_tokens=1_000_000)
    # when reconciliation runs
    result = spend_reconcile(at=NOW)
    # then each tenant's hash holds the ledger's sums over every pool, in micro-units
    assert redis_client.hgetall(key_a) == {f"T{world.tenant_a.id}": "450000", str(world.wl_a.id): "450000"}
    assert redis_client.hgetall(key_b) == {f"T{world.tenant_b.id}": "10000000", str(world.wl_b.id): "10000000"}
    assert (result.tenants, result.fields, result.holds_counted, result.holds_dropped) == (2, 4, 0, 0)
    ledger_total = sum(UsageRecord.objects.values_list("cost", flat=True))
    assert spend_month_to_date(tenant=world.tenant_a, at=NOW) + spend_month_to_date(tenant=world.tenant_b, at=NOW) == ledger_total


def test_reconcile_reads_the_months_final_days_from_the_rollup_and_the_rest_from_the_ledger(world, redis_client):
    # given a month of ledger for two tenants, overflow rows among them, and
    # rows of the month before
    days_ago = [30, 14, 9, 3, 1, 0]
    for n, back in enumerate(days_ago):
        at = NOW - timedelta(days=back, hours=1)
        ledger_add(workload=world.wl_a, pool=world.pool, at=at, input_tokens=100_000 * (n + 1), output_tokens=0)
        ledger_add(workload=world.wl_a, pool=world.pool, at=at, input_tokens=10_000, output_tokens=0, overflow=True)
        ledger_add(workload=world.wl_b, pool=world.pool, at=at, model="sim-large", input_tokens=0,
                   output_tokens=1_000 * (n + 1))

    def month_rows(**filters):
        return UsageRecord.objects.filter(created_at__gte=NOW.replace(day=1), created_at__lt=NOW.replace(month=12, day=1),
                                          **filters)

    def expected() -> dict[str, dict[str, str]]:
        out = {}
        for tenant, workload in ((world.tenant_a, world.wl_a), (world.tenant_b, world.wl_b)):
            cost = sum(month_rows(workload=workload).values_list("cost", flat=True))
            fields = {f"T{tenant.id}": str(to_micro(cost)), str(workload.id): str(to_micro(cost))}
            overflow = month_rows(workload=workload, overflow=True).values_list("cost", flat=True)
            if overflow:
                fields[f"O{workload.id}"] = str(to_micro(sum(overflow)))
            out[spend_month_key(tenant_id=tenant.id, at=NOW)] = fields
        return out

    def reconciled() -> dict[str, dict[str, str]]:
        spend_reconcile(at=NOW)
        return {key: redis_client.hgetall(key) for key in expected()}

    # then month-to-date is the ledger's month, rolled up or not
    assert reconciled() == expected()
    daily_usage_refresh(now=NOW)  # final through 14 November: the 15th and 16th are live
    assert rollup_final_through() == date(2026, 11, 14)
    assert reconciled() == expected()
    # and the final days are read from the rollup, not from the ledger: a
    # rollup row changed by hand (no ledger row is) moves month-to-date
    row = DailyUsage.objects.filter(day=date(2026, 11, 6), workload=world.wl_b).get()
    DailyUsage.objects.filter(pk=row.pk).update(cost=row.cost + Decimal("1"))
    key_b = spend_month_key(tenant_id=world.tenant_b.id, at=NOW)
    assert int(reconciled()[key_b][str(world.wl_b.id)]) == int(expected()[key_b][str(world.wl_b.id)]) + 1_000_000
    # while the days after the final one are the ledger's own: a live day's
    # rollup row changed by hand moves nothing
    DailyUsage.objects.filter(pk=row.pk).update(cost=row.cost)
    DailyUsage.objects.filter(day=date(2026, 11, 15), workload=world.wl_b).update(cost=Decimal("1000"))
    assert reconciled() == expected()


def test_soft_threshold_notifies_once_per_month_and_fires_the_hook(world):
    # given a tenant budget of 1.00 with a soft threshold at 50%
    SpendBudget.objects.create(tenant=world.tenant_b, monthly_amount=Decimal("1.00"), soft_threshold=0.5)
    received = []
    spend_threshold_crossed.connect(lambda sender, **kw: received.append(kw), weak=False, dispatch_uid="t-soft")
    try:
        ledger_add(workload=world.wl_b, pool=world.pool, at=NOW - timedelta(hours=1), model="sim-large",
                   input_tokens=0, output_tokens=40_000)  # 0.40: under
        spend_reconcile(at=NOW)
        assert Notification.objects.count() == 0
        ledger_add(workload=world.wl_b, pool=world.pool, at=NOW - timedelta(hours=1), model="sim-large",
                   input_tokens=0, output_tokens=20_000)  # 0.60: past 50%
        spend_reconcile(at=NOW)
        spend_reconcile(at=NOW)
    finally:
        spend_threshold_crossed.disconnect(dispatch_uid="t-soft")
    note = Notification.objects.get()
    assert note.kind == "spend_soft_threshold" and note.tenant_id == world.tenant_b.id
    assert "0.60 of 1.00 USD" in note.message
    assert len(received) == 1 and received[0]["month_to_date"] == Decimal("0.6")


def test_spent_budget_notifies_the_hard_cap(world):
    SpendBudget.objects.create(workload=world.wl_a, monthly_amount=Decimal("0.10"), hard_cap=True)
    ledger_add(workload=world.wl_a, pool=world.pool, at=NOW - timedelta(hours=1), input_tokens=1_000_000, output_tokens=0)
    spend_reconcile(at=NOW)
    note = Notification.objects.get()
    assert note.kind == "spend_hard_cap" and note.workload_id == world.wl_a.id
    assert "new requests are refused" in note.message


def test_a_budget_has_exactly_one_scope(world):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        SpendBudget.objects.create(tenant=world.tenant_a, workload=world.wl_a, monthly_amount=Decimal("1"))
    with pytest.raises(IntegrityError), transaction.atomic():
        SpendBudget.objects.create(monthly_amount=Decimal("1"))
