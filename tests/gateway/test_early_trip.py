"""A delivery's first round trip (its record read, its claim, and its call's
gate and take) sent by the lane worker's consumer as the message arrives
(gateway/worker/execution.py ``delivery_trip_send``, llm_platform/broker.py):
the task that runs it takes the answer instead of asking again, and one
that cannot use it asks as before."""

from __future__ import annotations

import pytest

from budgets.admission.redis_client import Sent
from budgets.errors import BudgetUnavailable
from gateway.core import keys
from gateway.core.enqueue import CallHint, call_hint
from gateway.worker.execution import EARLY_TRIPS, delivery_trip_send, request_execute
from gateway.worker.heartbeat import HEARTBEATS
from tests.gateway.sdk_calls import sdk
from tests.gateway.stored import HELLO, RedisMonitor, admitted, executed_watched

pytestmark = pytest.mark.django_db(transaction=True)


def _claims(commands: list[tuple[str, str]], request_id: str) -> list[str]:
    """The scripts that claimed ``request_id`` as a worker (claim.lua's
    KEYS name its owner and heartbeat; its role is ARGV's 'worker')."""
    owner, heartbeat = keys.request_owner(request_id), keys.request_heartbeat(request_id)
    return [c for kind, c in commands if kind != "lua" and c.startswith("EVALSHA")
            and owner in c and heartbeat in c and " worker " in c]


def test_the_task_takes_the_trip_its_message_sent_and_claims_no_more(platform, caller, redis_client):
    record = admitted(redis_client, caller, "req_early_taken")
    circuit = keys.pool_circuit(record.pool_id)
    monitor = RedisMonitor(redis_client)
    try:
        # the message arrives: its consumer sends the trip (and reads it later)
        sent = delivery_trip_send(args=[record.request_id], kwargs=call_hint(record))
        assert isinstance(sent, Sent) and not sent.read
        outcome = request_execute(request_id=record.request_id, call=CallHint.of(record))
    finally:
        commands = monitor.stop()
    assert outcome == "ok"
    # one claim in all, and the circuit's gate went with it
    claims = _claims(commands, record.request_id)
    assert len(claims) == 1 and circuit in claims[0]
    # the task read its answer: the consumer, reading after it, gets the same
    assert sent.read
    data, claim, verdict, take = sent.result()
    assert data["request_id"] == record.request_id and claim.verdict == "worker" and verdict.go and take is not None
    assert EARLY_TRIPS.take((record.request_id, 0)) is None


def test_a_trip_that_failed_is_asked_again_by_the_task(platform, caller, redis_client):
    record = admitted(redis_client, caller, "req_early_failed")

    def away():
        raise BudgetUnavailable("Redis went away mid-read")
    EARLY_TRIPS.keep((record.request_id, 0), Sent(away))
    outcome, commands = executed_watched(redis_client, record, CallHint.of(record))
    assert outcome == "ok"
    assert len(_claims(commands, record.request_id)) == 1  # its own


def test_a_trip_whose_claim_was_made_but_not_read_is_this_process_own(platform, caller, redis_client):
    # The trip reached Redis (the claim is made) but its answer was lost on
    # the way back: the task's own claim finds this process's heartbeat and
    # carries on as its redelivery, calling the pool once.
    record = admitted(redis_client, caller, "req_early_lost_answer")
    sent = delivery_trip_send(args=[record.request_id], kwargs=call_hint(record))
    sent.result()
    assert redis_client.get(keys.request_owner(record.request_id)) == "worker:0"

    def lost():
        raise BudgetUnavailable("the answer was lost")
    EARLY_TRIPS.take((record.request_id, 0))
    EARLY_TRIPS.keep((record.request_id, 0), Sent(lost))
    assert request_execute(request_id=record.request_id, call=CallHint.of(record)) == "ok"
    rows = redis_client.hgetall(keys.request_record(record.request_id))
    assert rows  # still there: settled once, not dropped


def test_no_trip_is_sent_for_a_request_this_process_runs_or_a_malformed_message(platform, caller, redis_client):
    record = admitted(redis_client, caller, "req_early_running")
    with HEARTBEATS.kept(request_id=record.request_id, generation=0):
        assert delivery_trip_send(args=[record.request_id], kwargs=call_hint(record)) is None
    assert delivery_trip_send(args=[], kwargs={}) is None
    assert delivery_trip_send(args=[record.request_id, "not a generation"], kwargs={}) is None
    assert EARLY_TRIPS.take((record.request_id, 0)) is None
    # nothing was claimed by any of them
    assert redis_client.get(keys.request_owner(record.request_id)) is None


def test_a_duplicate_delivery_takes_its_own_trip_and_drops(platform, caller, redis_client):
    # Two deliveries of one message reach this process together: each takes
    # its own trip, oldest first; the second finds the first's claim
    # (redelivered, this process) and, the request running here, drops.
    record = admitted(redis_client, caller, "req_early_twice")
    first = delivery_trip_send(args=[record.request_id], kwargs=call_hint(record))
    first.result()
    second = delivery_trip_send(args=[record.request_id], kwargs=call_hint(record))
    assert second.result()[1].verdict == "redelivered"
    with HEARTBEATS.kept(request_id=record.request_id, generation=0):
        assert EARLY_TRIPS.take((record.request_id, 0)) is first
        assert request_execute(request_id=record.request_id, call=CallHint.of(record)) == "running"
    assert EARLY_TRIPS.take((record.request_id, 0)) is None


def test_the_lane_worker_sends_the_trip_as_the_message_arrives(platform, caller, redis_client):
    # Through the whole platform: the worker's claim reaches Redis before
    # kombu's unacked entry for the same message is written (it was sent
    # first, on its own connection), where it used to follow that entry's
    # reply and the hand-over to the task.
    client = sdk(platform, caller.api_key)
    monitor = RedisMonitor(redis_client)
    try:
        ids = [client.chat.completions.with_raw_response.create(
            model="sim-small", messages=HELLO, max_tokens=5).headers["x-request-id"] for _ in range(3)]
    finally:
        commands = monitor.stop()
    texts = [c for kind, c in commands if kind != "lua"]
    for request_id in ids:
        (claim,) = _claims(commands, request_id)
        entry = next(i for i, c in enumerate(texts) if c.startswith("HSET") and "unacked" in c and request_id in c)
        assert texts.index(claim) < entry
