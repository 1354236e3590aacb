"""API keys under attack: unknown keys are counted per client address in
Redis and answered 429 past the limit, while valid keys from that address
still get in; a flood of random keys does not push valid keys out of the
key cache; the client address is REMOTE_ADDR unless a trusted proxy vouches
for another (uvicorn's own X-Forwarded-For handling is off)."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from gateway.core.protection.throttle import address_subject, api_key_address_budget, client_address
from gateway.web import auth
from gateway.web.auth import key_check
from tenants.models import ApiKey

check = async_to_sync(key_check)


def random_key() -> str:
    return "sk-sluice-" + secrets.token_urlsafe(32)


@pytest.fixture(autouse=True)
def lookups_close_their_connections(key_lookups_close_their_connections):
    """Key lookups close their executor threads' connections (tests/gateway/conftest.py)."""


@pytest.fixture
def small_caches(settings, monkeypatch):
    """Key caches of 8 entries each, so a flood overflows them in a test."""
    monkeypatch.setattr(auth, "_valid", auth.key_cache(8))
    monkeypatch.setattr(auth, "_unknown", auth.key_cache(8))


def test_a_flood_of_random_keys_does_not_evict_valid_keys(settings, make_caller, small_caches, monkeypatch):
    settings.SLUICE_AUTH_CACHE_S = 60
    # the cache alone: no revocation poll in this test (tests/gateway/test_key_revocation.py has it)
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 0  # no throttle: the caches alone
    caller = make_caller()
    # given a valid key in the cache
    assert check(caller.api_key, address="198.51.100.7").context.workload_id == caller.workload.id
    # when 100 random keys (12 times the cache) arrive
    flood = [random_key() for _ in range(100)]
    assert all(check(key, address="198.51.100.66").context is None for key in flood)
    # then the unknown-key cache kept the last 8, least recently used out
    # first, and the valid key is still served from its cache: revoked
    # meanwhile (the revocation poll held off), it still passes, so no lookup happened
    remembered = [auth._kept(auth._unknown, auth._digest(key)) for key in flood]
    assert remembered == [None] * 92 + [True] * 8
    ApiKey.objects.filter(workload=caller.workload).update(revoked_at=timezone.now())
    assert check(caller.api_key, address="198.51.100.7").context.workload_id == caller.workload.id


def test_unknown_keys_from_one_address_are_refused_past_the_limit(settings, make_caller, small_caches, redis_client):
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 5
    settings.SLUICE_API_KEY_FAILURE_WINDOW_S = 60
    caller = make_caller()
    # given a valid key in use from the attacker's address
    assert check(caller.api_key, address="203.0.113.9").context is not None
    # when that address tries six unknown keys
    results = [check(random_key(), address="203.0.113.9") for _ in range(6)]
    # then five were answered 401 and the sixth 429 with the window's rest
    assert [r.retry_after_ms is None for r in results] == [True] * 5 + [False]
    assert 58_000 <= results[-1].retry_after_ms <= 60_000
    # and the key it already holds (cached) still works, another address is unaffected
    assert check(caller.api_key, address="203.0.113.9").context is not None
    assert check(random_key(), address="192.0.2.10").retry_after_ms is None
    # and the valid key cost the address no attempt: only the failures count
    key = api_key_address_budget().counter_key("203.0.113.9")
    assert redis_client.get(key) == "5"


def test_concurrent_unknown_keys_pass_the_limit_exactly(settings, make_caller, small_caches):
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 5
    # The 40 lookups wait for the database as long as they take: on a loaded
    # host the last of them can pass the default 2 s bound, and a check past
    # it raises (a 503) instead of answering. The bound has its own tests
    # (test_auth_cache.py); this one is about the budget's count.
    settings.SLUICE_AUTH_LOOKUP_WAIT_S = 60.0
    make_caller()
    barrier = threading.Barrier(40)
    results = []
    lock = threading.Lock()

    def attempt():
        barrier.wait()
        result = check(random_key(), address="203.0.113.50")
        with lock:
            results.append(result)

    # when 40 threads try unknown keys at the same moment
    threads = [threading.Thread(target=attempt) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # then exactly 5 were answered 401, 35 refused with a 429
    assert len(results) == 40
    assert sum(r.retry_after_ms is None for r in results) == 5


def test_ipv6_addresses_are_counted_per_64_so_one_host_cannot_rotate_through_its_prefix(settings, make_caller,
                                                                                      small_caches):
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 3
    make_caller()
    results = [check(random_key(), address=f"2001:db8:1:2::{n:x}") for n in range(1, 5)]
    assert [r.retry_after_ms is None for r in results] == [True, True, True, False]
    assert check(random_key(), address="2001:db8:1:3::1").retry_after_ms is None  # the next /64
    assert address_subject("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert address_subject("::ffff:203.0.113.5") == "203.0.113.5"
    assert address_subject("203.0.113.5") == "203.0.113.5"
    assert address_subject("unknown") == "unknown"


@pytest.mark.parametrize("remote,forwarded,trusted,expected", [
    ("203.0.113.9", "", (), "203.0.113.9"),
    ("203.0.113.9", "198.51.100.1", (), "203.0.113.9"),  # nobody trusted: the header is the client's word
    ("10.0.0.2", "198.51.100.1", ("10.0.0.0/8",), "198.51.100.1"),
    ("10.0.0.2", "6.6.6.6, 198.51.100.1", ("10.0.0.0/8",), "198.51.100.1"),  # a spoofed left part proves nothing
    ("10.0.0.2", "198.51.100.1, 10.0.0.9", ("10.0.0.0/8",), "198.51.100.1"),  # two proxies deep
    ("10.0.0.2", "not-an-ip, 10.0.0.9", ("10.0.0.0/8",), "10.0.0.9"),
    ("10.0.0.2", "", ("10.0.0.0/8",), "10.0.0.2"),
    ("203.0.113.9", "198.51.100.1", ("10.0.0.0/8",), "203.0.113.9"),  # not from a trusted proxy
    ("::1", "2001:db8::5", ("::1",), "2001:db8::5"),
])
def test_the_client_address_believes_x_forwarded_for_only_from_trusted_proxies(settings, remote, forwarded, trusted,
                                                                                expected):
    settings.SLUICE_TRUSTED_PROXIES = trusted
    assert client_address(remote_addr=remote, forwarded_for=forwarded) == expected


@pytest.mark.django_db(transaction=True)
def test_the_gateway_answers_429_after_too_many_unknown_keys_from_one_address(platform, make_caller):
    limit = int(platform.env["SLUICE_API_KEY_FAILURES_PER_ADDRESS"])
    url = f"{platform.base_url}/v1/chat/completions"
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=10) as client:
        # when one address sends `limit` unknown keys, then one more
        answers = [client.post(url, json=body, headers={"Authorization": f"Bearer {random_key()}"})
                   for _ in range(limit + 1)]
    # then the first `limit` are 401s and the next a 429 in OpenAI's shape with Retry-After
    assert [a.status_code for a in answers] == [401] * limit + [429]
    assert answers[0].json()["error"]["code"] == "invalid_api_key"
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "too_many_invalid_api_keys"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert 0 < int(refused.headers["retry-after-ms"]) <= 60_000


def _counted_lookups(monkeypatch) -> list[str]:
    """Every _load_context call, counted (the real lookup still runs)."""
    load, calls = auth._load_context, []

    def counted(raw_key):
        calls.append(raw_key)
        return load(raw_key)

    monkeypatch.setattr(auth, "_load_context", counted)
    return calls


def _together(raw_key: str, address: str, n: int) -> tuple[list, dict]:
    """n checks of one key at once, and the lookups left in flight on their loop after them."""
    async def run():
        results = await asyncio.gather(*(key_check(raw_key, address=address) for _ in range(n)))
        return results, dict(auth._lookups.get(dict))
    return async_to_sync(run)()


def test_concurrent_callers_of_one_uncached_key_share_one_lookup(settings, make_caller, small_caches, monkeypatch):
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))  # the cache alone
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 3
    caller = make_caller()
    lookups = _counted_lookups(monkeypatch)
    # when 20 callers of one valid key arrive together in one web process with a cold cache
    results, in_flight = _together(caller.api_key, "198.51.100.20", 20)
    # then all 20 are let in after a single database lookup
    assert [r.context.workload_id for r in results] == [caller.workload.id] * 20
    assert lookups == [caller.api_key]
    assert in_flight == {}


def test_concurrent_callers_of_one_unknown_key_share_one_lookup_and_one_attempt(settings, make_caller, small_caches,
                                                                                monkeypatch):
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 3
    make_caller()
    lookups = _counted_lookups(monkeypatch)
    key = random_key()
    # when 20 callers of one unknown key arrive together
    results, _ = _together(key, "198.51.100.21", 20)
    # then one lookup answered them all (401, not 429: waiting on a lookup costs the address nothing)
    assert [(r.context, r.retry_after_ms) for r in results] == [(None, None)] * 20
    assert lookups == [key]
    # and the address has 2 attempts left of 3: 2 more unknown keys pass to a lookup, the next is refused
    assert [check(random_key(), address="198.51.100.21").retry_after_ms is None for _ in range(3)] == [True, True, False]


def test_a_flood_of_bad_keys_does_not_lock_out_valid_keys_from_the_same_address(settings, make_caller, small_caches):
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 5
    settings.SLUICE_AUTH_CACHE_S = 0  # nothing kept: every call is a cache miss, as once a cache entry lapses
    used, fresh = make_caller(), make_caller()
    nat = "203.0.113.77"  # callers behind one NAT share it with the attacker
    # given a valid key in use from the address
    assert check(used.api_key, address=nat).context.workload_id == used.workload.id
    # when the same address sends ten unknown keys
    flood = [check(random_key(), address=nat) for _ in range(10)]
    # then the first five are 401s and the rest 429s
    assert [r.retry_after_ms is None for r in flood] == [True] * 5 + [False] * 5
    assert all(r.context is None for r in flood)
    # and both the key in use and a key never seen before still get in from that address
    assert check(used.api_key, address=nat).context.workload_id == used.workload.id
    assert check(fresh.api_key, address=nat).context.workload_id == fresh.workload.id
    # while another unknown key from it is still refused, and the valid ones cost it no attempt
    assert check(random_key(), address=nat).retry_after_ms is not None
    assert auth.api_key_address_budget().take_call(nat).run().allowed is False


def test_bad_keys_cost_a_lookup_only_when_sluice_could_have_issued_them(settings, make_caller, small_caches,
                                                                       monkeypatch):
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 4
    make_caller()
    lookups = _counted_lookups(monkeypatch)
    unknown = random_key()
    # when an address sends keys of another format, then one unknown key of ours twice, then one more
    results = [check(key, address="198.51.100.90") for key in ("sk-proj-abc", "not a key", unknown, unknown, "x")]
    # then only the key of ours was looked up, once, and every failure counted
    assert lookups == [unknown]
    assert [r.retry_after_ms is None for r in results] == [True, True, True, True, False]


@pytest.mark.django_db(transaction=True)
def test_a_valid_key_answers_200_after_a_flood_of_bad_keys_from_its_address(platform, make_caller):
    limit = int(platform.env["SLUICE_API_KEY_FAILURES_PER_ADDRESS"])
    caller = make_caller()
    url = f"{platform.base_url}/v1/models"
    with httpx.Client(timeout=10) as client:
        # given an address whose unknown keys are already refused
        flood = [client.get(url, headers={"Authorization": f"Bearer {random_key()}"}).status_code
                 for _ in range(limit + 3)]
        assert flood == [401] * limit + [429] * 3
        # when a valid key, issued before the flood, arrives from the same
        # address (past its throttle the web process looks up only keys it
        # knows were issued: one issued since its last poll waits for the next)
        answer = client.get(url, headers={"Authorization": f"Bearer {caller.api_key}"})
    # then it is served
    assert answer.status_code == 200
    assert answer.json()["object"] == "list"


def _unknown_key_statuses(base_url: str, forwarded: list[str]) -> list[int]:
    """One unknown key per X-Forwarded-For value, sent from this host (127.0.0.1)."""
    with httpx.Client(timeout=10) as client:
        return [client.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {random_key()}",
                                                            "X-Forwarded-For": hop}).status_code
                for hop in forwarded]


@pytest.mark.django_db(transaction=True)
def test_x_forwarded_for_from_an_untrusted_peer_buys_no_fresh_budget(platform):
    # given no trusted proxies (the default), even for a peer on loopback
    assert platform.env.get("SLUICE_TRUSTED_PROXIES", "") == ""
    limit = int(platform.env["SLUICE_API_KEY_FAILURES_PER_ADDRESS"])
    # when every unknown key claims another client address
    statuses = _unknown_key_statuses(platform.base_url, [f"198.51.100.{n}" for n in range(1, limit + 3)])
    # then they all count against the peer's own address: past the limit, 429
    assert statuses == [401] * limit + [429] * 2


@pytest.mark.django_db(transaction=True)
def test_x_forwarded_for_from_a_trusted_proxy_names_the_client(platform):
    limit = int(platform.env["SLUICE_API_KEY_FAILURES_PER_ADDRESS"])
    with platform.environment({"SLUICE_TRUSTED_PROXIES": "127.0.0.1/32"}, lanes=[]):
        # when a trusted proxy (this host) relays `limit` + 1 unknown keys from one client
        first = _unknown_key_statuses(platform.base_url, ["198.51.100.1"] * (limit + 1))
        # and then one from another client, and one whose left part was written by the client
        other = _unknown_key_statuses(platform.base_url, ["198.51.100.2", "198.51.100.3, 198.51.100.1"])
    # then the first client is refused past the limit, the second is not,
    # and a spoofed left part is ignored: the hop the proxy saw counts
    assert first == [401] * limit + [429]
    assert other == [401, 429]


@pytest.mark.django_db(transaction=True)
def test_the_sign_in_throttle_ignores_x_forwarded_for_from_an_untrusted_peer(platform):
    with platform.environment({"SLUICE_LOGIN_FAILURES_PER_ADDRESS": "3"}, lanes=[]):
        with httpx.Client(timeout=30) as client:
            # when four failed sign-ins, for four users, each claim another client address
            statuses = [client.post(f"{platform.base_url}/api/auth/token/",
                                    json={"username": f"nobody-{n}", "password": "wrong"},
                                    headers={"X-Forwarded-For": f"198.51.100.{n}"}).status_code
                        for n in range(1, 5)]
    # then all count against this peer's own address: the fourth is refused
    assert statuses == [400, 400, 400, 429]


def test_past_its_throttle_an_address_costs_no_lookup_for_keys_sluice_never_issued(settings, make_caller,
                                                                                    small_caches, monkeypatch):
    # given a valid key, known to this process's poll of issued keys, and an address at its limit
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = 3
    caller = make_caller()
    monkeypatch.setattr(auth, "_throttled", auth.key_cache(8))
    # (a made-up key past the throttle waits for the next poll before its 429: a short one here)
    settings.SLUICE_AUTH_REVOCATION_POLL_S = 0.02
    _polled_now(settings, monkeypatch)  # the first poll loads the issued keys
    assert auth._issued.last_id >= 1
    lookups = _counted_lookups(monkeypatch)
    for n in range(4):
        check(f"sk-sluice-made-up-{n}", address="203.0.113.5")
    # each looked up until the address is refused once (the fourth: 429)
    assert len(lookups) == 4
    before = len(lookups)
    # when the flood goes on past the limit
    answers = [check(f"sk-sluice-made-up-more-{n}", address="203.0.113.5") for n in range(20)]
    # then none of it reaches the database, and each is a 429
    assert len(lookups) == before
    assert all(a.context is None and a.retry_after_ms for a in answers)
    # and the valid key from the same address is looked up and gets in
    valid = check(caller.api_key, address="203.0.113.5")
    assert valid.context is not None and valid.context.workload_id == caller.workload.id


def _throttled_after_a_poll(settings, make_caller, monkeypatch, address: str, *, limit: int) -> None:
    """``address`` past its throttle of ``limit`` unknown keys, just after
    this process's first poll of issued keys (a caller's key among them)."""
    settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS = limit
    make_caller()
    monkeypatch.setattr(auth, "_issued", auth._Issued())
    monkeypatch.setattr(auth, "_throttled", auth.key_cache(8))
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))  # no poll yet: every key looked up
    answers = [check(random_key(), address=address) for _ in range(limit + 1)]
    assert [a.retry_after_ms is None for a in answers] == [True] * limit + [False]
    _polled_now(settings, monkeypatch)


def _polled_now(settings, monkeypatch) -> None:
    """This process's first poll of issued keys, run to its end now, the next
    one due a poll interval later. (A poll a ``check`` starts runs beside its
    lookup, and ``async_to_sync`` cancels it with its event loop if the
    lookup ends first: a test that needs the poll's keys runs it itself.)"""
    monkeypatch.setattr(auth, "_issued", auth._Issued())
    async_to_sync(auth._poll)()
    assert auth._issued.digests is not None
    now = time.monotonic()
    monkeypatch.setattr(auth._tick, "poll_started", now)
    monkeypatch.setattr(auth._tick, "next_poll", now + settings.SLUICE_AUTH_REVOCATION_POLL_S)


def test_a_key_issued_since_the_last_poll_gets_in_from_a_throttled_address(settings, make_caller, small_caches,
                                                                          monkeypatch):
    settings.SLUICE_AUTH_REVOCATION_POLL_S = 0.5
    nat = "203.0.113.88"
    # given an address past its throttle, just after a poll of issued keys
    _throttled_after_a_poll(settings, make_caller, monkeypatch, nat, limit=3)
    lookups = _counted_lookups(monkeypatch)
    # when a key issued after that poll is used from the address at once
    fresh = make_caller()
    answer = check(fresh.api_key, address=nat)
    # then it waits for the next poll (its wait is bounded: past one interval
    # and the lookup's bound it would be refused) and gets in, never a 429
    # with the throttle's minute
    assert answer.retry_after_ms is None
    assert answer.context is not None and answer.context.workload_id == fresh.workload.id
    assert lookups == [fresh.api_key]
    # and a made-up key from it is still refused after that poll, with no lookup
    refused = check("sk-sluice-made-up-after", address=nat)
    assert refused.context is None and refused.retry_after_ms
    assert lookups == [fresh.api_key]


def test_callers_past_a_throttle_share_the_next_poll_of_issued_keys(settings, make_caller, small_caches, monkeypatch):
    settings.SLUICE_AUTH_REVOCATION_POLL_S = 0.3
    nat = "203.0.113.89"
    _throttled_after_a_poll(settings, make_caller, monkeypatch, nat, limit=1)
    polls = []
    changes = auth.api_key_changes

    def counted(**kwargs):
        polls.append(kwargs)
        return changes(**kwargs)

    monkeypatch.setattr(auth, "api_key_changes", counted)

    async def flood():
        auth._tick.next_poll = time.monotonic() + 0.2  # none due as they arrive
        return await asyncio.gather(*(key_check(f"sk-sluice-made-up-{n}", address=nat) for n in range(50)))

    # when 50 made-up keys arrive together from the throttled address
    answers = async_to_sync(flood)()
    # then each is refused after one shared poll, not a poll (or a lookup) each
    assert all(a.context is None and a.retry_after_ms for a in answers)
    assert len(polls) == 1


def test_a_key_committed_after_one_with_a_higher_id_is_still_learned(make_caller, monkeypatch):
    from django.db import connection, transaction

    from tenants.services import api_key_create

    workload = make_caller().workload
    monkeypatch.setattr(auth, "_issued", auth._Issued())
    poll = async_to_sync(auth._poll)
    poll()  # the first poll loads every key issued so far
    assert auth._issued.digests is not None
    held, inserted, commit = {}, threading.Event(), threading.Event()

    def insert_and_hold():
        try:
            with transaction.atomic():
                held["key"] = api_key_create(workload=workload, name="slow commit")
                inserted.set()
                commit.wait(timeout=30)
        finally:
            connection.close()

    # given a key inserted (its id taken) in a transaction that has not committed
    writer = threading.Thread(target=insert_and_hold)
    writer.start()
    assert inserted.wait(timeout=30)
    # and a key with a higher id, committed and seen by a poll
    later = api_key_create(workload=workload, name="quick commit")
    assert later.api_key.id > held["key"].api_key.id
    poll()
    assert auth._digest(later.raw_key) in auth._issued.digests
    assert auth._digest(held["key"].raw_key) not in auth._issued.digests
    # when the first commits, and the next poll runs
    commit.set()
    writer.join(timeout=30)
    poll()
    # then that poll learns it too (it reads again from the last id it had a
    # few seconds ago, not from the highest id it has seen)
    assert auth._digest(held["key"].raw_key) in auth._issued.digests


def test_each_poll_reads_again_only_the_keys_issued_in_the_last_few_seconds():
    issued = auth._Issued()
    overlap = auth.REVOCATION_OVERLAP_S
    assert issued.floor(100.0) == 0  # the first poll reads every key
    # given polls every second, the last id growing by 10 each
    for n in range(20):
        issued.marks.append((100.0 + n, 10 * (n + 1)))
    # then a poll reads from the last id of the newest poll at least the overlap old
    now = 120.0
    newest_old = max(n for n in range(20) if 100.0 + n <= now - overlap)
    assert issued.floor(now) == 10 * (newest_old + 1)
    # and the marks before it are dropped: a handful kept, not one per poll forever
    assert len(issued.marks) == 20 - newest_old


def test_a_key_waiting_for_the_next_poll_holds_no_turn_at_the_door(settings, make_caller, small_caches, monkeypatch):
    from django.test import RequestFactory

    from gateway.web import admission_turns
    from gateway.web.views import caller_authenticate

    settings.SLUICE_AUTH_REVOCATION_POLL_S = 5.0
    settings.SLUICE_WEB_ADMISSIONS_AT_ONCE = 1
    nat = "203.0.113.90"
    _throttled_after_a_poll(settings, make_caller, monkeypatch, nat, limit=1)
    request = RequestFactory().post("/v1/chat/completions", HTTP_AUTHORIZATION="Bearer sk-sluice-made-up-at-the-door",
                                    REMOTE_ADDR=nat)

    async def main():
        admission_turns._doors.clear()
        door = admission_turns.door()
        turn = door.enter_now()
        assert turn is not None and door.enter_now() is None  # the one turn is this request's
        token = admission_turns._turn.set(turn)
        try:
            auth._tick.next_poll = time.monotonic() + 1.0
            # when a made-up key past its address's throttle waits for the next poll
            waiting = asyncio.create_task(caller_authenticate(request))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            # then the turn it held is free for the next request meanwhile
            freed = door.enter_now()
            return freed, await waiting
        finally:
            admission_turns._turn.reset(token)

    freed, answer = async_to_sync(main)()
    assert freed is not None
    # and after the poll it is refused as before
    assert answer.status_code == 429
