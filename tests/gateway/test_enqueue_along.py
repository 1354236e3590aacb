"""A request admitted on its own reservation has its record, its arrival's
metrics and its lane message written by the last step of its admission's
round trip (gateway/core/enqueue.lua, gateway/core/admission.py
``admission_plan``'s ``along``), exactly as the separate enqueue writes
them; a refusal (the pool's or the spend cap's), a held request, a loan and a
workload refused a moment ago write nothing there and go the old way.
Real Redis, watched with its own MONITOR (a script's commands show as
``lua``), and the real admission."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

import pytest

from budgets.admission import keys as budget_keys
from budgets.admission.buckets import Admission
from budgets.admission.estimation import Estimate
from budgets.admission.redis_client import LuaScript, ScriptCall, Together, raw_reply
from budgets.errors import Rejected
from budgets.models import ModelPrice, SpendBudget
from gateway.core import admission as admission_module
from gateway.core import keys
from gateway.core.admission import request_admit_async, spend_hold_for
from gateway.core.context import context_for_workload
from gateway.core.enqueue import enqueue_along, record_build
from gateway.core.lanes import queue_for_lane
from gateway.core.records import RequestRecord
from tests.gateway.stored import RedisMonitor

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "sim-large"
QUEUE_S = 10.0


def _estimate() -> Estimate:
    return Estimate(input_tokens=100, output_tokens=50, max_tokens_requested=50, clamped=False)


def _provisional(ctx, request_id: str, *, spend_month: str = "") -> RequestRecord:
    """The record as it will be if admitted on the workload's own reservation
    (``admitted_ms`` 0: its deadlines are their offsets), as dispatch builds it."""
    return record_build(
        ctx, request_id=request_id, model=MODEL, payload={"model": MODEL, "messages": []}, estimate=_estimate(),
        admission=Admission(request_id=request_id, pool_id=ctx.pool_id, workload_id=ctx.workload_id,
                            input_tokens=100, output_tokens=50, borrowed=False, rate_limits=None, admitted_ms=0.0,
                            spend_month=spend_month),
        deadline_ms=QUEUE_S * 1000, retry_deadline_ms=(QUEUE_S + 30) * 1000)


def _admit(ctx, request_id: str, *, along: bool = True):
    """What gateway/web/dispatch.py does: the record as it will be if
    admitted on the workload's own reservation, then the admission with it."""
    estimate = _estimate()
    spend = spend_hold_for(ctx, model=MODEL, estimate=estimate)
    record = _provisional(ctx, request_id, spend_month=spend.month if spend is not None else "")
    step = enqueue_along(record, lease_ms=120_000) if along else None
    admission = asyncio.run(request_admit_async(ctx, request_id=request_id, model=MODEL, estimate=estimate,
                                                lease_ms=120_000, spend=spend, along=step))
    return admission, step


def _admit_watched(redis_client, ctx, request_id: str):
    """``_admit`` with Redis's MONITOR on: (admission, step, commands)."""
    monitor = RedisMonitor(redis_client)
    try:
        admission, step = _admit(ctx, request_id)
    finally:
        commands = monitor.stop()
    return admission, step, commands


@pytest.fixture
def price(transactional_db):
    return ModelPrice.objects.create(model=MODEL, input_per_million=Decimal("2.00"), output_per_million=Decimal("8.00"),
                                     effective_from=datetime(2020, 1, 1, tzinfo=dt_timezone.utc))


@pytest.fixture(autouse=True)
def fresh_refusals():
    admission_module._refused_at.clear()
    yield
    admission_module._refused_at.clear()


@pytest.mark.parametrize("priced", [False, True], ids=["no price", "with a spend hold"])
def test_an_admitted_request_is_recorded_and_queued_in_its_admissions_round_trip(make_caller, redis_client, request,
                                                                                  priced):
    if priced:
        request.getfixturevalue("price")
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    # the first admission of a tenant finds its spend caps not in Redis yet:
    # they are rebuilt, and its hold asked again on its own (the step not run)
    _, first = _admit(ctx, f"req_{uuid.uuid4().hex}")
    assert (first.written is None) == priced
    request_id = f"req_{uuid.uuid4().hex}"
    admission, step, commands = _admit_watched(redis_client, ctx, request_id)
    stored = redis_client.hgetall(keys.request_record(request_id))
    written = step.written
    assert written is not None and not admission.borrowed and not admission.held
    # the record in Redis is the one the web process holds, deadlines on the admission's clock
    assert RequestRecord.from_redis(stored) == written
    assert written.admitted_ms == admission.admitted_ms
    assert written.deadline_ms == admission.admitted_ms + QUEUE_S * 1000
    assert written.retry_deadline_ms == admission.admitted_ms + (QUEUE_S + 30) * 1000
    assert written.spend_month == (admission.spend_month if priced else "")
    assert redis_client.pttl(keys.request_record(request_id)) > 100_000
    assert redis_client.zscore(keys.lane_in_flight(ctx.pool_id, written.lane), request_id) == (
        admission.admitted_ms + 120_000)
    # all of it by the admission's one script: no command of the web process's own wrote it
    record_key = keys.request_record(request_id)
    own = [c for kind, c in commands if kind != "lua"]
    by_script = [c for kind, c in commands if kind == "lua"]
    # (other processes' commands show too when the test platform runs: only this request's count)
    admission_key = budget_keys.pool_config(ctx.pool_id)
    assert len([c for c in own if c.startswith("EVALSHA ") and request_id in c and admission_key in c]) == 1
    assert not any(record_key in c for c in own if not c.startswith("EVALSHA "))
    assert any(c.startswith(f"HSET {record_key} ") for c in by_script)
    pushed = [c for c in by_script if c.startswith(f"LPUSH {queue_for_lane(written.lane)} ")]
    assert len(pushed) == 1 and request_id in pushed[0]


def test_a_pool_refusal_writes_nothing(make_caller, redis_client):
    caller = make_caller(rpm=4)  # a burst of one request
    ctx = context_for_workload(caller.workload)
    _admit(ctx, f"req_{uuid.uuid4().hex}")
    refused = f"req_{uuid.uuid4().hex}"
    with pytest.raises(Rejected):
        _admit(ctx, refused)
    assert not redis_client.exists(keys.request_record(refused))


def test_a_spend_refusal_writes_nothing_and_gives_the_lease_back(make_caller, redis_client, price):
    caller = make_caller()
    SpendBudget.objects.create(workload=caller.workload, monthly_amount=Decimal("0.0001"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    request_id = f"req_{uuid.uuid4().hex}"
    with pytest.raises(Rejected) as refused:
        _admit(ctx, request_id)
    assert refused.value.reason == "spend_budget"
    assert not redis_client.exists(keys.request_record(request_id))
    assert not redis_client.exists(budget_keys.lease(ctx.pool_id, request_id))
    assert redis_client.zscore(keys.lane_in_flight(ctx.pool_id, "interactive"), request_id) is None


def test_a_held_request_is_left_to_the_held_set(make_caller, redis_client):
    # a pool whose circuit is open holds new work outside the lanes (gateway/core/held.py)
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    redis_client.hset(budget_keys.pool_capacity(ctx.pool_id), "hold", "1")
    request_id = f"req_{uuid.uuid4().hex}"
    try:
        admission, step = _admit(ctx, request_id)
    finally:
        redis_client.hdel(budget_keys.pool_capacity(ctx.pool_id), "hold")
    assert admission.held and step.written is None
    assert not redis_client.exists(keys.request_record(request_id))


@pytest.mark.parametrize("answer,writes", [
    ("{1, 0, '1', '1', '0', '0', '1000.5', '0'}", True),
    ("{1, 1, '1', '1', '0', '0', '1000.5', '0'}", False),  # a loan: it takes another lane
    ("{1, 0, '1', '1', '0', '0', '1000.5', '1'}", False),  # held outside the lanes
    ("{2, 0, '0', '0', '0', '0', '1000.5', '0'}", False),  # a lease already there (a held body's retry)
    ("{0, 'workload_rpm', '5', '0', '0'}", False),  # refused
], ids=["admitted", "borrowed", "held", "re-admitted", "refused"])
def test_the_step_writes_only_after_an_admission_on_the_workloads_own_reservation(make_caller, redis_client,
                                                                                   answer, writes):
    # an admission's answer as budgets/admission/admit.lua gives it, then the step
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    request_id = f"req_{uuid.uuid4().hex}"
    record = _provisional(ctx, request_id)
    step = enqueue_along(record, lease_ms=120_000)
    admitted = ScriptCall(script=LuaScript.of_source(f"test_admit_{uuid.uuid4().hex}", f"return {answer}"), keys=[], args=[],
                          parse=raw_reply)
    Together((admitted, step.call(admit_step=1, hold_step=0))).run(redis_client)
    assert (step.written is not None) == writes
    assert bool(redis_client.exists(keys.request_record(request_id))) == writes
    if writes:
        assert step.written.admitted_ms == 1000.5 and step.written.deadline_ms == 1000.5 + QUEUE_S * 1000
    # and on its own (a Redis Cluster runs a composed call's steps one by one), it writes nothing
    alone = enqueue_along(replace(record, request_id=f"req_{uuid.uuid4().hex}"), lease_ms=120_000)
    assert alone.call(admit_step=1, hold_step=0).run(redis_client) is None
    assert not redis_client.exists(keys.request_record(alone.record.request_id))


def test_a_workload_refused_a_moment_ago_is_admitted_alone(make_caller, redis_client):
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    admission_module._refused_at[ctx.workload_id] = time.monotonic()
    request_id = f"req_{uuid.uuid4().hex}"
    admission, step = _admit(ctx, request_id)
    assert step.written is None and not redis_client.exists(keys.request_record(request_id))


def test_the_lane_message_is_the_one_the_separate_enqueue_pushes(make_caller, redis_client):
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    request_id = f"req_{uuid.uuid4().hex}"
    _, step, commands = _admit_watched(redis_client, ctx, request_id)
    pushed = next(c for kind, c in commands if kind == "lua" and c.startswith("LPUSH "))
    message = json.loads(pushed.split(" ", 2)[2])
    assert message["headers"]["id"] == request_id and message["headers"]["task"] == "gateway.execute_request"
    assert message["properties"]["delivery_info"]["routing_key"] == queue_for_lane(step.written.lane)

