"""Spend reconciliation beside the daily rollup, concurrently: a reconcile
reads the month's final days from DailyUsage and the days after them from the
ledger (budgets/ledger/spend.py ``_month_costs``). That is exact because the
rollup commits a day's rebuild before it moves ``final_through`` past it
(budgets/ledger/rollups.py). While the rollup runs from nothing and turns
days final, over and over, every reconcile must write the ledger's month
exactly. (With the rollup's order reversed, final_through first, most of
them do not.)"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection

from budgets.ledger.rollups import daily_usage_refresh
from budgets.ledger.spend import spend_month_key, spend_tenants_sync, to_micro
from budgets.models import DailyUsage, RollupState, UsageRecord
from tests.people import build_world, ledger_add

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 11, 16, 12, 0, tzinfo=dt_timezone.utc)
RECONCILES = 60


def _expected(world) -> dict[str, dict[str, str]]:
    month = UsageRecord.objects.filter(created_at__gte=NOW.replace(day=1, hour=0),
                                       created_at__lt=NOW.replace(month=12, day=1, hour=0))
    out = {}
    for tenant, workload in ((world.tenant_a, world.wl_a), (world.tenant_b, world.wl_b)):
        cost = to_micro(sum(month.filter(workload=workload).values_list("cost", flat=True)))
        fields = {f"T{tenant.id}": str(cost), str(workload.id): str(cost)}
        overflow = list(month.filter(workload=workload, overflow=True).values_list("cost", flat=True))
        if overflow:
            fields[f"O{workload.id}"] = str(to_micro(sum(overflow)))
        out[spend_month_key(tenant_id=tenant.id, at=NOW)] = fields
    return out


def test_every_reconcile_beside_a_rollup_turning_days_final_writes_the_months_ledger(redis_client):
    # given a month of ledger (and the end of the month before), overflow rows among it
    world = build_world()
    for back in range(20):
        at = NOW - timedelta(days=back, hours=13)
        ledger_add(workload=world.wl_a, pool=world.pool, at=at, input_tokens=1_000 * (back + 1), output_tokens=0)
        ledger_add(workload=world.wl_b, pool=world.pool, at=at, model="sim-large", input_tokens=0,
                   output_tokens=10 * (back + 1))
        if back % 3 == 0:
            ledger_add(workload=world.wl_a, pool=world.pool, at=at, input_tokens=500, output_tokens=0, overflow=True)
    expected = _expected(world)
    stop = threading.Event()
    failures: list[str] = []
    moves = [0]

    def rollup() -> None:
        # the rollup, over and over: from nothing (every day rebuilt, then
        # final_through set), then days turning final one after another
        try:
            while not stop.is_set():
                RollupState.objects.all().delete()
                DailyUsage.objects.all().delete()
                for hours in range(0, 6 * 24, 36):
                    daily_usage_refresh(now=NOW - timedelta(days=5) + timedelta(hours=hours))
                    moves[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"rollup: {exc!r}")
        finally:
            connection.close()

    def reconcile() -> None:
        try:
            for n in range(RECONCILES):
                spend_tenants_sync(at=NOW)
                got = {key: redis_client.hgetall(key) for key in expected}
                if got != expected:
                    failures.append(f"reconcile {n}: {got} != {expected}")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"reconcile: {exc!r}")
        finally:
            connection.close()

    # when reconciles run beside it, in two threads
    roller = threading.Thread(target=rollup)
    readers = [threading.Thread(target=reconcile) for _ in range(2)]
    roller.start()
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=120)
    stop.set()
    roller.join(timeout=60)
    # then every one of them wrote the ledger's month, while final_through moved many times
    assert not any(t.is_alive() for t in (roller, *readers))
    assert failures == []
    assert moves[0] >= 12
