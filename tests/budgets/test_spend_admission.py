"""Spend budgets at the door: a tenant's month-to-date spend over all its
pools, held at admission before the pool admits (estimated cost), corrected
at settlement (actual cost), reconciled from the ledger plus the requests in
flight, and a hard cap enforced with its own reason. Real Redis, the real
gateway admission (gateway/core/request/admission.py) and settlement."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

import openai
import pytest

import llm_tokens
from budgets.admission import keys
from budgets.admission.estimation import Estimate
from budgets.redis.clients import redis_now_ms
from budgets.admission.spend_holds import HOLD_GRACE_MS, SpendHold, spend_hold_call
from budgets.errors import Rejected
from budgets.ledger.spend import spend_month, spend_month_to_date, spend_reconcile
from budgets.ledger.writer import usage_record_write
from budgets.models import ModelPrice, SpendBudget, UsageRecord
from gateway.core.request.routing import request_route_admit
from gateway.core.request.context import context_for_workload
from gateway.core.request.enqueue import record_build
from gateway.core.request.records import ledger_entry
from gateway.core.request.settlement import request_settle

from tests.gateway.ledger import ledger_rows

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_cluster]

MODEL = "sim-large"
# $2 per million input tokens, $8 per million output: 1,000 + 1,000 tokens
# estimate 2,000 + 8,000 = 10,000 micro-units ($0.01).
CENT = 10_000


@pytest.fixture(autouse=True)
def price(transactional_db):
    return ModelPrice.objects.create(model=MODEL, input_per_million=Decimal("2.00"), output_per_million=Decimal("8.00"),
                                     effective_from=datetime(2020, 1, 1, tzinfo=dt_timezone.utc))


def estimate(input_tokens: int = 1_000, output_tokens: int = 1_000) -> Estimate:
    return Estimate(input_tokens=input_tokens, output_tokens=output_tokens, max_tokens_requested=output_tokens,
                    clamped=False)


def try_admit(ctx, request_id: str, *, input_tokens: int = 1_000, output_tokens: int = 1_000):
    return request_route_admit(ctx.route(MODEL), request_id=request_id, model=MODEL, lease_ms=60_000,
                               estimate_for=lambda _on_pool: estimate(input_tokens, output_tokens)).admission


def settle_and_record(ctx, admission, *, input_tokens: int, output_tokens: int, ledger: bool = True):
    """What the worker does once the pool answered: settle, then the ledger row."""
    record = record_build(ctx, request_id=admission.request_id, model=MODEL, payload={},
                          estimate=estimate(admission.input_tokens, admission.output_tokens), admission=admission,
                          deadline_ms=admission.admitted_ms + 10_000, retry_deadline_ms=admission.admitted_ms + 10_000)
    request_settle(record=record, input_tokens=input_tokens, output_tokens=output_tokens, pool_called=True)
    if ledger:
        usage_record_write(entry=ledger_entry(record, status="ok", actual_input_tokens=input_tokens,
                                              actual_output_tokens=output_tokens))
    return record


def this_month() -> str:
    return spend_month(at_ms=time.time() * 1000)[0]


def month_to_date(redis_client, tenant) -> dict[str, int]:
    raw = redis_client.hgetall(keys.tenant_spend_month(tenant.id, this_month()))
    return {field: int(value) for field, value in raw.items()}


def holds(redis_client, tenant) -> dict[str, str]:
    return redis_client.hgetall(keys.tenant_spend_holds(tenant.id))


def one_tenant_on_pools(make_caller, n_pools: int, **caller_kwargs):
    """One tenant with a workload on each of ``n_pools`` pools."""
    first = make_caller(**caller_kwargs)
    callers = [first] + [make_caller(tenant=first.tenant, **caller_kwargs) for _ in range(n_pools - 1)]
    assert len({c.pool.id for c in callers}) == n_pools
    return callers


def test_workload_hard_cap_rejects_with_spend_budget_until_month_end(make_caller, redis_client):
    # given a workload capped at $0.05 a month, each request estimated at $0.01
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(workload=caller.workload, monthly_amount=Decimal("0.05"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    for n in range(5):
        try_admit(ctx, f"r{n}")
    # then the sixth would pass the cap
    with pytest.raises(Rejected) as excinfo:
        try_admit(ctx, "r5")
    rejected = excinfo.value
    assert (rejected.reason, rejected.status, rejected.error_type) == ("spend_budget", 429, "rate_limit_error")
    assert rejected.message == "This month's spend budget is used up; it renews at the start of next month."
    _, month_end = spend_month(at_ms=time.time() * 1000)
    assert rejected.retry_after_ms == pytest.approx(month_end - time.time() * 1000, abs=5_000)
    assert rejected.estimated_tokens == 2_000
    assert month_to_date(redis_client, caller.tenant) == {f"T{caller.tenant.id}": 5 * CENT,
                                                          str(caller.workload.id): 5 * CENT}
    # and the refused request left nothing on the pool
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 5


def test_settlement_corrects_month_to_date_to_the_actual_cost_once(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.02"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    a = try_admit(ctx, "a")
    try_admit(ctx, "b")
    with pytest.raises(Rejected):
        try_admit(ctx, "c")
    # when request a used 1,000 in and only 100 out, and is settled three times
    actual = 1_000 * 2 + 100 * 8  # micro-units
    for _ in range(3):
        settle_and_record(ctx, a, input_tokens=1_000, output_tokens=100)
    # then month-to-date is actual + the open estimate, and there is room again
    assert month_to_date(redis_client, caller.tenant)[f"T{caller.tenant.id}"] == actual + CENT
    try_admit(ctx, "d", input_tokens=1_000, output_tokens=100)
    assert month_to_date(redis_client, caller.tenant)[f"T{caller.tenant.id}"] == 2 * actual + CENT


def test_concurrent_settlement_replays_correct_once(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    ctx = context_for_workload(caller.workload)
    admission = try_admit(ctx, "once")
    record = record_build(ctx, request_id="once", model=MODEL, payload={}, estimate=estimate(), admission=admission,
                          deadline_ms=admission.admitted_ms + 10_000, retry_deadline_ms=admission.admitted_ms + 10_000)
    barrier = threading.Barrier(20)

    def replay():
        barrier.wait()
        request_settle(record=record, input_tokens=500, output_tokens=0, pool_called=True)

    threads = [threading.Thread(target=replay) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert month_to_date(redis_client, caller.tenant) == {f"T{caller.tenant.id}": 1_000,
                                                          str(caller.workload.id): 1_000}


def test_concurrent_admissions_never_overspend_the_cap(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000, rpm=5_000)
    SpendBudget.objects.create(workload=caller.workload, monthly_amount=Decimal("0.30"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    admitted = []
    lock = threading.Lock()
    barrier = threading.Barrier(40)

    def worker():
        barrier.wait()
        for _ in range(5):
            try:
                try_admit(ctx, uuid.uuid4().hex)
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
    assert month_to_date(redis_client, caller.tenant)[str(caller.workload.id)] == 30 * CENT


def test_tenant_cap_holds_across_pools_under_threads(make_caller, redis_client):
    # given one tenant with a workload on each of three pools and a tenant cap
    # of $0.30; no pool or workload bucket would refuse anything
    callers = one_tenant_on_pools(make_caller, 3, reserved_tpm=600_000, ceiling_tpm=600_000, rpm=5_000)
    tenant = callers[0].tenant
    SpendBudget.objects.create(tenant=tenant, monthly_amount=Decimal("0.30"), hard_cap=True)
    contexts = [context_for_workload(c.workload) for c in callers]
    results: list[tuple[int, bool]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(60)

    def worker(n: int):
        barrier.wait()
        for i in range(5):
            ctx = contexts[(n + i) % 3]
            try:
                try_admit(ctx, uuid.uuid4().hex)
                outcome = (ctx.workload_id, True)
            except Rejected as rejected:
                assert rejected.reason == "spend_budget"
                outcome = (ctx.workload_id, False)
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # then exactly 30 of 300 got through, over all three pools together
    admitted = [wid for wid, ok in results if ok]
    assert (len(results), len(admitted)) == (300, 30)
    mtd = month_to_date(redis_client, tenant)
    assert mtd[f"T{tenant.id}"] == 30 * CENT
    # (a workload that won no request has no field: which pool wins is timing)
    assert sum(mtd.get(str(c.workload.id), 0) for c in callers) == 30 * CENT
    for caller in callers:
        # each pool holds a lease for each request it admitted, no more
        assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == admitted.count(caller.workload.id)
        assert mtd.get(str(caller.workload.id), 0) == admitted.count(caller.workload.id) * CENT
    assert len(holds(redis_client, tenant)) == 30


def test_tenant_cap_holds_across_pools_under_four_processes(make_caller, redis_client):
    # given one tenant on three pools, a tenant cap of $0.25, and 4 processes x
    # 8 threads x 10 attempts spread over the pools
    callers = one_tenant_on_pools(make_caller, 3, reserved_tpm=600_000, ceiling_tpm=600_000, rpm=5_000)
    tenant = callers[0].tenant
    SpendBudget.objects.create(tenant=tenant, monthly_amount=Decimal("0.25"), hard_cap=True)
    contexts = pickle.dumps([context_for_workload(c.workload) for c in callers])
    from tests.hammer import request_admit_many

    barrier_at = time.time() + 4.0  # spawned interpreters need a moment to import Django
    with multiprocessing.get_context("spawn").Pool(4) as processes:
        chunks = processes.map(request_admit_many, [(contexts, MODEL, 1_000, 1_000, 8, 10, barrier_at)] * 4)
    results = [r for chunk in chunks for r in chunk]
    # then exactly 25 of 320 got through, every refusal is the spend cap
    admitted = [wid for wid, ok, _ in results if ok]
    assert (len(results), len(admitted)) == (320, 25)
    assert {reason for _, ok, reason in results if not ok} == {"spend_budget"}
    mtd = month_to_date(redis_client, tenant)
    assert mtd[f"T{tenant.id}"] == 25 * CENT
    assert sum(redis_client.zcard(keys.pool_leases(c.pool.id)) for c in callers) == 25
    for caller in callers:
        assert mtd.get(str(caller.workload.id), 0) == admitted.count(caller.workload.id) * CENT


def test_a_pool_refusal_takes_the_spend_hold_back(make_caller, redis_client):
    # given a tenant capped at $0.02 with a workload on each of two pools, the
    # first allowed one request in flight
    first, second = one_tenant_on_pools(make_caller, 2, reserved_tpm=600_000, ceiling_tpm=600_000)
    first.reservation.max_concurrency = 1
    first.reservation.save()
    from budgets.admission.pool_config import pool_config_push

    pool_config_push(pool=first.pool)
    SpendBudget.objects.create(tenant=first.tenant, monthly_amount=Decimal("0.02"), hard_cap=True)
    ctx_first, ctx_second = context_for_workload(first.workload), context_for_workload(second.workload)
    try_admit(ctx_first, "in-flight")
    # when the first pool refuses the next request of that workload
    with pytest.raises(Rejected) as excinfo:
        try_admit(ctx_first, "refused")
    assert excinfo.value.reason == "workload_concurrency"
    # then its estimate is not held: month-to-date is the one request in flight
    assert month_to_date(redis_client, first.tenant)[f"T{first.tenant.id}"] == CENT
    assert list(holds(redis_client, first.tenant)) == ["in-flight"]
    # and the tenant's second cent is there for the other pool
    try_admit(ctx_second, "other-pool")
    with pytest.raises(Rejected) as excinfo:
        try_admit(ctx_second, "over")
    assert excinfo.value.reason == "spend_budget"


def test_no_budget_no_limit_but_spend_is_still_tracked(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    ctx = context_for_workload(caller.workload)
    for n in range(8):
        try_admit(ctx, f"free{n}")
    assert month_to_date(redis_client, caller.tenant)[str(caller.workload.id)] == 8 * CENT


def test_a_request_without_a_price_holds_no_spend(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.000001"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    unpriced = replace(ctx.pool, prices={})
    ctx = replace(ctx, pool=unpriced, slices=(unpriced,))
    admission = try_admit(ctx, "unpriced")
    assert admission.spend_month == ""
    assert holds(redis_client, caller.tenant) == {}


def test_reconcile_counts_requests_in_flight(make_caller, redis_client):
    # given a tenant capped at $0.04 with two requests admitted, unsettled
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.04"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    first, second = try_admit(ctx, "first"), try_admit(ctx, "second")
    tenant_field, workload_field = f"T{caller.tenant.id}", str(caller.workload.id)
    # when reconciliation runs (the ledger holds nothing of them yet)
    result = spend_reconcile()
    # then month-to-date still counts their estimates, and the cap still holds
    assert (result.holds_counted, result.holds_dropped) == (2, 0)
    assert month_to_date(redis_client, caller.tenant) == {tenant_field: 2 * CENT, workload_field: 2 * CENT}
    try_admit(ctx, "third")
    try_admit(ctx, "fourth")
    with pytest.raises(Rejected):
        try_admit(ctx, "fifth")
    # when the first is settled at its actual cost but its ledger row is not
    # written yet, and reconciliation runs in between
    actual = 1_000 * 2 + 250 * 8
    settle_and_record(ctx, first, input_tokens=1_000, output_tokens=250, ledger=False)
    spend_reconcile()
    # then month-to-date is exact: the actual cost + three estimates
    assert month_to_date(redis_client, caller.tenant)[tenant_field] == actual + 3 * CENT
    # when its ledger row lands, and the second settles fully
    settle_and_record(ctx, first, input_tokens=1_000, output_tokens=250)
    settle_and_record(ctx, second, input_tokens=1_000, output_tokens=1_000)
    result = spend_reconcile()
    # then the ledger counts them, their holds are gone, the others still count
    assert result.holds_dropped == 2
    assert month_to_date(redis_client, caller.tenant) == {tenant_field: actual + 3 * CENT,
                                                          workload_field: actual + 3 * CENT}
    assert sorted(holds(redis_client, caller.tenant)) == ["fourth", "third"]
    ledger_micro = sum(UsageRecord.objects.values_list("cost", flat=True)) * 1_000_000
    assert ledger_micro == actual + CENT
    assert spend_month_to_date(tenant=caller.tenant) == Decimal(actual + 3 * CENT) / 1_000_000


def test_a_hold_leaked_by_a_crash_expires_and_reconciliation_drops_it(make_caller, redis_client):
    # given a process that held spend and died before the pool's admission:
    # one hold whose lease runs out at once, and one live request in flight
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.02"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    try_admit(ctx, "alive")
    month, month_end = spend_month(at_ms=time.time() * 1000)
    leaked = SpendHold(tenant_id=caller.tenant.id, workload_id=caller.workload.id, cost_micro=CENT, month=month,
                       month_end_ms=month_end)
    assert spend_hold_call(leaked, request_id="leaked", lease_ttl_ms=1 - HOLD_GRACE_MS).run() is True
    with pytest.raises(Rejected):
        try_admit(ctx, "blocked-by-the-leak")
    expires_ms = int(holds(redis_client, caller.tenant)["leaked"].split("|")[3])
    deadline = time.monotonic() + 5
    while redis_now_ms() <= expires_ms:
        assert time.monotonic() < deadline
    # when reconciliation runs
    result = spend_reconcile()
    # then the leaked estimate is gone and the live one still counts
    assert (result.holds_counted, result.holds_dropped) == (1, 1)
    assert month_to_date(redis_client, caller.tenant)[f"T{caller.tenant.id}"] == CENT
    try_admit(ctx, "fits-again")


def test_a_lost_month_to_date_is_rebuilt_before_admitting(make_caller, redis_client):
    # given $0.02 of the tenant's $0.03 cap spent (in the ledger) and one
    # request in flight, and then Redis losing the tenant's spend keys but the holds
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.03"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    for name in ("a", "b"):
        settle_and_record(ctx, try_admit(ctx, name), input_tokens=1_000, output_tokens=1_000)
    try_admit(ctx, "in-flight")
    redis_client.delete(keys.tenant_spend_month(caller.tenant.id, this_month()),
                        keys.tenant_spend_caps(caller.tenant.id))
    # when the tenant's next request arrives
    with pytest.raises(Rejected) as excinfo:
        try_admit(ctx, "over")
    # then admission rebuilt month-to-date from the ledger and the holds first
    assert excinfo.value.reason == "spend_budget"
    assert month_to_date(redis_client, caller.tenant)[f"T{caller.tenant.id}"] == 3 * CENT


def test_a_lost_pool_config_is_rebuilt_and_the_spend_held_once(make_caller, redis_client):
    # given a priced workload whose pool config Redis lost
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.05"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    try_admit(ctx, "before")
    redis_client.delete(keys.pool_config(caller.pool.id))
    # when the next request arrives
    admission = try_admit(ctx, "after")
    # then the pool's config was rebuilt, the request leased, and its spend held once
    assert admission.spend_month == this_month()
    assert redis_client.exists(keys.pool_config(caller.pool.id))
    assert sorted(holds(redis_client, caller.tenant)) == ["after", "before"]
    assert month_to_date(redis_client, caller.tenant)[f"T{caller.tenant.id}"] == 2 * CENT


def test_spend_caps_follow_budget_edits(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    budget = SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.01"), hard_cap=True)
    other = make_caller(tenant=caller.tenant)
    SpendBudget.objects.create(workload=other.workload, monthly_amount=Decimal("1.5"), hard_cap=True)
    caps = keys.tenant_spend_caps(caller.tenant.id)
    assert redis_client.hgetall(caps) == {"pushed": "1", f"T{caller.tenant.id}": "10000",
                                          str(other.workload.id): "1500000"}
    budget.hard_cap = False
    budget.save()
    assert redis_client.hgetall(caps) == {"pushed": "1", str(other.workload.id): "1500000"}
    budget.delete()
    assert redis_client.hgetall(caps) == {"pushed": "1", str(other.workload.id): "1500000"}


def test_gateway_refuses_over_the_tenant_cap_across_pools_with_the_429_shape(platform, make_caller, redis_client):
    # given a tenant with a workload on each of two pools served by the
    # simulator, and a price of 1,000 micro-units per token
    ModelPrice.objects.create(model="sim-small", input_per_million=Decimal("1000"), output_per_million=Decimal("1000"),
                              effective_from=datetime(2020, 1, 1, tzinfo=dt_timezone.utc))
    pools = [make_caller.pool(base_url=f"{platform.sim_url}/v1") for _ in range(2)]
    first = make_caller(pool=pools[0])
    second = make_caller(pool=pools[1], tenant=first.tenant)
    hello = [{"role": "user", "content": "Say hello to the gateway, please."}]
    prompt = llm_tokens.count_chat_tokens(hello)
    estimated, actual = (prompt + 40) * 1_000, (prompt + 17) * 1_000
    # a cap that fits two requests only once the first is settled at its actual cost
    SpendBudget.objects.create(tenant=first.tenant, monthly_amount=Decimal(actual + estimated) / 1_000_000,
                               hard_cap=True)

    def ask(caller):
        client = openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=caller.api_key, max_retries=0, timeout=60)
        return client.chat.completions.create(model="sim-small", messages=hello, max_tokens=40,
                                              extra_body={"sim": {"output_tokens": 17}})

    # when the tenant calls through the first pool, then the second, then the first again
    assert ask(first).usage.completion_tokens == 17
    assert ask(second).usage.completion_tokens == 17
    with pytest.raises(openai.RateLimitError) as excinfo:
        ask(first)
    # then the third is refused for spend, in the shape the SDKs back off on
    error = excinfo.value
    assert error.status_code == 429
    assert error.body == {"message": "This month's spend budget is used up; it renews at the start of next month.",
                          "type": "rate_limit_error", "param": None, "code": "spend_budget"}
    _, month_end = spend_month(at_ms=time.time() * 1000)
    assert int(error.response.headers["retry-after-ms"]) == pytest.approx(month_end - time.time() * 1000, abs=10_000)
    assert int(error.response.headers["Retry-After"]) == -(-int(error.response.headers["retry-after-ms"]) // 1000)
    # and month-to-date is the two actual costs, exactly what the ledger holds
    # (a worker settles before it answers, and writes the ledger row just after)
    assert month_to_date(redis_client, first.tenant)[f"T{first.tenant.id}"] == 2 * actual
    ledger = sorted((row.pool_id, row.cost) for row in ledger_rows(2, tenant=first.tenant))
    assert ledger == sorted([(pools[0].id, Decimal(actual) / 1_000_000), (pools[1].id, Decimal(actual) / 1_000_000)])
