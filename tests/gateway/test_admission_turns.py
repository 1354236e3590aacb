"""Turns at the door (gateway/web/admission_turns.py): at most N requests
past it at once per event loop, the rest served tenants in turn, then each
tenant's workloads in turn; a place given up or waited out never leaks a
turn. Then through the /v1 ASGI app in this process, against the real Redis
and database: a request of another workload, sent after a storm of one
workload's requests, is answered among the first instead of after the storm."""

from __future__ import annotations

import asyncio
import json

import prometheus_client
import pytest

from gateway.core.lanes import queue_for_lane
from gateway.web import admission_turns, auth
from gateway.web.admission_turns import Door
from tests.asgi_calls import asgi_call

A, B = 1, 2  # tenants


def run(coro):
    return asyncio.run(coro)


async def _queued(door: Door, callers: list[tuple[int, int]], order: list[tuple[int, int, int]]) -> list[asyncio.Task]:
    """One task per caller, each entering in this order and noting when it got in."""

    async def one(i: int, caller: tuple[int, int]) -> None:
        turn = await door.enter(caller)
        order.append((*caller, i))
        await asyncio.sleep(0)
        turn.leave()

    tasks = []
    for i, caller in enumerate(callers):
        tasks.append(asyncio.create_task(one(i, caller)))
        await asyncio.sleep(0)  # enters now: the lines form in this order
    return tasks


def test_a_freed_turn_goes_to_tenants_in_turn_then_to_their_workloads_in_turn():
    async def main():
        door = Door(at_once=1, wait_max_s=60)
        holder = await door.enter((A, 1))
        order: list[tuple[int, int, int]] = []
        tasks = await _queued(door, [(A, 1), (A, 1), (A, 1), (A, 2), (B, 7)], order)
        assert door.waiting == 5 and door.inside == 1
        holder.leave()
        await asyncio.gather(*tasks)
        return order, door

    order, door = run(main())
    # tenant A's first waiter, then tenant B, then A's other workload, then A's line in arrival order
    assert order == [(A, 1, 0), (B, 7, 4), (A, 2, 3), (A, 1, 1), (A, 1, 2)]
    assert door.inside == 0 and door.waiting == 0 and not door.tenants


def test_never_more_than_at_once_inside_under_many_concurrent_callers():
    async def main():
        door = Door(at_once=4, wait_max_s=60)
        inside, most = 0, 0

        async def one(i: int) -> None:
            nonlocal inside, most
            turn = await door.enter((i % 3, i % 5))
            inside += 1
            most = max(most, inside)
            for _ in range(i % 4):
                await asyncio.sleep(0)
            inside -= 1
            turn.leave()
            turn.leave()  # leaving twice hands on one turn, not two

        await asyncio.gather(*(one(i) for i in range(300)))
        return most, door

    most, door = run(main())
    assert most == 4
    assert door.inside == 0 and not door.tenants


def test_a_waiter_that_is_cancelled_gives_its_place_up():
    async def main():
        door = Door(at_once=1, wait_max_s=60)
        holder = await door.enter((A, 1))
        order: list[tuple[int, int, int]] = []
        gone, stays = await _queued(door, [(B, 1), (B, 1)], order)
        gone.cancel()
        await asyncio.sleep(0)
        holder.leave()
        await stays
        return order, door, gone

    order, door, gone = run(main())
    assert gone.cancelled()
    assert order == [(B, 1, 1)]
    assert door.inside == 0 and not door.tenants


def test_a_turn_handed_to_a_request_cancelled_before_it_runs_goes_on_to_the_next():
    async def main():
        door = Door(at_once=1, wait_max_s=60)
        holder = await door.enter((A, 1))
        order: list[tuple[int, int, int]] = []
        handed, next_one = await _queued(door, [(B, 1), (A, 2)], order)
        holder.leave()  # B's waiter has its turn now, its task has not run yet
        handed.cancel()
        await asyncio.gather(handed, next_one, return_exceptions=True)
        return order, door, handed

    order, door, handed = run(main())
    assert handed.cancelled()
    assert order == [(A, 2, 1)]
    assert door.inside == 0


def test_a_request_waits_at_most_its_bound_then_goes_on_without_a_turn():
    async def main():
        door = Door(at_once=1, wait_max_s=0.05)
        holder = await door.enter((A, 1))
        late = await door.enter((B, 1))  # the holder never leaves in time
        inside_then = door.inside
        holder.leave()
        late.leave()  # held no turn: hands none on
        return late, inside_then, door

    late, inside_then, door = run(main())
    assert not late.held
    assert inside_then == 1
    assert door.inside == 0 and not door.tenants


def _metric(name: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name) or 0.0


def test_the_metrics_count_who_waits_at_the_door_and_who_waited_it_out():
    waiting_before = _metric("sluice_web_door_waiting")
    waited_out_before = _metric("sluice_web_door_waited_out_total")

    def waiting() -> float:
        return _metric("sluice_web_door_waiting") - waiting_before

    async def main():
        door = Door(at_once=1, wait_max_s=0.2)
        holder = await door.enter((A, 1))  # a free turn: nothing recorded
        seen = {"free turn": waiting()}
        served, cancelled, late = (asyncio.create_task(door.enter(caller)) for caller in ((B, 1), (A, 2), (A, 3)))
        await asyncio.sleep(0)
        seen["three waiting"] = waiting()
        cancelled.cancel()
        await asyncio.sleep(0)
        seen["one cancelled"] = waiting()
        holder.leave()
        turn = await served  # B keeps its turn past A 3's bound
        seen["one served"] = waiting()
        late_turn = await late
        seen["none"] = waiting()
        turn.leave()
        late_turn.leave()
        return seen, late_turn, door

    seen, late_turn, door = run(main())
    assert seen == {"free turn": 0, "three waiting": 3, "one cancelled": 2, "one served": 1, "none": 0}
    # A 3 waited its bound and went on without a turn, counted once; the cancelled one is not
    assert not late_turn.held
    assert _metric("sluice_web_door_waited_out_total") - waited_out_before == 1
    assert door.inside == 0


# -- through the /v1 app ---------------------------------------------------------

STORM = 200
ROUNDS = 3
# Where another tenant's request may come among the storm's answers with turns.
GATED_PLACE_MAX = 20


def _scope(api_key: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"authorization", f"Bearer {api_key}".encode())]}


async def _post(app, api_key: str) -> int:
    body = json.dumps({"model": "sim-small", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    sent = await asgi_call(app, _scope(api_key, body), body)
    return sent[0]["status"]


def _storms_then_one(storm_keys: list[str], other_key: str, warm: list[str],
                     rounds: int = ROUNDS) -> tuple[list[int], set[int]]:
    """``rounds`` times: ``storm_keys``' requests started together, then
    ``other_key``'s; where the other's answer came among them each time,
    and every status seen."""
    from llm_platform.asgi import application

    async def main():
        for key in warm:  # each key's one request (200), which also has the process poll the issued keys
            assert await _post(application, key) == 200
        places: list[int] = []
        statuses: set[int] = set()
        for _ in range(rounds):
            finished: list[str] = []

            async def one(key: str, name: str) -> None:
                statuses.add(await _post(application, key))
                finished.append(name)

            tasks = [asyncio.create_task(one(key, "storm")) for key in storm_keys]
            tasks.append(asyncio.create_task(one(other_key, "other")))
            await asyncio.gather(*tasks)
            places.append(finished.index("other"))
        return places, statuses

    return asyncio.run(main())


@pytest.fixture
def refusing(platform, make_caller, settings, key_lookups_close_their_connections):
    """Two workloads of two tenants on the platform's pool, each with a
    bucket of one request (RPM 4: a request per 15 s), spent by its warm-up:
    every request after it is refused (429), so a request's whole path
    through the door is its admission."""
    settings.SLUICE_AUTH_CACHE_S = 60
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    storm = make_caller(pool=pool, rpm=4)
    other = make_caller(pool=pool, rpm=4)
    admission_turns._doors.clear()
    auth._valid.clear()
    auth._throttled.clear()
    auth._tick.next_poll = 0.0  # the next request starts a poll: the door knows both keys once it is done
    return storm, other


@pytest.mark.django_db(transaction=True)
def test_another_tenants_request_is_answered_among_the_first_of_a_storm(refusing, settings):
    storm, other = refusing
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 4
    places, statuses = _storms_then_one([storm.api_key] * STORM, other.api_key, warm=[storm.api_key, other.api_key])
    assert statuses == {429}
    # it enters sixth each time (four were inside, the storm's line had the
    # rotation's first turn); while its own awaits run (a revocation poll,
    # say) a few more of the storm's answers may go out before it, never the
    # storm's bulk
    assert max(places) <= GATED_PLACE_MAX, places


@pytest.mark.django_db(transaction=True)
def test_without_turns_the_same_request_comes_anywhere_in_the_storm(refusing, settings):
    # the measure of the test above: without turns the loop resumes the
    # requests in the order their sockets are ready, so the other request's
    # place is a draw among the storm's; in three storms it lands past the
    # bound above at least once (all three within it: about one in a thousand)
    storm, other = refusing
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 0
    places, statuses = _storms_then_one([storm.api_key] * STORM, other.api_key, warm=[storm.api_key, other.api_key])
    assert statuses == {429}
    assert max(places) > GATED_PLACE_MAX, places


@pytest.mark.django_db(transaction=True)
def test_a_flood_of_unknown_keys_is_one_line_in_the_rotation(refusing, settings):
    storm, other = refusing
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 4
    made_up = [f"sk-sluice-madeup{i:04d}" for i in range(STORM)]
    places, statuses = _storms_then_one(made_up, other.api_key, warm=[storm.api_key, other.api_key])
    assert statuses <= {401, 429}
    assert max(places) <= GATED_PLACE_MAX, places


@pytest.mark.django_db(transaction=True)
def test_a_request_waits_as_its_tenants_key_or_in_the_unknown_line(make_caller, monkeypatch,
                                                                   key_lookups_close_their_connections):
    # caller_line looks nothing up: it places a request by the keys the process knows were issued
    caller = make_caller()
    header = f"Bearer {caller.api_key}"
    monkeypatch.setattr(auth._issued, "digests", None)
    monkeypatch.setattr(auth._issued, "last_id", 0)
    assert auth.caller_line(header) is None  # before the first poll: not known yet
    asyncio.run(auth._poll())  # the poll loads every key issued
    digest = auth._digest(caller.api_key)
    # the same line for its first request and every later one, cached or not
    assert auth.caller_line(header) == (caller.tenant.id, digest)
    asyncio.run(auth.key_check(caller.api_key, address="198.51.100.41"))
    assert auth.caller_line(header) == (caller.tenant.id, digest)
    assert auth.caller_line(None) is None
    assert auth.caller_line("Basic abc") is None
    assert auth.caller_line("Bearer sk-sluice-made-up") is None
    # a revoked key is no longer placed
    auth._revocations_apply([digest])
    assert auth.caller_line(header) is None


@pytest.mark.django_db(transaction=True)
def test_an_admitted_request_waiting_for_its_worker_holds_no_turn(redis_of_its_own, make_caller, settings,
                                                                  key_lookups_close_their_connections):
    # given one turn, and a request admitted and queued that no worker runs
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 1
    settings.SLUICE_REDIS_BUSY_WAIT_S = 60.0  # a turn never held would not be waited out within the test
    settings.SLUICE_AUTH_CACHE_S = 60
    admission_turns._doors.clear()
    pool = make_caller.pool()
    waiting = make_caller(pool=pool, queue_timeout_s=30)
    # a bucket smaller than one request: each of its requests is answered 413 at its admission
    refused = make_caller(pool=pool, rpm=1)
    auth._throttled.clear()  # an earlier test's flood of made-up keys from this address
    auth._tick.next_poll = 0.0  # the first request polls: both keys known as issued
    from llm_platform.asgi import application

    async def main():
        assert await _post(application, refused.api_key) == 413
        queued = asyncio.create_task(_post(application, waiting.api_key))
        while not redis_of_its_own.llen(queue_for_lane("interactive")):
            await asyncio.sleep(0.01)  # until it is on its lane (no worker reads this database)
        # when another request comes while the first still waits for its worker
        status = await asyncio.wait_for(_post(application, refused.api_key), timeout=10)
        still_waiting = not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        return status, still_waiting

    status, still_waiting = run(main())
    # then it was answered through the door while the first was still waiting
    assert status == 413
    assert still_waiting


@pytest.mark.django_db(transaction=True)
def test_a_caller_trickling_its_body_holds_no_turn(make_caller, settings, key_lookups_close_their_connections):
    # given one turn, and a request whose head came but whose body never does
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 1
    settings.SLUICE_REDIS_BUSY_WAIT_S = 60.0  # a held turn would not be waited out within the test
    admission_turns._doors.clear()
    refused = make_caller(rpm=1)  # every request 413 at its admission: a bucket smaller than one
    auth._throttled.clear()  # an earlier test's flood of made-up keys from this address
    from llm_platform.asgi import application

    async def main():
        body = b'{"model": "sim-small", "messages": []}'

        async def never():
            await asyncio.sleep(3600)

        async def ignore(message):
            pass

        slow = asyncio.create_task(application(_scope(refused.api_key, body), never, ignore))
        await asyncio.sleep(0.1)
        # when another request comes
        status = await asyncio.wait_for(_post(application, refused.api_key), timeout=10)
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        return status

    # then it went through the door while the first still waited for its body
    assert run(main()) == 413
