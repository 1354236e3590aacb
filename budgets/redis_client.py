"""Redis connections for the buckets. Short timeouts on the admission path:
when Redis is gone the gateway must say 503 within a second, not hang."""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio as aioredis
from django.conf import settings

_sync_clients: dict[str, redis.Redis] = {}
_sync_lock = threading.Lock()
_async_clients: dict[tuple[int, str], aioredis.Redis] = {}


def _options(blocking: bool) -> dict:
    timeout = settings.SLUICE_REDIS_TIMEOUT_S
    return {
        "socket_connect_timeout": timeout,
        # Blocking reads (BLPOP for a result) set their own server-side timeout.
        "socket_timeout": None if blocking else timeout,
        "health_check_interval": 30,
        "decode_responses": True,
    }


def get_redis(*, blocking: bool = False) -> redis.Redis:
    key = "blocking" if blocking else "fast"
    client = _sync_clients.get(key)
    if client is None:
        with _sync_lock:
            client = _sync_clients.get(key)
            if client is None:
                client = redis.Redis.from_url(settings.REDIS_URL, max_connections=512, **_options(blocking))
                _sync_clients[key] = client
    return client


def get_async_redis(*, blocking: bool = False) -> aioredis.Redis:
    """One client per event loop (a client's connections belong to its loop)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), "blocking" if blocking else "fast")
    client = _async_clients.get(key)
    if client is None:
        client = aioredis.Redis.from_url(settings.REDIS_URL, max_connections=4096, **_options(blocking))
        _async_clients[key] = client
    return client


def reset_clients() -> None:
    """Forget cached clients (after a fork, or in tests that restart Redis)."""
    _sync_clients.clear()
    _async_clients.clear()
    _scripts.clear()


_scripts: dict[tuple[int, str], object] = {}


def lua_script(client, source: str):
    """The client's registered script for ``source``. register_script keeps the
    SHA and reloads the source after SCRIPT FLUSH or a Redis restart
    (NoScriptError -> SCRIPT LOAD -> EVALSHA)."""
    key = (id(client), source)
    script = _scripts.get(key)
    if script is None:
        script = client.register_script(source)
        _scripts[key] = script
    return script
