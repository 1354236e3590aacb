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

A consumed message's entry is written just after the consumer's callback
has handed the message on (to the worker's pool), not before: the task
starts while the consumer waits for Redis's reply to the write, one round
trip earlier (bench/PROFILE.md, round 10). An ack, reject or restore of the
message that comes before its entry is written finds it in the QoS's
``_unwritten``: an ack or reject then has nothing to remove (the write is
skipped), a requeue or restore writes it first (it is read back from
Redis), and one that comes while it is being written waits for the write.

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


# An entry being written (``QoS._unwritten``).
_WRITING = object()
# How long an ack waits for its message's entry to be written (Redis hanging).
ENTRY_WRITE_WAIT_S = 30.0


class QoS(kombu_redis.QoS):
    """kombu's unacked bookkeeping (ack emulation), the same two writes in
    the same MULTI/EXEC, sent as ``Commands`` instead of a redis-py
    pipeline: the message's entry when it arrives (``append``) and its
    removal on the ack. Redelivery after a lost worker reads exactly what
    kombu's own QoS writes (``restore_visible`` and ``restore_by_tag`` are
    kombu's). A client kombu wraps (``global_keyprefix``) keeps kombu's
    pipeline."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # delivery tag -> its message, or _WRITING: consumed messages whose
        # entry is not written yet (append_deferred, entry_write_deferred).
        self._unwritten: dict[str, object] = {}
        self._unwritten_changed = threading.Condition()

    def _plain_client(self):
        client = self.channel._create_client()
        return client if type(client) is redis.Redis else None

    def _entry_write(self, client, message, delivery_tag) -> None:
        delivery = message.delivery_info
        Commands(transaction=True).zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
            self.unacked_key, delivery_tag,
            dumps([message._raw, delivery["exchange"], delivery["routing_key"]])).run(client)

    def append(self, message, delivery_tag):
        client = self._plain_client()
        if client is None:
            return super().append(message, delivery_tag)
        self._entry_write(client, message, delivery_tag)
        virtual.QoS.append(self, message, delivery_tag)

    def append_deferred(self, message, delivery_tag) -> bool:
        """``append`` with the entry's write left to ``entry_write_deferred``
        (after the consumer's callback). False: written now (a client kombu
        wraps keeps kombu's own order)."""
        if self._plain_client() is None:
            self.append(message, delivery_tag)
            return False
        with self._unwritten_changed:
            self._unwritten[delivery_tag] = message
        virtual.QoS.append(self, message, delivery_tag)
        return True

    def entry_write_deferred(self, delivery_tag) -> None:
        """Write the entry ``append_deferred`` left, unless an ack, reject
        or restore of the message came first and saw to it."""
        with self._unwritten_changed:
            message = self._unwritten.get(delivery_tag)
            if message is None or message is _WRITING:
                return
            self._unwritten[delivery_tag] = _WRITING
        self._unwritten_write(message, delivery_tag)

    def _unwritten_write(self, message, delivery_tag) -> None:
        try:
            self._entry_write(self._plain_client(), message, delivery_tag)
        finally:
            with self._unwritten_changed:
                self._unwritten.pop(delivery_tag, None)
                self._unwritten_changed.notify_all()

    def unwritten_settle(self, delivery_tag, *, entry_needed: bool) -> bool:
        """Before an ack, reject or restore of ``delivery_tag``: True when its
        entry was never written and never will be (nothing to remove);
        ``entry_needed`` (a requeue or restore reads it back): written now if
        it is still to be. One being written is waited for."""
        with self._unwritten_changed:
            state = self._unwritten.get(delivery_tag)
            if state is None:
                return False
            if state is _WRITING:
                self._unwritten_changed.wait_for(lambda: delivery_tag not in self._unwritten,
                                                 timeout=ENTRY_WRITE_WAIT_S)
                return False
            if not entry_needed:
                del self._unwritten[delivery_tag]
                return True
            self._unwritten[delivery_tag] = _WRITING
        self._unwritten_write(state, delivery_tag)
        return False

    def _indices_remove(self, delivery_tag) -> bool:
        client = self._plain_client()
        if client is None:
            return False
        Commands(transaction=True).zrem(self.unacked_index_key, delivery_tag).hdel(
            self.unacked_key, delivery_tag).run(client)
        return True

    def ack(self, delivery_tag):
        if self.unwritten_settle(delivery_tag, entry_needed=False):
            return virtual.QoS.ack(self, delivery_tag)
        if not self._indices_remove(delivery_tag):
            return super().ack(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if self.unwritten_settle(delivery_tag, entry_needed=requeue):
            return virtual.QoS.ack(self, delivery_tag)
        if requeue or not self._indices_remove(delivery_tag):
            return super().reject(delivery_tag, requeue=requeue)
        virtual.QoS.ack(self, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client = None
    _sync_client_lock = threading.Lock()

    def basic_consume(self, queue, no_ack, callback, consumer_tag, **kwargs):
        """kombu's, with the consumed message's unacked entry written after
        the callback has handed it on (QoS.append_deferred), not before."""
        consumer = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        if not no_ack:
            def _callback(raw_message):
                message = self.Message(raw_message, channel=self)
                tag = message.delivery_tag
                if not self.qos.append_deferred(message, tag):
                    return callback(message)
                try:
                    return callback(message)
                finally:
                    self.qos.entry_write_deferred(tag)

            self.connection._callbacks[queue] = _callback
        return consumer

    def _restore(self, message, leftmost=False):
        # A restore reads the entry back: one not written yet is written first.
        self.qos.unwritten_settle(message.delivery_tag, entry_needed=True)
        return super()._restore(message, leftmost=leftmost)

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
