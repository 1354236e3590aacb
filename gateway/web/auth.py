"""Who is calling: the bearer key's workload context, looked up in the
database and then cached per process for a few seconds (the admission path
must not hit the database on every call). Revoking a key or changing caps
takes effect within SLUICE_AUTH_CACHE_S; budgets take effect at once, since
they live in Redis."""

from __future__ import annotations

import hashlib
import threading
import time

from asgiref.sync import sync_to_async
from django.conf import settings

from gateway.core.context import CallerContext, context_for_workload
from tenants.selectors import api_key_lookup

_cache: dict[str, tuple[float, CallerContext | None]] = {}
_cache_lock = threading.Lock()


def _load_context(raw_key: str) -> CallerContext | None:
    key = api_key_lookup(raw_key=raw_key)
    if key is None:
        return None
    return context_for_workload(key.workload)


async def caller_context(raw_key: str) -> CallerContext | None:
    # Cache by digest so raw keys never sit in process memory longer than a request.
    digest = hashlib.sha256(raw_key.encode()).hexdigest()
    now = time.monotonic()
    cached = _cache.get(digest)
    if cached is not None and cached[0] > now:
        return cached[1]
    context = await sync_to_async(_load_context, thread_sensitive=False)(raw_key)
    with _cache_lock:
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[digest] = (now + settings.SLUICE_AUTH_CACHE_S, context)
    return context


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
