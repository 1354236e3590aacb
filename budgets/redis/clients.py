"""Redis clients for the buckets and the request path, and what "Redis is
away" looks like.

Gone and busy are told apart. A Redis that refuses a connection fails every
call at once: the gateway answers 503. One that does not accept a connection
fails within ``SLUICE_REDIS_TIMEOUT_S`` (0.5 s) for pages and the management
API, within ``SLUICE_REDIS_BUSY_WAIT_S`` on the request path. A Redis that accepted the command and is slow to
answer (busy: a thousand streams relayed through it, or the process's own
event loop behind) is waited for up to ``SLUICE_REDIS_BUSY_WAIT_S`` on the
request path (the /v1 event loop's client, and every client of a lane
worker: ``request_path_process``), well within a request's own deadline: a
reply lost to a timeout would be a caller's request lost, or an admission
Redis ran that nobody heard. Only the web process's pages and the management
API keep the short read timeout, so a hung Redis (SIGSTOP) still gets them a
503 or a degraded page within their bounds; the request path hears a hung
Redis as 503 within the busy wait. A thread or task that finds every pooled
connection in use waits for one (redis-py's BlockingConnectionPool) within
the same bound, instead of failing with "too many connections".

With ``SLUICE_REDIS_CLUSTER`` the
clients are redis-py's cluster clients (``REDIS_URL`` names any node; the
client finds the rest): they route a script call by its keys, which must
share one hash slot (the key modules tag them: ``{pool:<id>}``,
``{<request id>}``)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Callable

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aioredis_cluster
import redis.cluster
from django.conf import settings

logger = logging.getLogger(__name__)

# What "Redis is not answering" looks like from redis-py: a refused or reset
# connection, a read that timed out (a hung server: redis-py's TimeoutError is
# not a ConnectionError), or the socket failing underneath.
# On a cluster also: the cluster (or the shard holding a slot) is down or
# failing over, or a slot is moving (TRYAGAIN).
REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
    redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError, redis.exceptions.TryAgainError,
)

# Either a single Redis or a cluster: both offer the commands Sluice uses.
SyncRedis = redis.Redis | redis.cluster.RedisCluster
AsyncRedis = aioredis.Redis | aioredis_cluster.RedisCluster

_sync_clients: dict[str, SyncRedis] = {}
_sync_lock = threading.Lock()
_async_clients: dict[tuple[int, str], AsyncRedis] = {}


# Connections per client: per process (and per node on a cluster). A lane
# worker's threads and the web process's tasks each hold one only for the
# length of a command (or a blocking read), and wait for one when all are in
# use.
SYNC_MAX_CONNECTIONS = 512
ASYNC_MAX_CONNECTIONS = 4096

_request_path_process = False


def request_path_process() -> None:
    """This process runs only the request path (a lane worker, the pacer):
    its sync clients wait out a busy Redis (``SLUICE_REDIS_BUSY_WAIT_S``)
    instead of timing out at ``SLUICE_REDIS_TIMEOUT_S``. Call before the
    first client is made (llm_platform/celery.py, at worker start)."""
    global _request_path_process
    _request_path_process = True
    reset_clients()


def _options(blocking: bool, patient: bool) -> dict:
    # A refused connection fails at once whatever the timeout. On the request
    # path a connect is given the busy wait too: a process whose event loop
    # or threads are behind (a thousand streams admitted at once) reads its
    # own lag as a slow connect.
    timeout = settings.SLUICE_REDIS_BUSY_WAIT_S if patient else settings.SLUICE_REDIS_TIMEOUT_S
    return {
        "socket_connect_timeout": timeout,
        # Blocking reads (BLPOP for a result) set their own server-side timeout.
        "socket_timeout": None if blocking else timeout,
        "health_check_interval": 30,
        "decode_responses": True,
    }


def _pool(pool_class, *, max_connections: int, blocking: bool, patient: bool, **connection):
    """A pool that waits for a free connection (up to the busy wait, or the
    connect timeout where the caller must not wait) instead of raising.
    ``connection``: more of redis-py's connection options (``client_name``)."""
    wait_s = settings.SLUICE_REDIS_BUSY_WAIT_S if (patient or blocking) else settings.SLUICE_REDIS_TIMEOUT_S
    return pool_class.from_url(settings.REDIS_URL, max_connections=max_connections, timeout=wait_s,
                               **_options(blocking, patient), **connection)


def get_redis(*, blocking: bool = False) -> SyncRedis:
    key = "blocking" if blocking else "fast"
    client = _sync_clients.get(key)
    if client is None:
        with _sync_lock:
            client = _sync_clients.get(key)
            if client is None:
                patient = _request_path_process
                if settings.SLUICE_REDIS_CLUSTER:
                    client = redis.cluster.RedisCluster.from_url(settings.REDIS_URL,
                                                                 max_connections=SYNC_MAX_CONNECTIONS,
                                                                 **_options(blocking, patient))
                else:
                    client = redis.Redis(connection_pool=_pool(redis.BlockingConnectionPool, blocking=blocking,
                                                               patient=patient,
                                                               max_connections=SYNC_MAX_CONNECTIONS))
                _sync_clients[key] = client
    return client


def get_async_redis(*, blocking: bool = False) -> AsyncRedis:
    """One client per event loop (a client's connections belong to its loop).
    The event loop serves /v1, the request path: it waits out a busy Redis."""
    loop = asyncio.get_running_loop()
    key = (id(loop), "blocking" if blocking else "fast")
    client = _async_clients.get(key)
    if client is None:
        if settings.SLUICE_REDIS_CLUSTER:
            client = aioredis_cluster.RedisCluster.from_url(settings.REDIS_URL, max_connections=ASYNC_MAX_CONNECTIONS,
                                                            **_options(blocking, True))
        else:
            client = aioredis.Redis(connection_pool=_pool(aioredis.BlockingConnectionPool, blocking=blocking,
                                                          patient=True, max_connections=ASYNC_MAX_CONNECTIONS))
        _async_clients[key] = client
    return client


def async_reader_client(*, name: str) -> aioredis.Redis:
    """A client of one connection, for a task that holds a blocking read
    for many waiters at once (gateway/web/stream_reads.py): patient as the
    request path's, never a cluster's (its read names keys of many slots).
    ``name``: its CLIENT LIST name."""
    return aioredis.Redis(connection_pool=_pool(aioredis.BlockingConnectionPool, blocking=True, patient=True,
                                                max_connections=1, client_name=name))


def reset_clients() -> None:
    """Forget cached clients (after a fork, or in tests that restart Redis)."""
    _sync_clients.clear()
    _async_clients.clear()



def redis_now_ms(client: SyncRedis | None = None) -> float:
    """Redis's clock in ms: every host measures deadlines on the same clock
    (on a cluster, one node's: keep the nodes' clocks in sync, as any
    cluster needs for its own failure detection)."""
    seconds, micros = (client or get_redis()).time()
    return seconds * 1000 + micros / 1000


def parked_release(*, key: str, now_ms: float, send: Callable[[str], None], what: str, limit: int = 100,
                   client: SyncRedis | None = None) -> int:
    """Hand every member of the sorted set ``key`` due by ``now_ms`` to
    ``send`` (retries parked with their due time as score). ZREM is the
    claim, so several releasers send each once; a member whose ``send``
    raised is parked again for 1 s. Returns how many were sent."""
    client = client or get_redis()
    released = 0
    for member in client.zrangebyscore(key, "-inf", now_ms, start=0, num=limit):
        if not client.zrem(key, member):
            continue
        try:
            send(member)
            released += 1
        except Exception:
            logger.exception("enqueueing %s %s failed; retrying in 1 s", what, member)
            client.zadd(key, {member: now_ms + 1000})
    return released


# A page that falls back to what the database holds when Redis is away says
# so: readers note the failure here, and the web UI shows a banner for the
# request (llm_platform/degraded.py starts a fresh note per request).
_unavailable_note: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("redis_unavailable", default=None)


def unavailable_note_start() -> None:
    _unavailable_note.set([])


def unavailable_note(what: str) -> None:
    """Record that ``what`` was served without Redis (no-op outside a request)."""
    logger.warning("%s: Redis unavailable, falling back", what, exc_info=True)
    notes = _unavailable_note.get()
    if notes is not None:
        notes.append(what)


def unavailable_noted() -> list[str]:
    return list(_unavailable_note.get() or [])
