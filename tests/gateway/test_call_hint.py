"""A lane message's call hint (gateway/core/request/enqueue.py ``CallHint``): the
first delivery of a request on a lane with no slot to wait for asks its pool
call's circuit gate and provider take in the round trip of its claim
(gateway/worker/execution.py), and only when that claim makes it the
request's owner. Watched with Redis's own MONITOR against the platform's
simulator."""

from __future__ import annotations


import pytest

from budgets.admission import keys as budget_keys
from gateway.core import keys
from gateway.core.request.enqueue import CallHint, call_hint
from gateway.core.request.records import RequestRecord
from gateway.worker.execution import request_execute
from tests.gateway.stored import admitted, executed_watched

pytestmark = pytest.mark.django_db(transaction=True)


def _scripts_naming(commands: list[tuple[str, str]], text: str) -> list[str]:
    return [c for kind, c in commands if kind != "lua" and c.startswith(("EVALSHA", "EVAL")) and text in c]


def test_the_hint_says_what_the_record_says_and_a_bad_one_is_none():
    record = RequestRecord(request_id="req_h", tenant_id=1, workload_id=2, pool_id=3, pool_base_url="http://p/v1",
                           pool_api_key_env="", model="m", lane="interactive", borrowed=True,
                           estimated_input_tokens=5, estimated_output_tokens=7, admitted_ms=0, deadline_ms=0,
                           payload={})
    assert call_hint(record) == {"call": "3:12:interactive:1"}
    assert CallHint.parse(call_hint(record)["call"]) == CallHint.of(record)
    # a lane whose calls wait for a slot first asks its gate then, not with its claim
    assert call_hint(RequestRecord(**{**record.__dict__, "lane": "interactive-long"})) == {}
    for bad in ("", "3:12:interactive", "x:12:interactive:0", "3:12:a:b:c"):
        assert CallHint.parse(bad) is None


def test_a_first_delivery_asks_its_gate_and_take_with_its_claim(platform, caller, redis_client):
    record = admitted(redis_client, caller, "req_hinted")
    outcome, commands = executed_watched(redis_client, record, CallHint.of(record))
    assert outcome == "ok"
    gated = _scripts_naming(commands, keys.pool_circuit(record.pool_id))
    # the first script that names the pool's circuit is the claim's: one round trip
    assert gated and keys.request_owner(record.request_id) in gated[0]
    assert budget_keys.pool_capacity(record.pool_id) in gated[0]  # the provider's room, taken in it too


def test_without_a_hint_the_gate_is_its_own_round_trip(platform, caller, redis_client):
    record = admitted(redis_client, caller, "req_unhinted")
    outcome, commands = executed_watched(redis_client, record, None)
    assert outcome == "ok"
    gated = _scripts_naming(commands, keys.pool_circuit(record.pool_id))
    assert gated and keys.request_owner(record.request_id) not in gated[0]


def test_a_delivery_that_does_not_own_the_request_asks_no_gate(platform, caller, redis_client):
    # given a request whose owner is already its delivery 1 (taken over from a lost worker),
    # and a circuit whose open period has just ended: the next gate asked becomes its trial
    record = admitted(redis_client, caller, "req_superseded")
    redis_client.set(keys.request_owner(record.request_id), "queued:1")
    circuit = keys.pool_circuit(record.pool_id)
    redis_client.hset(circuit, mapping={"state": "open", "open_until_ms": 0, "trial_until_ms": 0, "trial_holder": ""})
    try:
        # when the old delivery 0's message comes, with its hint
        assert request_execute(request_id=record.request_id, call=CallHint.of(record)) == "superseded"
        # then it asked no gate: the circuit has no trial
        assert redis_client.hget(circuit, "trial_holder") == ""
        assert redis_client.hget(circuit, "state") == "open"
    finally:
        redis_client.delete(circuit)


def test_a_hint_that_is_not_the_record_is_asked_again(platform, caller, redis_client, caplog):
    record = admitted(redis_client, caller, "req_misled")
    wrong = CallHint(pool_id=record.pool_id, tokens=1, lane=record.lane, borrowed=False)
    outcome, commands = executed_watched(redis_client, record, wrong)
    assert outcome == "ok"
    assert "is not its record's" in caplog.text
    # asked with the claim (on the hint), then again on the record's own figures
    assert len(_scripts_naming(commands, keys.pool_circuit(record.pool_id))) >= 2
