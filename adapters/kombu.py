"""kombu's Redis transport, with one synchronous redis-py client per
connection pool.

Written against kombu 5.7.0 and redis-py 8.2.0 (Celery 5.7.0).

What it replaces: kombu's Redis channel builds a new ``redis.Redis`` for
every synchronous command or pipeline it sends (``Channel.conn_or_acquire``,
and through it ``QoS.pipe_or_acquire``, call ``Channel._create_client``
each time). That client holds no connection of its own, it wraps the
channel's pool, but building one fills its response-callback table anew. A
lane worker pays it at least twice per message: the unacked entry written
when the message arrives and its removal on the ack.

This channel builds the client once per connection pool and hands the same
one out after: ``redis.Redis`` is safe to share between threads (each
command takes a connection from the pool for its own length), and a pool
the channel replaces (kombu drops ``_pool`` on reconnect and after a fork)
gets a new client. Nothing else changes: the pools, the QoS (unacked
bookkeeping, redelivery) and the asynchronous client (the BRPOP connection
kombu registers with its event loop, still one per use) are kombu's own.

Measured gain (``python -m bench.kombu_client_reuse``, kombu 5.7.0,
redis-py 8.2.0, on the shared 2-core dev machine): ``_create_client`` 7.4 us
of CPU per call with kombu's channel, 0.2 us with this one; a message's
delivery and ack 734 us of CPU with kombu's channel, 663 us with this one
(medians of 7 blocks, block ranges overlapping). The lane worker calls it
about twice per request (the unacked entry, the ack), so against the
3.46 ms of CPU per admitted request in bench/RESULTS.md the gain lies
between 0.4% (two calls) and 2% (the per-message median): at or below the
2% the design asks of an override ("Dependencies and library
internals"); rerun the bench on each upgrade.

What an upgrade may break, checked by tests/adapters/test_kombu.py: that
kombu's ``Channel`` still has ``_create_client(asynchronous=...)``, that
``conn_or_acquire`` and the QoS's writes go through it, that ``pool`` builds
``_pool`` lazily and a reconnect sets it back to None, and that this channel
hands out the same client twice and a new one once the pool is replaced.

Selected for every ``redis`` broker URL (``redis://`` and the embedded
``redis+socket://``) by ``transport_install``: kombu takes the transport
from the URL's scheme, so the alias is what picks it (``broker_transport``
cannot win over a ``+`` prefix). ``rediss://`` (TLS) and ``sentinel://``
keep kombu's own classes."""

from __future__ import annotations

import threading

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

TRANSPORT = "adapters.kombu:Transport"


class Channel(kombu_redis.Channel):
    _sync_client = None

    def __init__(self, *args, **kwargs) -> None:
        # Set before kombu's __init__, which already sends commands.
        self._sync_client_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _create_client(self, asynchronous: bool = False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client, pool = self._sync_client, self._pool
        if client is not None and pool is not None and client.connection_pool is pool:
            return client
        # kombu's ``pool`` property builds the pool unlocked: threads racing
        # for the first client would each build one. Built under the lock.
        with self._sync_client_lock:
            pool = self.pool
            client = self._sync_client
            if client is None or client.connection_pool is not pool:
                client = self._sync_client = super()._create_client(asynchronous=False)
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def transport_install() -> None:
    """Point kombu's ``redis`` scheme at this transport (idempotent)."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT
