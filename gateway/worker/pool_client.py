"""The pool, reached with the official openai SDK. Its own retries are off:
the gateway decides about retries (a retry the SDK makes on its own is load
the admission step never saw)."""

from __future__ import annotations

import os
import threading

import httpx
from django.conf import settings
from openai import OpenAI

_clients: dict[tuple[str, str], OpenAI] = {}
_lock = threading.Lock()
_sent = threading.local()


def _count_sent(request: httpx.Request) -> None:
    # httpx calls this once the request is built (its body encoded) and is
    # about to go on the wire: a failure before it never reached the pool.
    _sent.count = getattr(_sent, "count", 0) + 1


def pool_requests_sent() -> int:
    """Requests this thread has sent to any pool so far. Compared before and
    after a failure: did the failed call reach the pool?"""
    return getattr(_sent, "count", 0)


def pool_api_key(*, api_key_env: str) -> str:
    """A pool's API key lives in the variable its InferencePool.api_key_env
    names (a secret never stored in the database)."""
    return os.environ.get(api_key_env, "") if api_key_env else ""


def pool_client(*, base_url: str, api_key_env: str) -> OpenAI:
    api_key = pool_api_key(api_key_env=api_key_env)
    cache_key = (base_url, api_key_env)
    client = _clients.get(cache_key)
    if client is None:
        with _lock:
            client = _clients.get(cache_key)
            if client is None:
                client = OpenAI(
                    base_url=base_url,
                    api_key=api_key or "sluice-no-key",
                    max_retries=0,
                    timeout=httpx.Timeout(settings.SLUICE_UPSTREAM_TIMEOUT_S, connect=5.0),
                    http_client=httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                                             event_hooks={"request": [_count_sent]}),
                )
                _clients[cache_key] = client
    return client
