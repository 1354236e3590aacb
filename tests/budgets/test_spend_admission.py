"""Spend budgets at the door: month-to-date spend tracked in Redis beside the
token buckets (estimated at admission, corrected at settlement), and a hard
cap enforced with its own reason."""

from __future__ import annotations

import time
import uuid
from decimal import Decimal

import pytest

from budgets.admission.buckets import SpendCharge, admit, settle
from budgets.errors import Rejected
from budgets.models import SpendBudget
from budgets.ledger.pricing import TokenPrice
from budgets.ledger.spend import spend_month
from budgets.admission.pool_config import pool_config_push

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_cluster]

PRICE = TokenPrice(Decimal("2.00"), Decimal("8.00"))  # per million tokens


def charge(caller, *, input_tokens: int, output_tokens: int) -> SpendCharge:
    key, end = spend_month(pool_id=caller.pool.id, at_ms=time.time() * 1000)
    return SpendCharge(tenant_id=caller.tenant.id, month_key=key, month_end_ms=end,
                       cost_micro=PRICE.cost_micro(input_tokens=input_tokens, output_tokens=output_tokens))


def try_admit(caller, request_id: str, *, input_tokens: int = 1_000, output_tokens: int = 1_000):
    return admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=request_id,
                 input_tokens=input_tokens, output_tokens=output_tokens, lease_ttl_ms=60_000,
                 spend=charge(caller, input_tokens=input_tokens, output_tokens=output_tokens))


def month_to_date(redis_client, caller) -> dict[str, int]:
    key, _ = spend_month(pool_id=caller.pool.id, at_ms=time.time() * 1000)
    return {k: int(v) for k, v in redis_client.hgetall(key).items()}


def test_workload_hard_cap_rejects_with_spend_budget_until_month_end(make_caller, redis_client):
    # given a workload capped at $0.05 a month; each request estimates
    # 1,000 x $2/M + 1,000 x $8/M = $0.01
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(workload=caller.workload, monthly_amount=Decimal("0.05"), hard_cap=True)
    pool_config_push(pool=caller.pool)
    for n in range(5):
        try_admit(caller, f"r{n}")
    # then the sixth would pass the cap
    with pytest.raises(Rejected) as excinfo:
        try_admit(caller, "r5")
    assert excinfo.value.reason == "spend_budget"
    _, month_end = spend_month(pool_id=caller.pool.id, at_ms=time.time() * 1000)
    assert excinfo.value.retry_after_ms == pytest.approx(month_end - time.time() * 1000, abs=5_000)
    assert month_to_date(redis_client, caller) == {f"T{caller.tenant.id}": 50_000, str(caller.workload.id): 50_000}


def test_settlement_corrects_month_to_date_to_the_actual_cost(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.02"), hard_cap=True)
    pool_config_push(pool=caller.pool)
    key, _ = spend_month(pool_id=caller.pool.id, at_ms=time.time() * 1000)
    try_admit(caller, "a")
    try_admit(caller, "b")
    with pytest.raises(Rejected):
        try_admit(caller, "c")
    # when request a used 1,000 in and only 100 out, settled twice
    actual = PRICE.cost_micro(input_tokens=1_000, output_tokens=100)
    for _ in range(2):
        settle(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id="a", actual_input_tokens=1_000,
               actual_output_tokens=100, actual_cost_micro=actual, spend_month_key=key)
    # then month-to-date is actual + the open estimate, and there is room again
    assert month_to_date(redis_client, caller)[f"T{caller.tenant.id}"] == actual + 10_000
    try_admit(caller, "d", input_tokens=1_000, output_tokens=100)


def test_concurrent_admissions_never_overspend_the_cap(make_caller, redis_client):
    import threading

    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000, rpm=5_000)
    SpendBudget.objects.create(workload=caller.workload, monthly_amount=Decimal("0.30"), hard_cap=True)
    pool_config_push(pool=caller.pool)
    admitted = []
    lock = threading.Lock()
    barrier = threading.Barrier(40)

    def worker():
        barrier.wait()
        for _ in range(5):
            try:
                try_admit(caller, uuid.uuid4().hex)
                with lock:
                    admitted.append(1)
            except Rejected as rejected:
                assert rejected.reason == "spend_budget"

    threads = [threading.Thread(target=worker) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # $0.30 / $0.01 = exactly 30 of 200 attempts
    assert len(admitted) == 30
    assert month_to_date(redis_client, caller)[str(caller.workload.id)] == 300_000


def test_no_budget_no_limit_but_spend_is_still_tracked(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    for n in range(8):
        try_admit(caller, f"free{n}")
    assert month_to_date(redis_client, caller)[str(caller.workload.id)] == 80_000
