"""Named script calls in one round trip (budgets.redis.composition
RoundTrip): the worker reports a pool answer to the circuit, the lane
limits, the pool's capacity and its retry budget as one composed script. The
composed run must leave Redis exactly as the calls run one by one, and
return what each would have returned, by step name. Steps under different
hash tags are composed on a single Redis and run one by one on a cluster;
a step's condition names the earlier step it reads."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from budgets.admission import keys as budget_keys
from budgets.admission.capacity import capacity_signal_call
from budgets.redis.composition import RoundTrip, Step, answered, plan_run
from budgets.redis.scripts import LuaScript, ScriptCall, raw_reply
from gateway.core import keys
from gateway.core.protection.circuit import circuit_record_call
from gateway.core.protection.concurrency import lane_limit_call
from gateway.core.request.records import Outcome, RequestRecord
from gateway.worker.lane_slot import SlotHold, lane_signal_steps
from gateway.worker.retry import RetryPolicy, retry_budget_earn_call

pytestmark = pytest.mark.django_db(transaction=True)

TIMES = ("_ms", "_at", "opened")  # fields holding Redis's clock: differ between two runs


def _answer_steps(pool_id: int) -> list[Step]:
    """A 429 answer on the pool: the circuit hears the pool is there, the
    lane limits and the capacity back off, the retry budget is earned."""
    return [
        Step("circuit", circuit_record_call(pool_id=pool_id, holder="req_a", ok=True)),
        Step("lane_limit", lane_limit_call(pool_id=pool_id, event="throttle", value=0, extra=0)),
        Step("capacity", capacity_signal_call(pool_id=pool_id, event="throttle", retry_after_ms=2_000)),
        Step("retry_budget", retry_budget_earn_call(pool_id=pool_id, policy=RetryPolicy.from_settings())),
    ]


def _state(redis_client, pool_id: int) -> dict:
    names = [keys.pool_circuit(pool_id), keys.lane_limits(pool_id), budget_keys.pool_capacity(pool_id),
             keys.pool_retry(pool_id)]
    out = {}
    for name in names:
        fields = redis_client.hgetall(name) if redis_client.type(name) == "hash" else redis_client.type(name)
        if isinstance(fields, dict):  # a workload's own field (its id differs between the pools) by its role
            fields = {("W" + k[k.index("."):] if k.split(".")[0].isdigit() else k): v for k, v in fields.items()
                      if not k.endswith(TIMES)}
        out[name.replace(f"pool:{pool_id}", "pool:N")] = fields
    return out


def test_one_composed_run_leaves_redis_as_the_calls_one_by_one(make_caller, redis_client):
    # given two pools in the same starting state (the capacity script reads the pool's config)
    one, other = make_caller().pool.id, make_caller().pool.id

    # when the same answer is reported to one pool call by call, and to the other composed
    separate = {step.name: step.call.run() for step in _answer_steps(one)}
    together = RoundTrip(*_answer_steps(other)).run()

    # then each call returned the same, and Redis holds the same state
    assert together == separate
    assert together["capacity"] == 0.5  # the capacity halved on the throttle
    assert together["lane_limit"][0] == "decreased"
    assert _state(redis_client, other) == _state(redis_client, one)
    assert redis_client.hget(keys.lane_limits(other), "decreases") == "1"


def test_a_step_that_returns_nothing_keeps_its_place(redis_client):
    # given a script that returns nil between two that return values
    nothing = LuaScript.of_source("test/nothing", "redis.call('SET', KEYS[1], ARGV[1])\nreturn nil")
    echo = LuaScript.of_source("test/echo", "return {KEYS[1], ARGV[1], ARGV[2]}")
    steps = [Step("a", ScriptCall(script=echo, keys=["{t}:a"], args=["x", "y"], parse=list)),
             Step("b", ScriptCall(script=nothing, keys=["{t}:b"], args=["set"], parse=lambda raw: raw)),
             Step("c", ScriptCall(script=echo, keys=["{t}:c"], args=[1, 2], parse=list))]

    # when
    results = RoundTrip(*steps).run()

    # then every step ran on its own KEYS and ARGV, the nil one as None
    assert results == {"a": ["{t}:a", "x", "y"], "b": None, "c": ["{t}:c", "1", "2"]}
    assert redis_client.get("{t}:b") == "set"
    redis_client.delete("{t}:b")


@pytest.mark.parametrize("lane, answer, expected", [
    ("interactive", Outcome(status="ok", upstream_ms=100, output_tokens=9, upstream_status=200),
     ["circuit.lua", "lane_limit.lua"]),
    ("interactive-long", Outcome(status="ok", upstream_ms=100, output_tokens=9, upstream_status=200),
     ["circuit.lua", "lane_limit.lua"]),
    ("batch", Outcome(status="upstream_error", upstream_status=429), ["circuit.lua", "lane_limit.lua"]),
    ("interactive", Outcome(status="upstream_error", upstream_status=503), ["circuit.lua"]),
])
def test_the_worker_reports_an_answer_to_the_scripts_it_concerns(lane, answer, expected):
    record = RequestRecord(
        request_id="req_0123abcd", tenant_id=1, workload_id=2, pool_id=3, pool_base_url="http://pool/v1",
        pool_api_key_env="", model="m", lane=lane, borrowed=False, estimated_input_tokens=1,
        estimated_output_tokens=1, admitted_ms=0.0, deadline_ms=1.0, payload={},
    )
    steps = lane_signal_steps(record, answer, hold=SlotHold(held=True, in_use=1))
    assert [step.call.script.name.rsplit("/", 1)[1] for step in steps] == expected
    assert steps[0].call.args[0] == ("fail" if answer.upstream_status == 503 else "ok")


ECHO = LuaScript.of_source("test/echo-keys", "return {KEYS[1], ARGV[1]}")
BUMP = LuaScript.of_source("test/bump", "return redis.call('INCRBY', KEYS[1], ARGV[1])")
REFUSE = LuaScript.of_source("test/refuse", "return redis.error_reply('refused here')")


def _tagged_steps() -> tuple[Step, ...]:
    # keys under three different hash tags: a pool's, a request's, a tenant's
    return (Step("pool", ScriptCall(script=BUMP, keys=["sluice:test:{pool:9}:n"], args=[2], parse=int)),
            Step("request", ScriptCall(script=ECHO, keys=["sluice:test:{req_x}:e"], args=["hi"], parse=tuple)),
            Step("tenant", ScriptCall(script=BUMP, keys=["sluice:test:{tenant:9}:n"], args=[5],
                                      parse=lambda raw: -int(raw))))


@pytest.mark.redis_cluster
def test_steps_of_different_hash_tags_run_in_order_each_parsed(redis_client):
    # given steps whose keys a cluster keeps in different slots
    # when they run in a round trip, sync and async (on a cluster: one by one; on a single Redis: composed)
    import asyncio

    first = RoundTrip(*_tagged_steps()).run()
    second = asyncio.run(RoundTrip(*_tagged_steps()).run_async())

    # then each ran once per run, in order, and came back parsed by its own call, under its name
    assert first == {"pool": 2, "request": ("sluice:test:{req_x}:e", "hi"), "tenant": -5}
    assert second == {"pool": 4, "request": ("sluice:test:{req_x}:e", "hi"), "tenant": -10}
    assert redis_client.get("sluice:test:{pool:9}:n") == "4"
    assert redis_client.delete("sluice:test:{pool:9}:n", "sluice:test:{tenant:9}:n") == 2


@pytest.mark.redis_cluster
def test_a_step_that_fails_stops_the_ones_after_it(redis_client):
    steps = (Step("before", ScriptCall(script=BUMP, keys=["sluice:test:{pool:9}:m"], args=[1], parse=int)),
             Step("refuse", ScriptCall(script=REFUSE, keys=["sluice:test:{req_x}:r"], args=[], parse=raw_reply)),
             Step("after", ScriptCall(script=BUMP, keys=["sluice:test:{tenant:9}:m"], args=[1], parse=int)))
    with pytest.raises(redis.exceptions.ResponseError, match="refused here"):
        RoundTrip(*steps).run()
    assert redis_client.get("sluice:test:{pool:9}:m") == "1"  # the one before ran
    assert redis_client.get("sluice:test:{tenant:9}:m") is None  # the one after did not
    redis_client.delete("sluice:test:{pool:9}:m")


@pytest.mark.redis_cluster
def test_a_plan_step_of_a_round_trip_gets_its_answers(redis_client):
    def plan():
        answers = yield RoundTrip(*_tagged_steps())
        return answers["pool"], answers["request"][1], answers["tenant"]

    assert plan_run(plan()) == (2, "hi", -5)
    redis_client.delete("sluice:test:{pool:9}:n", "sluice:test:{tenant:9}:n")


def test_on_a_single_redis_a_round_trip_is_one_script(redis_client):
    if settings.SLUICE_REDIS_CLUSTER:
        pytest.skip("a cluster runs them one by one")
    redis_client.config_resetstat()
    RoundTrip(*_tagged_steps()).run()
    stats = redis_client.info("commandstats")
    # one EVALSHA (the composed script), whose steps ran inside it
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert stats["cmdstat_incrby"]["calls"] == 2
    redis_client.delete("sluice:test:{pool:9}:n", "sluice:test:{tenant:9}:n")


STATUS = LuaScript.of_source("test/status", "return {ARGV[1], 'detail'}")


@pytest.mark.redis_cluster
@pytest.mark.parametrize("first, runs", [("go", True), ("1", True), ("wait", False), ("0", False)])
def test_a_step_runs_only_when_the_step_it_names_answered_one_of_its_values(redis_client, first, runs):
    import asyncio

    steps = (Step("status", ScriptCall(script=STATUS, keys=["sluice:test:{pool:9}:s"], args=[first], parse=tuple)),
             Step("bump", ScriptCall(script=BUMP, keys=["sluice:test:{tenant:9}:g"], args=[1], parse=int),
                  only_if=answered("status", "go", 1)),
             # reads the bump, which answers a number, never a table: always skipped
             Step("never", ScriptCall(script=BUMP, keys=["sluice:test:{tenant:9}:h"], args=[1], parse=int),
                  only_if=answered("bump", 1, 2)),
             # reads the first step, not the one just before it
             Step("also", ScriptCall(script=BUMP, keys=["sluice:test:{tenant:9}:a"], args=[1], parse=int),
                  only_if=answered("status", "go", 1)))
    runs_of = (RoundTrip(*steps).run(), asyncio.run(RoundTrip(*steps).run_async()))
    for n, answers in enumerate(runs_of, start=1):
        assert answers["status"] == (first, "detail")
        assert answers["bump"] == (n if runs else None)
        assert answers["never"] is None
        assert answers["also"] == (n if runs else None)
    assert redis_client.get("sluice:test:{tenant:9}:g") == ("2" if runs else None)
    assert redis_client.get("sluice:test:{tenant:9}:h") is None
    redis_client.delete("sluice:test:{tenant:9}:g", "sluice:test:{tenant:9}:a")


def test_a_round_trip_refuses_repeated_names_and_conditions_on_later_steps():
    bump = ScriptCall(script=BUMP, keys=["{t}:n"], args=[1], parse=int)
    with pytest.raises(ValueError, match="repeat"):
        RoundTrip(Step("a", bump), Step("a", bump))
    with pytest.raises(ValueError, match="does not come before"):
        RoundTrip(Step("a", bump, only_if=answered("b", 1)), Step("b", bump))
