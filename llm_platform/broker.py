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

Its QoS (kombu's ack emulation: each delivered message's entry in the
unacked hash and index, written when it arrives and removed on its ack)
sends the same two writes in the same MULTI/EXEC as ``Commands``
(budgets/admission/redis_client.py) rather than through redis-py's
``Pipeline``, which cost about as much again as the writes themselves.

Its connection pools are ``LeanPool``s (budgets/admission/redis_client.py):
redis-py's pool without the metrics it records on every checkout and return.

Selected for every ``redis`` broker URL of Sluice's processes (``redis://``
and the embedded ``redis+socket://``): kombu takes the transport from the
URL's scheme, so the alias is what picks it (``broker_transport`` cannot win
over a ``+`` prefix). ``rediss://`` (TLS) and ``sentinel://`` keep kombu's own
classes."""

from __future__ import annotations

import threading
import time

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from budgets.admission.redis_client import Commands, LeanPool

TRANSPORT = "llm_platform.broker:Transport"


class QoS(kombu_redis.QoS):
    """kombu's unacked bookkeeping (ack emulation), the same two writes in
    the same MULTI/EXEC, sent as ``Commands`` instead of a redis-py
    pipeline: the message's entry when it arrives (``append``) and its
    removal on the ack. Redelivery after a lost worker reads exactly what
    kombu's own QoS writes (``restore_visible`` and ``restore_by_tag`` are
    kombu's). A client kombu wraps (``global_keyprefix``) keeps kombu's
    pipeline."""

    def _plain_client(self):
        client = self.channel._create_client()
        return client if type(client) is redis.Redis else None

    def append(self, message, delivery_tag):
        client = self._plain_client()
        if client is None:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        Commands(transaction=True).zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
            self.unacked_key, delivery_tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        ).run(client)
        virtual.QoS.append(self, message, delivery_tag)

    def _indices_remove(self, delivery_tag) -> bool:
        client = self._plain_client()
        if client is None:
            return False
        Commands(transaction=True).zrem(self.unacked_index_key, delivery_tag).hdel(
            self.unacked_key, delivery_tag).run(client)
        return True

    def ack(self, delivery_tag):
        if not self._indices_remove(delivery_tag):
            return super().ack(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if requeue or not self._indices_remove(delivery_tag):
            return super().reject(delivery_tag, requeue=requeue)
        virtual.QoS.ack(self, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client = None
    _sync_client_lock = threading.Lock()

    def _get_pool(self, asynchronous: bool = False):
        params = self._connparams(asynchronous=asynchronous)
        self.keyprefix_fanout = self.keyprefix_fanout.format(db=params["db"])  # as kombu's own does
        return LeanPool(**params)

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


def broker_transport_install() -> None:
    """Point kombu's ``redis`` scheme at this transport (idempotent)."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT
