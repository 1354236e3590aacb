"""The key cache in one web process (gateway/web/auth.py, cachetools'
TLRUCache): a cached key is kept no later than its expiry, and a revocation the
poll finds drops it at once, however long SLUICE_AUTH_CACHE_S is. Across
processes: tests/gateway/test_key_revocation.py."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import prometheus_client
import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import OperationalError, connection
from django.utils import timezone

from gateway.web import auth
from gateway.web.auth import KeyCheck, key_check
from tenants.models import ApiKey
from tenants.services import api_key_create

check = async_to_sync(key_check)
ADDRESS = "198.51.100.40"


def _connect_kwargs() -> dict:
    """The test database's connection parameters (PostgreSQL: tests run on it)."""
    params = connection.get_connection_params()
    return {k: v for k, v in params.items() if k in ("dbname", "user", "password", "host", "port")}


@pytest.fixture(autouse=True)
def cache_alone(settings, monkeypatch, key_lookups_close_their_connections):
    """A 60 s cache, no revocation poll unless a test runs one, and lookups
    that close their executor threads' connections."""
    settings.SLUICE_AUTH_CACHE_S = 60
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))


def test_a_cached_key_is_kept_no_later_than_its_expiry(make_caller):
    # given a key that expires in a second, checked once (cached "for 60 s")
    caller = make_caller()
    expires = timezone.now() + timedelta(seconds=1)
    raw = api_key_create(workload=caller.workload, name="short", expires_at=expires).raw_key
    started = time.monotonic()
    assert check(raw, address=ADDRESS).context.workload_id == caller.workload.id
    # when it is checked until refused (poll, with a deadline)
    deadline = started + 5
    while check(raw, address=ADDRESS).context is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    # then it was refused from its expiry on, not 60 s later
    assert 0.8 <= time.monotonic() - started <= 1.5


def test_a_revocation_the_poll_finds_drops_the_cached_key(make_caller, monkeypatch):
    # given two cached keys
    revoked, kept = make_caller(), make_caller()
    for caller in (revoked, kept):
        assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    # when one is revoked in the database, the cache still serves it until a poll
    ApiKey.objects.filter(workload=revoked.workload).update(revoked_at=timezone.now())
    assert check(revoked.api_key, address=ADDRESS).context is not None
    monkeypatch.setattr(auth._tick, "next_poll", 0.0)

    async def poll_then_check() -> tuple[bool, KeyCheck, KeyCheck]:
        # the check past the poll's mark starts it and goes on with what the cache holds
        first = await key_check(revoked.api_key, address=ADDRESS)
        started = auth._tick.poll is not None and not auth._tick.poll.done()
        await auth._tick.poll
        return started, first, await key_check(revoked.api_key, address=ADDRESS)

    started, first, after = async_to_sync(poll_then_check)()
    assert started and first.context is not None
    # then once the poll is done the key is refused; the other key still passes
    assert after.context is None
    assert check(kept.api_key, address=ADDRESS).context.workload_id == kept.workload.id


def test_no_check_waits_for_a_poll_the_database_holds_up(make_caller, monkeypatch, settings):
    # given a cached key, a poll due every 50 ms, and the key table locked by
    # another connection (a database that does not answer the poll)
    settings.SLUICE_AUTH_REVOCATION_POLL_S = 0.05
    caller = make_caller()
    assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    monkeypatch.setattr(auth._tick, "next_poll", 0.0)
    locker = psycopg.connect(**_connect_kwargs(), autocommit=False)
    try:
        locker.execute(f"LOCK TABLE {ApiKey._meta.db_table} IN ACCESS EXCLUSIVE MODE")

        async def checks_while_the_poll_waits() -> tuple[list[KeyCheck], bool, int]:
            try:
                # (a bound for a check that waited on the lock, not a timing)
                answers = [await asyncio.wait_for(key_check(caller.api_key, address=ADDRESS), 5) for _ in range(3)]
                poll = auth._tick.poll
                await asyncio.sleep(0.3)  # past the next mark; the poll's query is blocked on the lock meanwhile
                answers.append(await asyncio.wait_for(key_check(caller.api_key, address=ADDRESS), 5))
                held = not poll.done()
                polls = sum(1 for task in asyncio.all_tasks() if task.get_coro().__name__ == "_poll")
            finally:
                locker.rollback()  # the database answers again
            await poll
            return answers, held, polls

        answers, held, polls = async_to_sync(checks_while_the_poll_waits)()
    finally:
        locker.close()
    # then every check was answered from the cache while the poll was held
    # up, and the checks past its mark started no second poll
    assert [a.context.workload_id for a in answers] == [caller.workload.id] * 4
    assert held and polls == 1


def _unanswered(answer: str) -> float:
    """Key checks the database did not answer, by what the caller got (this process's counter)."""
    return prometheus_client.REGISTRY.get_sample_value("sluice_web_key_checks_unanswered_total",
                                                       {"answer": answer}) or 0.0


def _counted_lookups(monkeypatch) -> list[str]:
    """The keys' lookups as they reach the database (one entry each)."""
    started: list[str] = []
    load = auth._load_context

    def counted(raw_key):
        started.append(raw_key)
        return load(raw_key)

    monkeypatch.setattr(auth, "_load_context", counted)
    return started


def test_a_lookup_the_database_holds_up_is_answered_as_the_database_away(make_caller, monkeypatch, settings):
    # given a key checked once whose cache entry has lapsed, a key never
    # checked, lookups waited for 0.3 s, and the key table locked by another
    # connection (a database that holds lookups up instead of failing them)
    settings.SLUICE_AUTH_CACHE_S = 0.1
    settings.SLUICE_AUTH_LOOKUP_WAIT_S = 0.3
    known, unseen = make_caller(), make_caller()
    assert check(known.api_key, address=ADDRESS).context.workload_id == known.workload.id
    time.sleep(0.15)
    lookups = _counted_lookups(monkeypatch)
    served, refused = _unanswered("served"), _unanswered("refused")
    locker = psycopg.connect(**_connect_kwargs(), autocommit=False)
    try:
        locker.execute(f"LOCK TABLE {ApiKey._meta.db_table} IN ACCESS EXCLUSIVE MODE")

        async def checks_while_the_database_holds_the_lookups():
            answers, refusals = [], []
            try:
                # (bounds for a check that waits on the lock, not timings)
                answers.append(await asyncio.wait_for(key_check(known.api_key, address=ADDRESS), 5))
                for _ in range(2):
                    try:
                        await asyncio.wait_for(key_check(unseen.api_key, address=ADDRESS), 5)
                    except OperationalError as exc:
                        refusals.append(str(exc))
                await asyncio.sleep(1.1)  # past the stale entry's retry mark, the lookups still held
                answers += [await asyncio.wait_for(key_check(known.api_key, address=ADDRESS), 5) for _ in range(3)]
                held = [lookup.task for lookup in auth._lookups.get(dict).values()]
                waiting = len(lookups), all(not task.done() for task in held)
            finally:
                locker.rollback()  # the database answers again
            await asyncio.gather(*held)
            after = await key_check(unseen.api_key, address=ADDRESS)
            return answers, refusals, waiting, after, dict(auth._lookups.get(dict))

        answers, refusals, waiting, after, in_flight = async_to_sync(checks_while_the_database_holds_the_lookups)()
    finally:
        locker.close()
    # then the known key was served as last checked, the unseen one refused
    # as the database away (twice, on one lookup), and two lookups in all
    # reached the database while it held them (one per key, not per check)
    assert [a.context.workload_id for a in answers] == [known.workload.id] * 4
    assert len(refusals) == 2 and "did not answer" in refusals[0]
    assert waiting == (2, True)
    # (on /metrics: two checks served as last checked, the other two cached
    # by the first; two refused)
    assert (_unanswered("served") - served, _unanswered("refused") - refused) == (2, 2)
    # and once it answers, the lookup it held fills the cache: the unseen key gets in
    assert after.context.workload_id == unseen.workload.id
    assert in_flight == {}


def test_past_the_lookups_a_process_may_hold_a_new_key_is_not_looked_up(make_caller, monkeypatch, settings):
    # given one lookup in flight at most while the database holds them up
    settings.SLUICE_AUTH_LOOKUP_WAIT_S = 0.2
    monkeypatch.setattr(auth, "LOOKUPS_MAX", 1)
    first, second, third, fourth = make_caller(), make_caller(), make_caller(), make_caller()

    async def at_once(*callers):
        return await asyncio.gather(*(key_check(caller.api_key, address=ADDRESS) for caller in callers))

    # while the database answers, keys beyond it are looked up all the same
    assert [c.context.workload_id for c in async_to_sync(at_once)(third, fourth)] == \
        [third.workload.id, fourth.workload.id]
    # and with the key table locked
    lookups = _counted_lookups(monkeypatch)
    locker = psycopg.connect(**_connect_kwargs(), autocommit=False)
    try:
        locker.execute(f"LOCK TABLE {ApiKey._meta.db_table} IN ACCESS EXCLUSIVE MODE")

        async def two_new_keys():
            errors = []
            try:
                for caller in (first, second):
                    try:
                        await asyncio.wait_for(key_check(caller.api_key, address=ADDRESS), 5)
                    except OperationalError as exc:
                        errors.append(str(exc))
                held = [lookup.task for lookup in auth._lookups.get(dict).values()]
            finally:
                locker.rollback()
            await asyncio.gather(*held)
            return errors

        errors = async_to_sync(two_new_keys)()
    finally:
        locker.close()
    # then the first key's lookup waited out its bound and the second key
    # started none: both were answered as the database away
    assert "did not answer" in errors[0] and "lookups are waiting" in errors[1]
    assert lookups == [first.api_key]


def test_a_key_in_steady_use_is_looked_up_again_before_its_entry_lapses(make_caller, monkeypatch, settings):
    # given a key cached for 2 s (its next lookup due from its last second on),
    # lookups waited for up to 5 s, and its first check's entry
    settings.SLUICE_AUTH_CACHE_S = 2.0
    settings.SLUICE_AUTH_LOOKUP_WAIT_S = 5.0
    caller = make_caller()
    digest = auth._digest(caller.api_key)
    assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    first = auth._valid.get(digest)
    lookups = _counted_lookups(monkeypatch)
    # a check before the entry's last second starts no lookup
    assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    assert lookups == []
    time.sleep(max(0.0, first.refresh_at - time.monotonic()) + 0.01)
    # when it is checked in that last second while the key table is locked
    locker = psycopg.connect(**_connect_kwargs(), autocommit=False)
    try:
        locker.execute(f"LOCK TABLE {ApiKey._meta.db_table} IN ACCESS EXCLUSIVE MODE")

        async def check_while_its_lookup_waits():
            try:
                # (a bound for a check that waited on the lock, not a timing)
                answer = await asyncio.wait_for(key_check(caller.api_key, address=ADDRESS), 1)
                held = [lookup.task for lookup in auth._lookups.get(dict).values()]
                waiting = [not task.done() for task in held]
            finally:
                locker.rollback()  # the database answers again
            await asyncio.gather(*held)
            return answer, waiting

        answer, waiting = async_to_sync(check_while_its_lookup_waits)()
    finally:
        locker.close()
    # then it was answered from the cache while its next lookup waited on the lock
    assert answer.context.workload_id == caller.workload.id
    assert waiting == [True] and lookups == [caller.api_key]
    # and that lookup renewed the entry: past the first entry's end the key
    # is still answered from the cache, with no other lookup
    renewed = auth._valid.get(digest)
    assert renewed.until > first.until
    time.sleep(max(0.0, first.until - time.monotonic()) + 0.01)
    assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    assert lookups == [caller.api_key]
