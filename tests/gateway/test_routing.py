"""Routing across pools (gateway/core/request/routing.py, gateway/worker/failover.py)
through the real platform: a workload with slices on several pools spills
over to its overflow pool instead of a 429, skips a pool that fails, moves a
call that failed before its first token, and every answer and ledger row
names the pool that served, at that pool's price."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from decimal import Decimal

import openai
import pytest
from django.core.exceptions import ValidationError

from budgets.admission import keys as budget_keys
from budgets.admission.buckets import admit
from budgets.admission.pool_config import pool_config_push
from budgets.models import ModelPrice, Reservation
from gateway.core import keys as gateway_keys
from gateway.core.protection.circuit import circuit_record
from gateway.core.request.context import context_for_workload
from gateway.core.request.routing import route_ordered, route_ordered_async
from tests.gateway.ledger import ledger_row
from tests.gateway.sdk_calls import sdk

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Route me."}]
DEAD_URL = "http://127.0.0.1:9/v1"  # nothing listens: connection refused


def add_slice(workload, pool, *, rank: int, reserved_tpm: int = 100_000, ceiling_tpm: int | None = None,
              rpm: int = 1_000) -> Reservation:
    extra = Reservation(workload=workload, pool=pool, rank=rank, reserved_tpm=reserved_tpm,
                        ceiling_tpm=ceiling_tpm or reserved_tpm, rpm=rpm)
    extra.full_clean()
    extra.save()
    pool_config_push(pool=pool)
    return extra


def price(model: str, pool, input_per_million: str, output_per_million: str) -> ModelPrice:
    return ModelPrice.objects.create(model=model, pool=pool, input_per_million=Decimal(input_per_million),
                                     output_per_million=Decimal(output_per_million),
                                     effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc))


def test_a_burst_past_the_primary_slice_is_served_by_the_overflow_pool_at_its_price(platform, make_caller,
                                                                                   redis_client):
    # given a primary slice whose ceiling holds two requests in its burst (15 s x 4,000 TPM = 1,000 tokens)
    # and an overflow slice on a second pool, priced higher there
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    overflow_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=100,
                         max_tokens_cap=400)
    add_slice(caller.workload, overflow_pool, rank=1)
    price("sim-small", None, "1", "2")
    price("sim-small", overflow_pool, "10", "20")
    client = sdk(platform, caller.api_key)
    # when it sends five requests of about 410 tokens at once
    with ThreadPoolExecutor(5) as callers:
        answers = list(callers.map(lambda _: client.chat.completions.with_raw_response.create(
            model="sim-small", messages=HELLO, max_tokens=400, extra_body={"sim": {"output_tokens": 400}}), range(5)))
    # then none is refused: two are served by the primary, the rest by the overflow
    served = sorted(raw.headers["x-sluice-pool"] for raw in answers)
    assert served == sorted([primary_pool.slug] * 2 + [overflow_pool.slug] * 3)
    # and each ledger row names its pool, whether it spilled over, and that pool's price
    for raw in answers:
        row = ledger_row(raw.headers["x-request-id"])
        on_overflow = raw.headers["x-sluice-pool"] == overflow_pool.slug
        assert (row.pool_id, row.overflow, row.failed_over) == (
            overflow_pool.id if on_overflow else primary_pool.id, on_overflow, False)
        rate_in, rate_out = (Decimal(10), Decimal(20)) if on_overflow else (Decimal(1), Decimal(2))
        assert row.cost == (row.actual_input_tokens * rate_in + row.actual_output_tokens * rate_out) / 1_000_000
    # and the primary's buckets hold no lease of the requests it did not serve
    assert redis_client.zcard(budget_keys.pool_leases(primary_pool.id)) == 0


def at_once(count: int, call) -> list:
    """``count`` calls started together (a burst's refill is then nil), each
    answer or the exception it raised."""
    def one(_):
        try:
            return call()
        except openai.APIStatusError as exc:
            return exc
    with ThreadPoolExecutor(count) as callers:
        return list(callers.map(one, range(count)))


def full_call(client):
    """A call of about 410 tokens that uses every one of them."""
    return lambda: client.chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=400, extra_body={"sim": {"output_tokens": 400}})


def test_a_workload_that_forbids_overflow_hears_429_from_its_primary(platform, make_caller):
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    overflow_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=100,
                         max_tokens_cap=400)
    add_slice(caller.workload, overflow_pool, rank=1)
    caller.workload.allow_overflow = False
    caller.workload.save()
    answers = at_once(3, full_call(sdk(platform, caller.api_key)))
    refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
    served = [a.headers["x-sluice-pool"] for a in answers if not isinstance(a, Exception)]
    assert served == [primary_pool.slug] * 2 and len(refused) == 1
    assert refused[0].code == "workload_tpm"
    assert refused[0].response.headers["x-sluice-pool"] == primary_pool.slug


def test_when_every_pool_refuses_the_caller_gets_the_soonest_retry_and_every_reason(platform, make_caller):
    # given two slices, each with room for exactly one ~410-token request in its burst
    first_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    second_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=first_pool, reserved_tpm=2_400, ceiling_tpm=2_400, prompt_tokens_cap=100,
                         max_tokens_cap=400)
    add_slice(caller.workload, second_pool, rank=1, reserved_tpm=2_000, ceiling_tpm=2_000)
    # when three come at once
    answers = at_once(3, full_call(sdk(platform, caller.api_key)))
    # then one is served by each pool, and the third names both pools' reasons
    served = sorted(a.headers["x-sluice-pool"] for a in answers if not isinstance(a, Exception))
    assert served == sorted([first_pool.slug, second_pool.slug])
    [refused] = [a for a in answers if isinstance(a, openai.RateLimitError)]
    headers = refused.response.headers
    assert headers["x-sluice-route-refusals"] == f"{first_pool.slug}: workload_tpm; {second_pool.slug}: workload_tpm"
    assert "Every pool of this workload's route refused" in refused.message
    # and the wait is the soonest: the first pool refills 40 tokens a second, the second 33
    assert headers["x-sluice-pool"] == first_pool.slug
    assert 0 < int(headers["retry-after-ms"]) <= 15_000


def test_a_call_refused_by_a_dead_pool_fails_over_once_and_is_billed_once(platform, make_caller, redis_client):
    # given a primary pool that refuses connections and a replica behind it
    dead_pool = make_caller.pool(base_url=DEAD_URL)
    live_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=dead_pool)
    add_slice(caller.workload, live_pool, rank=1)
    # when a call and a stream come
    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=20, extra_body={"sim": {"output_tokens": 7}})
    stream = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=20, stream=True, extra_body={"sim": {"output_tokens": 6}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream.parse() if chunk.choices)
    # then both are served by the live pool, on their second attempt
    assert raw.parse().usage.completion_tokens == 7 and text
    assert raw.headers["x-sluice-pool"] == live_pool.slug
    assert stream.headers["x-sluice-pool"] == live_pool.slug
    for request_id in (raw.headers["x-request-id"], stream.headers["x-request-id"]):
        row = ledger_row(request_id)
        assert (row.pool_id, row.failed_over, row.overflow, row.status, row.attempts) == (
            live_pool.id, True, True, "ok", 2)
    # and the dead pool holds nothing: its leases were given back whole
    assert redis_client.zcard(budget_keys.pool_leases(dead_pool.id)) == 0
    assert redis_client.zcard(budget_keys.pool_leases(live_pool.id)) == 0


def test_a_failed_call_with_no_pool_left_keeps_its_own_outcome(platform, make_caller):
    dead_pool = make_caller.pool(base_url=DEAD_URL)
    caller = make_caller(pool=dead_pool)
    with pytest.raises(openai.APIStatusError) as failed:
        sdk(platform, caller.api_key).chat.completions.create(model="sim-small", messages=HELLO, max_tokens=5)
    assert failed.value.status_code == 502
    assert failed.value.response.headers["x-sluice-pool"] == dead_pool.slug
    row = ledger_row(failed.value.response.headers["x-request-id"])
    assert (row.pool_id, row.failed_over) == (dead_pool.id, False)


def test_a_pool_whose_circuit_is_open_is_skipped_and_its_trial_brings_the_route_back(platform, make_caller,
                                                                                     redis_client, breaker):
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    replica = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool)
    add_slice(caller.workload, replica, rank=1)
    # given the primary's circuit opened by three failed calls (for ten minutes)
    for n in range(3):
        circuit_record(pool_id=primary_pool.id, holder=f"failed-{n}", ok=False, detail="HTTP 503")
    client = sdk(platform, caller.api_key)
    # when a request comes, it is served by the replica, and the held admission on the primary was given back
    raw = client.chat.completions.with_raw_response.create(model="sim-small", messages=HELLO, max_tokens=5)
    assert raw.headers["x-sluice-pool"] == replica.slug
    assert ledger_row(raw.headers["x-request-id"]).pool_id == replica.id
    assert redis_client.zcard(budget_keys.pool_leases(primary_pool.id)) == 0
    assert redis_client.zcard(gateway_keys.pool_held(primary_pool.id)) == 0
    # when the circuit's open time is over, the next request is its trial on the primary, which closes it
    redis_client.hset(gateway_keys.pool_circuit(primary_pool.id), "open_until_ms", "0")
    raw = client.chat.completions.with_raw_response.create(model="sim-small", messages=HELLO, max_tokens=5)
    assert raw.headers["x-sluice-pool"] == primary_pool.slug
    assert redis_client.hget(gateway_keys.pool_circuit(primary_pool.id), "state") == "closed"
    raw = client.chat.completions.with_raw_response.create(model="sim-small", messages=HELLO, max_tokens=5)
    assert raw.headers["x-sluice-pool"] == primary_pool.slug


def test_replicas_are_tried_by_headroom(platform, make_caller):
    # given two replicas (equal rank), the first one busier
    busy = make_caller.pool(base_url=f"{platform.sim_url}/v1", max_concurrency=10)
    idle = make_caller.pool(base_url=f"{platform.sim_url}/v1", max_concurrency=10)
    caller = make_caller(pool=busy)
    add_slice(caller.workload, idle, rank=0)
    for n in range(4):
        admit(pool_id=busy.id, workload_id=caller.workload.id, request_id=f"held-{n}", input_tokens=10,
              output_tokens=10, lease_ttl_ms=60_000)
    route = context_for_workload(caller.workload).route("sim-small")
    assert [c.pool_id for c in route] == [busy.id, idle.id]
    # then the idle replica is asked first, sync and async alike
    assert [c.pool_id for c in route_ordered(route)] == [idle.id, busy.id]
    assert [c.pool_id for c in asyncio.run(route_ordered_async(route))] == [idle.id, busy.id]
    # and an overflow rank stays behind both whatever its headroom
    spare = make_caller.pool(base_url=f"{platform.sim_url}/v1", max_concurrency=10)
    add_slice(caller.workload, spare, rank=1)
    route = context_for_workload(caller.workload).route("sim-small")
    assert [c.pool_id for c in route_ordered(route)] == [idle.id, busy.id, spare.id]
    assert [c.overflow for c in route] == [False, False, True]


def test_bad_slices_are_refused_with_a_clear_error_and_nothing_half_written(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    # a second slice on the same pool (a route that loops back on itself)
    with pytest.raises(ValidationError, match="already holds a slice of this pool"):
        add_slice(caller.workload, pool, rank=1)
    # a pool that serves none of the models the workload may call
    other = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=["sim-large"])
    caller.workload.allowed_models = ["sim-small"]
    caller.workload.save()
    with pytest.raises(ValidationError, match="none of the models this workload may call"):
        add_slice(caller.workload, other, rank=1)
    # a pool that serves nothing at all
    empty = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    type(empty).objects.filter(pk=empty.pk).update(served_models=[])  # the form refuses it; an old row may not
    empty.refresh_from_db()
    with pytest.raises(ValidationError, match="serves no model"):
        add_slice(caller.workload, empty, rank=1)
    assert list(Reservation.objects.filter(workload=caller.workload).values_list("pool_id", flat=True)) == [pool.id]


def test_an_overflow_spend_cap_stops_spill_over_but_not_the_primary(platform, make_caller):
    # given an overflow priced at 1,000 per million tokens and a workload that may spend 0.50 a month there
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    overflow_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=100,
                         max_tokens_cap=400)
    add_slice(caller.workload, overflow_pool, rank=1)
    price("sim-small", None, "1", "1")
    price("sim-small", overflow_pool, "1000", "1000")
    caller.workload.overflow_monthly_cap = Decimal("0.50")
    caller.workload.save()
    # when four ~410-token requests come at once: two fit the primary, one spills over (about 0.41 there)
    answers = at_once(4, full_call(sdk(platform, caller.api_key)))
    served = sorted(a.headers["x-sluice-pool"] for a in answers if not isinstance(a, Exception))
    assert served == sorted([primary_pool.slug] * 2 + [overflow_pool.slug])
    # then the fourth, which the primary has no room for and would pass the overflow cap, is refused
    [refused] = [a for a in answers if isinstance(a, openai.RateLimitError)]
    assert refused.response.headers["x-sluice-route-refusals"] == (
        f"{primary_pool.slug}: workload_tpm; {overflow_pool.slug}: overflow_spend_budget")
    assert refused.code == "workload_tpm"  # the primary has room first, not next month


def test_overflow_is_measured_against_each_models_own_route(platform, make_caller):
    # given chat on a rank-0 pool and embeddings only on a rank-1 pool
    chat_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=["sim-small"])
    embed_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=["sim-large"])
    caller = make_caller(pool=chat_pool)
    add_slice(caller.workload, embed_pool, rank=1)
    caller.workload.allow_overflow = False
    caller.workload.save()
    ctx = context_for_workload(caller.workload)
    # then the rank-1 pool is sim-large's primary, not overflow, and forbidding overflow keeps it
    assert [(c.pool_id, c.overflow) for c in ctx.route("sim-large")] == [(embed_pool.id, False)]
    assert [(c.pool_id, c.overflow) for c in ctx.route("sim-small")] == [(chat_pool.id, False)]
    assert set(ctx.served_models) == {"sim-small", "sim-large"}


def test_a_held_primarys_spend_hold_meets_the_overflow_cap_and_the_refusal_is_a_429(platform, make_caller,
                                                                                   redis_client, breaker):
    # given a primary whose circuit is open, an overflow the workload may spend nothing on, and prices
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    overflow_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool)
    add_slice(caller.workload, overflow_pool, rank=1)
    price("sim-small", None, "1", "1")
    price("sim-small", overflow_pool, "1000", "1000")
    caller.workload.overflow_monthly_cap = Decimal("0.00")
    caller.workload.save()
    for n in range(3):
        circuit_record(pool_id=primary_pool.id, holder=f"failed-{n}", ok=False, detail="HTTP 503")
    # when a request comes: the primary holds it (skipped), the overflow's cap refuses it
    with pytest.raises(openai.RateLimitError) as refused:
        sdk(platform, caller.api_key).chat.completions.create(model="sim-small", messages=HELLO, max_tokens=5)
    # then the caller hears the overflow's 429, not the failing primary's 503, with both reasons
    assert refused.value.code == "overflow_spend_budget"
    assert refused.value.response.headers["x-sluice-route-refusals"] == (
        f"{primary_pool.slug}: pool_circuit_open; {overflow_pool.slug}: overflow_spend_budget")
    # and nothing stays held: no lease on either pool, no spend hold, nothing spent this month
    assert redis_client.zcard(budget_keys.pool_leases(primary_pool.id)) == 0
    assert redis_client.zcard(budget_keys.pool_leases(overflow_pool.id)) == 0
    assert redis_client.hlen(budget_keys.tenant_spend_holds(caller.tenant.id)) == 0


def test_a_request_whose_pool_opens_its_circuit_while_it_waits_moves_instead_of_waiting(platform, make_caller,
                                                                                       redis_client, breaker):
    from budgets.admission.estimation import Estimate
    from gateway.core.request.admission import lease_ttl_ms
    from gateway.core.request.enqueue import new_request_id, record_build, record_enqueue
    from gateway.core.request.records import Outcome
    from gateway.core.request.routing import request_route_admit

    # given a request admitted on its primary while the circuit was closed, with a replica behind it
    primary_pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    replica = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=primary_pool)
    add_slice(caller.workload, replica, rank=1)
    ctx = context_for_workload(caller.workload)
    estimate = Estimate(input_tokens=10, output_tokens=5, max_tokens_requested=5, clamped=False)
    request_id, lease_ms = new_request_id(), lease_ttl_ms(queue_s=ctx.queue_timeout_s)
    routed = request_route_admit(ctx.route("sim-small"), request_id=request_id, model="sim-small",
                                 estimate_for=lambda _on_pool: estimate, lease_ms=lease_ms)
    assert routed.ctx.pool_id == primary_pool.id and routed.fallback_pool_ids == (replica.id,)
    record = record_build(routed.ctx, request_id=request_id, model="sim-small",
                          payload={"model": "sim-small", "messages": HELLO, "max_tokens": 5}, estimate=estimate,
                          admission=routed.admission, deadline_ms=routed.admission.admitted_ms + 600_000,
                          retry_deadline_ms=routed.admission.admitted_ms + 600_000,
                          fallback_pool_ids=routed.fallback_pool_ids)
    # when the primary's circuit opens (for ten minutes) before a worker takes it
    for n in range(3):
        circuit_record(pool_id=primary_pool.id, holder=f"failed-{n}", ok=False, detail="HTTP 503")
    record_enqueue(record, lease_ms=lease_ms)
    popped = redis_client.blpop([gateway_keys.request_result(request_id)], timeout=20)
    # then it is answered by the replica at once, without a call to the primary
    assert popped is not None
    outcome = Outcome.from_json(popped[1])
    assert (outcome.status, outcome.pool) == ("ok", replica.slug)
    row = ledger_row(request_id)
    assert (row.pool_id, row.failed_over, row.attempts) == (replica.id, True, 1)
    assert redis_client.zcard(budget_keys.pool_leases(primary_pool.id)) == 0
