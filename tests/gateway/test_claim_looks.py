"""The looks of waiting requests (gateway/web/claim_looks.py), against the
real Redis: the looks asked for in one turn of the event loop go in one
round trip, each answered exactly as its own claim would have been; a look
alone is the claim script alone; a failed round trip fails each look in
it; a requester that stops waiting leaves the others their answers."""

from __future__ import annotations

import asyncio

import pytest

from budgets.errors import BudgetUnavailable
from budgets.redis.clients import reset_clients
from gateway.core import keys as gateway_keys
from gateway.core.request.records import (CLAIM, PUBLISHED, QUEUED, REQUEUE, RUNNING, WATCH, WORKER, Outcome, claim_call,
                                          publish_call)
from gateway.web import claim_looks
from gateway.web.claim_looks import claim_look
from tests.gateway.stored import RedisMonitor, admitted

pytestmark = pytest.mark.django_db(transaction=True)

DEAD_WORKER = "worker@lost-host:4242"
LIVE_WORKER = "worker@live-host:4243"


def _in_state(redis_client, caller, request_id: str, state: str):
    """A request waiting in ``state``, as its claims find it."""
    record = admitted(redis_client, caller, request_id)
    if state in (RUNNING, REQUEUE):
        holder = LIVE_WORKER if state == RUNNING else DEAD_WORKER
        assert claim_call(WORKER, record, holder=holder).run().verdict == WORKER
        if state == REQUEUE:  # its worker went silent: its heartbeat ran out
            redis_client.delete(gateway_keys.request_heartbeat(request_id))
    elif state == PUBLISHED:
        assert publish_call(record, Outcome(status="ok", body={}, attempts=1)).run()
    return record


def _evalshas(commands: list[tuple[str, str]], request_ids: list[str]) -> list[str]:
    """The EVALSHAs that name any of these requests."""
    return [text for kind, text in commands
            if kind != "lua" and text.upper().startswith("EVALSHA") and any(r in text for r in request_ids)]


def test_the_looks_of_one_turn_go_in_one_round_trip_each_answered_as_alone(make_caller, redis_client):
    # given 40 waiting requests in every state a look tells apart
    caller = make_caller()
    states = [QUEUED, RUNNING, REQUEUE, PUBLISHED]
    records = [_in_state(redis_client, caller, f"req_look_{i:02d}", states[i % 4]) for i in range(40)]
    ids = [record.request_id for record in records]

    # when they all look in the same turn of the loop
    async def look_all():
        return await asyncio.gather(*(claim_look(record) for record in records))

    monitor = RedisMonitor(redis_client)
    try:
        claims = asyncio.run(look_all())
    finally:
        commands = monitor.stop()

    # then each has the verdict its state gives, the take-overs each once
    assert [claim.verdict for claim in claims] == [states[i % 4] for i in range(40)]
    assert [claim.changed for claim in claims] == [states[i % 4] == REQUEUE for i in range(40)]
    assert all(claim.generation == 1 for claim in claims if claim.verdict == REQUEUE)
    # and a second look at a taken-over request finds it queued again, changed by nobody
    again = claim_call(WATCH, records[2]).run()
    assert (again.verdict, again.generation, again.changed) == (QUEUED, 1, False)
    # and the 40 went in two round trips (32 and 8), not forty; the two are
    # sent at once on two connections, so Redis may run either first
    sent = _evalshas(commands, ids)
    assert len(sent) == 2
    assert sorted(sum(r in text for r in ids) for text in sent) == [40 - claim_looks.LOOKS_AT_ONCE,
                                                                    claim_looks.LOOKS_AT_ONCE]


def test_a_look_alone_is_the_claim_script_alone(make_caller, redis_client):
    caller = make_caller()
    record = _in_state(redis_client, caller, "req_alone", RUNNING)
    monitor = RedisMonitor(redis_client)
    try:
        claim = asyncio.run(claim_look(record))
    finally:
        commands = monitor.stop()
    assert claim.verdict == RUNNING
    (sent,) = _evalshas(commands, [record.request_id])
    assert sent.split()[1].strip('"') == CLAIM.sha


def test_a_requester_that_stops_waiting_leaves_the_others_their_answers(make_caller, redis_client):
    caller = make_caller()
    records = [_in_state(redis_client, caller, f"req_left_{i}", RUNNING) for i in range(3)]

    async def main():
        tasks = [asyncio.create_task(claim_look(record)) for record in records]
        await asyncio.sleep(0)  # all three asked, their round trip not yet answered
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, left, last = asyncio.run(main())
    assert isinstance(left, asyncio.CancelledError)
    assert (first.verdict, last.verdict) == (RUNNING, RUNNING)


def test_a_round_trip_that_fails_fails_each_look_in_it(make_caller, redis_client, settings):
    caller = make_caller()
    records = [_in_state(redis_client, caller, f"req_down_{i}", QUEUED) for i in range(3)]
    # when Redis refuses the connection (nothing listens on port 1)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    reset_clients()
    try:
        async def main():
            return await asyncio.gather(*(claim_look(record) for record in records), return_exceptions=True)

        answers = asyncio.run(main())
    finally:
        reset_clients()
    assert all(isinstance(answer, BudgetUnavailable) for answer in answers), answers
