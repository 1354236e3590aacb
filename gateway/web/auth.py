"""Who is calling: the bearer key's workload context, looked up in the
database and then cached per process for a few seconds (the admission path
must not hit the database on every call). Revoking a key or changing caps
takes effect within SLUICE_AUTH_CACHE_S; budgets take effect at once, since
they live in Redis.

Valid and unknown keys are remembered in two separate bounded LRU caches: a
flood of random keys only churns the unknown ones, never evicting the keys
real callers use. Unknown keys also count against the caller's address
(gateway/core/throttle.py); past SLUICE_API_KEY_FAILURES_PER_ADDRESS in a
window the address is answered 429 without a database lookup."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings

from gateway.core.context import CallerContext, context_for_workload
from gateway.core.throttle import api_key_address_budget
from tenants.selectors import api_key_lookup

V = TypeVar("V")


class ExpiringLRU(Generic[V]):
    """At most ``max_size`` entries, each until its expiry; the least
    recently used goes first when full. Thread-safe."""

    def __init__(self, max_size: int):
        self.max_size = max(1, max_size)
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, now: float) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry[0] <= now:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: str, value: V, expires: float) -> None:
        with self._lock:
            self._entries[key] = (expires, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_valid: ExpiringLRU[CallerContext] = ExpiringLRU(settings.SLUICE_AUTH_CACHE_SIZE)
_unknown: ExpiringLRU[bool] = ExpiringLRU(settings.SLUICE_AUTH_CACHE_SIZE)


@dataclass(frozen=True)
class KeyCheck:
    """The key's workload context (None: unknown or revoked). ``retry_after_ms``
    set: this address tried too many unknown keys; the key was not looked at."""

    context: CallerContext | None
    retry_after_ms: int | None = None


def _load_context(raw_key: str) -> CallerContext | None:
    key = api_key_lookup(raw_key=raw_key)
    if key is None:
        return None
    return replace(context_for_workload(key.workload), api_key_id=key.id)


def _digest(raw_key: str) -> str:
    # Cache by digest so raw keys never sit in process memory longer than a request.
    return hashlib.sha256(raw_key.encode("utf-8", "replace")).hexdigest()


async def key_check(raw_key: str, *, address: str) -> KeyCheck:
    digest = _digest(raw_key)
    now = time.monotonic()
    context = _valid.get(digest, now)
    if context is not None:
        return KeyCheck(context)
    # Not known to be good: it costs the address an attempt, given back if
    # the key turns out valid. Redis away raises BudgetUnavailable (a 503,
    # like the admission that would follow): never an unthrottled lookup.
    budget = api_key_address_budget()
    taken = await budget.take_call(address).run_async()
    if not taken.allowed:
        return KeyCheck(None, retry_after_ms=taken.retry_after_ms)
    if _unknown.get(digest, now):
        return KeyCheck(None)
    context = await sync_to_async(_load_context, thread_sensitive=False)(raw_key)
    expires = time.monotonic() + settings.SLUICE_AUTH_CACHE_S
    if context is None:
        _unknown.put(digest, True, expires)
        return KeyCheck(None)
    await budget.refund_call(address).run_async()
    _valid.put(digest, context, expires)
    return KeyCheck(context)


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
