"""Who is calling: the bearer key's workload context, looked up in the
database and then cached per process for a few seconds (the admission path
must not hit the database on every call). Changing caps takes effect within
SLUICE_AUTH_CACHE_S; budgets take effect at once, since they live in Redis.

Revocation and expiry are faster than the cache. A cached key is kept no
later than its ``expires_at``. Revocations: every
SLUICE_AUTH_REVOCATION_POLL_S (0.5 s) at most, the first request past that
mark starts a poll that asks the database which keys were revoked lately
(one indexed query per process, not per request) and drops them from the
cache, so a revoked key stops working everywhere within about poll + query
time, under a second. The poll runs beside the requests, one at a time: no
request waits for it, so a slow or restarting database never holds up a
caller whose key is cached.
The query looks back REVOCATION_OVERLAP_S past the previous poll: a
revocation whose transaction committed after that poll began, or a web host
whose clock runs a little ahead, is still seen. Issued keys likewise: each
poll reads them from the last id it knew REVOCATION_OVERLAP_S ago, since a
key's id is taken at its insert and it can commit after a higher one.

The database away (a restart, a fail-over): a key this process checked in
the last SLUICE_AUTH_STALE_S is served as it was last checked, its lookup
tried again at most once a second, so the requests of known callers go on
(their admission, lane and pool live in Redis and the workers); a key it
cannot check answers 503 ``database_unavailable`` with a Retry-After, never a
500. Revocations drop these entries too, and a key is never served past its
``expires_at``; a revocation committed in the poll interval just before the
database went away is the one thing that waits for it to come back (at most
SLUICE_AUTH_STALE_S).
A database that holds a lookup up instead of failing it (a lock, a hung
host, a network that drops packets) counts as away once the lookup has run
SLUICE_AUTH_LOOKUP_WAIT_S: its callers are answered as above while it goes
on. A key has one lookup at a time per process, and a process starts no
new one past LOOKUPS_MAX in flight while the database holds them up, so a
hung database holds a few executor threads, never one per request, and no
caller waits past the bound.

Last use: each request notes its key in process memory; a timer on the
event loop sends the notes to Redis (ZADD GT, one round trip per
SLUICE_KEY_LAST_USED_PUSH_S, also when no request follows) and a beat task
writes them to ``ApiKey.last_used_at`` in one batch
(gateway/core/key_usage.py): never an UPDATE per request.

Valid and unknown keys are remembered in two separate bounded caches
(cachetools' ``TLRUCache``: each entry with its own expiry, least recently
used out first when full; SLUICE_AUTH_CACHE_SIZE entries each): a flood of
random keys only churns the unknown ones, never evicting the keys real
callers use. Both live on the event loop's thread, which alone reads and
writes them. Unknown keys also count against the caller's address
(gateway/core/protection/throttle.py); past SLUICE_API_KEY_FAILURES_PER_ADDRESS
in a window the address's failures are answered 429 instead of 401. A key is
always looked at first, so a flood of bad keys from an address shared by
many callers (a NAT, a load balancer) never locks out the valid keys behind
it; a bad key this process already knows, or one without Sluice's prefix,
costs no lookup, and past its throttle an address is looked up only for
keys Sluice issued (``_Issued``, kept with the revocation poll), so a flood
of made-up keys cannot turn into a flood of database lookups. A key this
process has not heard of yet may have been issued since its last poll: such
a caller waits for the next poll (at most SLUICE_AUTH_REVOCATION_POLL_S, the
one poll shared by every caller waiting) before it is refused, so a key
issued a moment ago gets in from a throttled address too.

A key has one lookup at a time per process, and its callers share it: when
the cached context of a busy key lapses, the first caller starts the lookup
and every caller of the same key arriving meanwhile waits for that one
(no attempt taken from its address for an unknown key: one lookup, one
failure, the first caller's), instead of N lookups at once. A key checked in
the last REFRESH_AHEAD_S of its cache entry starts its next lookup beside
the request, so a key in steady use is looked up again before its entry
lapses and none of its callers waits for the database."""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

from cachetools import TLRUCache
from django.conf import settings
from django.db import OperationalError
from django.utils import timezone

from budgets.redis.clients import REDIS_UNAVAILABLE
from gateway.core.db_threads import DATABASE_AWAY, database_off_loop
from gateway.core.request.context import CallerContext, context_for_workload
from gateway.core.key_usage import key_last_used_push
from gateway.core.observability import key_check_unanswered_observe
from gateway.core.protection.throttle import api_key_address_budget
from gateway.web.per_loop import PerLoop
from tenants.keys import KEY_PREFIX
from tenants.selectors import api_key_changes, api_key_lookup

logger = logging.getLogger(__name__)

REVOCATION_OVERLAP_S = 5.0
# While the database is away, a key served as last checked is looked up
# again at most this often (per key and process).
STALE_RETRY_S = 1.0
# Key lookups in flight per process at most while the database holds them
# up (the oldest past its wait): past it a key not cached is answered as if
# the database were away. A database that answers is never capped: a web
# process that starts under the traffic of thousands of keys looks them all up.
LOOKUPS_MAX = 256
# A key checked this close to its cache entry's end (at most half the
# entry's life) is looked up again beside the request.
REFRESH_AHEAD_S = 1.0

@dataclass(frozen=True)
class CachedKey:
    context: CallerContext
    key_id: int


@dataclass(frozen=True)
class Kept:
    """A cache entry, the monotonic time it lapses and the time from which a
    check of it starts the key's next lookup (never, for an entry served
    while the database is away: that is retried only once it lapses)."""

    value: object
    until: float
    refresh_at: float = float("inf")


def key_cache(size: int) -> TLRUCache:
    """A bounded cache whose entries lapse at their own ``Kept.until``."""
    return TLRUCache(maxsize=max(1, size), ttu=lambda _key, kept, _now: kept.until, timer=time.monotonic)


def _keep(cache: TLRUCache, digest: str, value: object, seconds: float, *, refresh: bool = False) -> None:
    """Keep ``value`` for ``seconds`` (0 or less: not kept); ``refresh``: a
    check in the entry's last REFRESH_AHEAD_S starts its next lookup."""
    if seconds > 0:
        until = time.monotonic() + seconds
        refresh_at = until - min(REFRESH_AHEAD_S, seconds / 2) if refresh else float("inf")
        cache[digest] = Kept(value=value, until=until, refresh_at=refresh_at)
    else:
        cache.pop(digest, None)


def _kept(cache: TLRUCache, digest: str):
    kept = cache.get(digest)
    return None if kept is None else kept.value


_valid = key_cache(settings.SLUICE_AUTH_CACHE_SIZE)  # digest -> CachedKey
_stale = key_cache(settings.SLUICE_AUTH_CACHE_SIZE)  # digest -> CachedKey: served while the database is away
_unknown = key_cache(settings.SLUICE_AUTH_CACHE_SIZE)  # digest -> True


@dataclass(frozen=True)
class KeyCheck:
    """The key's workload context (None: unknown or revoked). ``retry_after_ms``
    set: the key is not valid and this address tried too many unknown keys."""

    context: CallerContext | None
    retry_after_ms: int | None = None


def _load_context(raw_key: str) -> tuple[CachedKey, float | None] | None:
    """The key's context and id, and how many seconds until it expires (None: never)."""
    key = api_key_lookup(raw_key=raw_key)
    if key is None:
        return None
    expires_in = (key.expires_at - timezone.now()).total_seconds() if key.expires_at else None
    return CachedKey(context=replace(context_for_workload(key.workload), api_key_id=key.id), key_id=key.id), expires_in


class _Tick:
    """This process's revocation poll and last-use buffer."""

    def __init__(self) -> None:
        self.next_poll = 0.0  # monotonic
        self.since = timezone.now() - timedelta(seconds=REVOCATION_OVERLAP_S)
        self.next_push = 0.0
        self.last_used: dict[int, float] = {}  # key id -> unix seconds
        self.push: asyncio.Task | asyncio.TimerHandle | None = None  # the push pending, if any
        self.poll: asyncio.Task | None = None  # the revocation poll running, if any
        self.poll_started = float("-inf")  # monotonic start of ``poll``


_tick = _Tick()


class _Issued:
    """The digests of every key Sluice has issued and not revoked, each with
    its tenant, as this process knows them (loaded at its first poll, then
    the keys issued since at each poll, revocations dropped): an address
    over its throttle gets a lookup only for a key Sluice issued, so a flood
    of made-up keys costs no database lookup at all once its address is
    throttled, and a valid key from the same address still gets in; and a
    request waits at the door as its tenant's (``caller_line``). None until
    the first poll succeeds (then every key is looked up, as before)."""

    def __init__(self) -> None:
        self.digests: dict[str, int] | None = None  # digest -> tenant id
        self.last_id = 0
        # (monotonic start, last_id after) of the recent polls: a key's id is
        # taken at its insert, so a key can commit after one with a higher id
        # that a poll already saw; each poll reads again from the last_id it
        # had REVOCATION_OVERLAP_S ago (the keys issued since: a few rows).
        self.marks: collections.deque[tuple[float, int]] = collections.deque()

    def floor(self, now: float) -> int:
        """The id above which this poll reads issued keys: the last one
        known at the newest poll at least REVOCATION_OVERLAP_S old."""
        marks = self.marks
        while len(marks) > 1 and marks[1][0] <= now - REVOCATION_OVERLAP_S:
            marks.popleft()
        return marks[0][1] if marks else 0


_issued = _Issued()
# Addresses past their unknown-key throttle (until its retry), as this
# process last heard from it.
_throttled = key_cache(settings.SLUICE_AUTH_CACHE_SIZE)


def _revocations_apply(hashes: list[str]) -> None:
    for digest in hashes:
        _valid.pop(digest, None)
        _stale.pop(digest, None)
        if _issued.digests is not None:
            _issued.digests.pop(digest, None)


def _issued_apply(issued: list[tuple[int, str, int]]) -> None:
    if _issued.digests is None:
        _issued.digests = {}
    for key_id, digest, tenant_id in issued:
        _issued.digests[digest] = tenant_id
        _issued.last_id = max(_issued.last_id, key_id)


def _poll_due(now: float) -> None:
    """At most once per poll interval per process, start the poll that drops
    revoked keys from the cache, on this event loop, without waiting for it.
    One poll at a time: while a slow database holds one, no other starts."""
    if now < _tick.next_poll:
        return
    running = _tick.poll
    loop = asyncio.get_running_loop()
    if running is not None and not running.done() and running.get_loop() is loop:
        return
    _tick.next_poll = now + settings.SLUICE_AUTH_REVOCATION_POLL_S
    _tick.poll_started = now
    _tick.poll = loop.create_task(_poll())


async def _issued_heard(since: float) -> bool:
    """Wait for a poll of issued keys that started at or after ``since``
    (monotonic): the next one due, shared by every caller waiting, not one
    of its own. False if none finished within one poll interval and the
    lookup bound (a slow database: the caller is refused as before)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(settings.SLUICE_AUTH_REVOCATION_POLL_S + settings.SLUICE_AUTH_LOOKUP_WAIT_S):
            while True:
                poll = _tick.poll
                if poll is not None and poll.get_loop() is loop:
                    if _tick.poll_started >= since:
                        await asyncio.shield(poll)
                        return True
                    if not poll.done():  # an older poll still running: the next starts after it
                        await asyncio.shield(poll)
                        continue
                await asyncio.sleep(max(0.0, _tick.next_poll - time.monotonic()))
                _poll_due(time.monotonic())
    except TimeoutError:
        return False


async def _poll() -> None:
    """Drop the keys revoked lately, learn the keys issued since the last
    poll. A failure only delays it to the next tick."""
    started, started_at = timezone.now(), time.monotonic()
    try:
        hashes, issued = await database_off_loop(api_key_changes)(
            revoked_since=_tick.since - timedelta(seconds=REVOCATION_OVERLAP_S),
            issued_after_id=_issued.floor(started_at))
    except Exception:  # noqa: BLE001 - nobody awaits the poll: the database away, or anything else, is logged here
        logger.warning("could not read recent key revocations; retrying at the next tick", exc_info=True)
    else:
        _issued_apply(issued)
        _revocations_apply(hashes)
        _issued.marks.append((started_at, _issued.last_id))
        _tick.since = started


def _push_schedule() -> None:
    """Send the last-use notes at the next push mark, whether or not a
    request comes by then: a process that goes quiet after a call still
    reports it. One push pending at a time; nothing outside an event loop
    (the notes wait for the next call on one)."""
    if _tick.push is not None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    delay = max(0.0, _tick.next_push - time.monotonic())
    _tick.push = loop.call_later(delay, _push_start)


def _push_start() -> None:
    # A reference kept while it runs: the loop holds tasks only weakly.
    _tick.push = asyncio.ensure_future(_last_used_push())


async def _last_used_push() -> None:
    _tick.next_push = time.monotonic() + settings.SLUICE_KEY_LAST_USED_PUSH_S
    batch, _tick.last_used = _tick.last_used, {}
    try:
        if batch:
            await key_last_used_push(last_used=batch)
    except REDIS_UNAVAILABLE:
        for key_id, at in batch.items():  # kept for the next push
            _tick.last_used[key_id] = max(at, _tick.last_used.get(key_id, 0.0))
    finally:
        _tick.push = None
        if _tick.last_used:  # noted meanwhile, or kept after a failure
            _push_schedule()


def key_use_noted(*, key_id: int) -> float | None:
    """When this process last saw the key used and has not pushed it to
    Redis yet (unix seconds), or None."""
    return _tick.last_used.get(key_id)


def _noted(cached: CachedKey) -> KeyCheck:
    _tick.last_used[cached.key_id] = time.time()
    _push_schedule()
    return KeyCheck(cached.context)


def _digest(raw_key: str) -> str:
    # Cache by digest so raw keys never sit in process memory longer than a request.
    return hashlib.sha256(raw_key.encode("utf-8", "replace")).hexdigest()


def caller_line(authorization: str | None) -> tuple[int, str] | None:
    """Where a request waits at the door (gateway/web/admission_turns.py),
    from what this process already knows of its bearer key before it is
    checked: (its tenant, its digest) for a key Sluice issued and has not
    revoked; None for any other (no key, a made-up or revoked one, or any
    key before this process's first revocation poll). The same key always
    waits in the same line, its first request and its thousandth alike.
    Nothing is looked up, noted or counted."""
    raw_key = bearer_key(authorization)
    if raw_key is None or _issued.digests is None:
        return None
    digest = _digest(raw_key)
    tenant_id = _issued.digests.get(digest)
    return None if tenant_id is None else (tenant_id, digest)


async def key_check(raw_key: str, *, address: str, before_waiting: Callable[[], None] | None = None) -> KeyCheck:
    """Who the key is, or why not. ``before_waiting`` is called before the
    check waits for the next poll of issued keys (the door's turn is given
    up: a flood of made-up keys waiting there must not hold the turns)."""
    digest = _digest(raw_key)
    now = time.monotonic()
    _poll_due(now)
    kept = _valid.get(digest)
    if kept is not None:
        if now >= kept.refresh_at:
            _refresh(raw_key, digest)
        return _noted(kept.value)
    # The key is looked at before its address's throttle: callers behind one
    # NAT or load balancer share an address with whoever floods it with bad
    # keys, and a valid key must still get in. Only a failure costs the
    # address an attempt; past the limit the failure is a 429, not a 401.
    # A key Sluice never issued (every one starts with KEY_PREFIX) or one this
    # process already found bad costs no lookup.
    if not raw_key.startswith(KEY_PREFIX) or _kept(_unknown, digest):
        return await _failure_count(address)
    lookups = _lookups.get(dict)
    lookup = lookups.get(digest)
    first = lookup is None
    try:
        if first:
            if _kept(_throttled, address) and _issued.digests is not None and digest not in _issued.digests:
                # Past its throttle, an address is looked up for keys Sluice issued
                # only; a key issued since the last poll waits for the next one.
                if before_waiting is not None:
                    before_waiting()
                if not await _issued_heard(now) or digest not in _issued.digests:
                    return await _failure_count(address)
                lookup = lookups.get(digest)  # another caller of the key may have started it meanwhile
                first = lookup is None
            if first:
                lookup = _lookup_start(lookups, raw_key, digest)
        loaded = await _answer(lookup)
    except DATABASE_AWAY as exc:
        return _served_stale(digest, exc)
    if loaded is None:
        # Unknown or revoked: one failure per lookup against the address, its
        # first caller's; a caller that waited on it caused no lookup.
        return await _failure_count(address) if first else KeyCheck(None)
    return _noted(loaded[0])


@dataclass(frozen=True)
class _Lookup:
    """A key's lookup in flight, and the monotonic time its callers stop waiting for it."""

    task: asyncio.Task
    answer_by: float


# This loop's lookups in flight, digest -> _Lookup, oldest first (a dict keeps its order).
_lookups: PerLoop[dict[str, _Lookup]] = PerLoop()


def _lookup_start(lookups: dict[str, _Lookup], raw_key: str, digest: str) -> _Lookup:
    """Start the key's lookup on this loop; with LOOKUPS_MAX lookups already
    in flight and the oldest past its wait (the database holding them up),
    the database counts as away (OperationalError) and none starts."""
    if len(lookups) >= LOOKUPS_MAX and next(iter(lookups.values())).answer_by < time.monotonic():
        raise OperationalError(f"{LOOKUPS_MAX} API key lookups are waiting for the database")
    lookup = lookups[digest] = _Lookup(task=asyncio.get_running_loop().create_task(_lookup(raw_key, digest)),
                                       answer_by=time.monotonic() + settings.SLUICE_AUTH_LOOKUP_WAIT_S)
    lookup.task.add_done_callback(functools.partial(_lookup_done, lookups, digest))
    return lookup


async def _lookup(raw_key: str, digest: str) -> tuple[CachedKey, float | None] | None:
    """``_load_context(raw_key)`` off the loop, and what it found kept in the
    caches, whether or not anybody still waits for it."""
    loaded = await database_off_loop(_load_context)(raw_key)
    cache_s = settings.SLUICE_AUTH_CACHE_S
    if loaded is None:
        _valid.pop(digest, None)
        _stale.pop(digest, None)
        _keep(_unknown, digest, True, cache_s)
        return None
    cached, expires_in = loaded
    # Kept no later than the key's expiry (a timeout of 0 or less: not kept).
    _keep(_valid, digest, cached, cache_s if expires_in is None else min(cache_s, expires_in), refresh=True)
    stale_s = settings.SLUICE_AUTH_STALE_S
    _keep(_stale, digest, cached, stale_s if expires_in is None else min(stale_s, expires_in))
    return loaded


async def _answer(lookup: _Lookup) -> tuple[CachedKey, float | None] | None:
    """The lookup's result, waited for until its ``answer_by``: past that the
    database counts as away (OperationalError) while the lookup goes on."""
    try:
        return await asyncio.wait_for(asyncio.shield(lookup.task), max(0.0, lookup.answer_by - time.monotonic()))
    except TimeoutError:
        raise OperationalError(
            f"the database did not answer an API key lookup within {settings.SLUICE_AUTH_LOOKUP_WAIT_S:g} s") from None


def _lookup_done(lookups: dict[str, _Lookup], digest: str, task: asyncio.Task) -> None:
    lookup = lookups.get(digest)
    if lookup is not None and lookup.task is task:
        del lookups[digest]
    if not task.cancelled():
        task.exception()  # its callers may all have stopped waiting: retrieved here, raised to them


def _refresh(raw_key: str, digest: str) -> None:
    """The key's next lookup, started beside its request, unless one is in
    flight or the database holds LOOKUPS_MAX up (then the entry lapses and
    its next caller looks the key up, or is answered as the database away)."""
    lookups = _lookups.get(dict)
    if digest not in lookups:
        try:
            _lookup_start(lookups, raw_key, digest)
        except DATABASE_AWAY:
            pass


def _served_stale(digest: str, error: Exception) -> KeyCheck:
    """The database did not answer a key's lookup: the key as this process
    last checked it, if that is recent enough; else the error (the /v1
    views answer it 503 database_unavailable: views.py ``unavailable_is_503``)."""
    kept = _stale.get(digest)
    key_check_unanswered_observe(served=kept is not None)
    if kept is None:
        raise error
    cached = kept.value
    logger.warning("the database did not answer the lookup of API key %s (%s); serving it as last checked",
                   cached.key_id, type(error).__name__)
    # Looked up again at most every STALE_RETRY_S, never past the stale bound.
    _keep(_valid, digest, cached, min(STALE_RETRY_S, kept.until - time.monotonic()))
    return _noted(cached)


async def _failure_count(address: str) -> KeyCheck:
    """An unknown or revoked key, counted against its address. Redis away
    raises BudgetUnavailable (a 503): never an unthrottled refusal."""
    taken = await api_key_address_budget().take_call(address).run_async()
    if taken.allowed:
        return KeyCheck(None)
    _keep(_throttled, address, True, taken.retry_after_ms / 1000)
    return KeyCheck(None, retry_after_ms=taken.retry_after_ms)


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
