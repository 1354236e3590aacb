"""kombu's Redis transport, with one redis-py client per channel.

kombu's Redis channel builds a new ``redis.Redis`` for every synchronous
command or pipeline it sends (``Channel.conn_or_acquire`` and
``QoS.pipe_or_acquire`` call ``_create_client`` each time). The client holds
no connection of its own: it wraps the channel's connection pool, and
building one fills its response-callback table (a ``CaseInsensitiveDict`` of
some 200 entries) anew, about 56 µs of CPU. A lane worker pays it at least
twice per message (the unacked bookkeeping when the message arrives, and the
ack), which made it about 6% of the worker's CPU (bench/PROFILE.md, round 6).

This channel builds that client once per connection pool and hands the same
one out after: ``redis.Redis`` is safe to share between threads (each
command takes a connection from the pool for its own length), and a pool the
channel replaces (it closes and rebuilds ``_pool`` on reconnect) gets a new
client. Nothing else changes: the asynchronous client (the BRPOP/LISTEN
connection kombu registers with its event loop) is still made per use, as
kombu wants it.

Selected for every ``redis`` broker URL of Sluice's processes (``redis://``
and the embedded ``redis+socket://``): kombu takes the transport from the
URL's scheme, so the alias is what picks it (``broker_transport`` cannot win
over a ``+`` prefix). ``rediss://`` (TLS) and ``sentinel://`` keep kombu's own
classes."""

from __future__ import annotations

import threading

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

TRANSPORT = "llm_platform.broker:Transport"


class Channel(kombu_redis.Channel):
    _sync_client = None
    _sync_client_lock = threading.Lock()

    def _create_client(self, asynchronous: bool = False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._sync_client
        if client is None or client.connection_pool is not pool:
            with self._sync_client_lock:
                client = self._sync_client
                if client is None or client.connection_pool is not pool:
                    client = self._sync_client = super()._create_client(asynchronous=False)
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def broker_transport_install() -> None:
    """Point kombu's ``redis`` scheme at this transport (idempotent)."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT
