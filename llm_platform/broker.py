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

Selected for every ``redis`` broker URL of Sluice's processes (``redis://``
and the embedded ``redis+socket://``): kombu takes the transport from the
URL's scheme, so the alias is what picks it (``broker_transport`` cannot win
over a ``+`` prefix). ``rediss://`` (TLS) and ``sentinel://`` keep kombu's own
classes."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from budgets.admission.redis_client import Commands, Sent

TRANSPORT = "llm_platform.broker:Transport"

logger = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    """kombu's unacked bookkeeping (ack emulation), the same two writes in
    the same MULTI/EXEC, sent as ``Commands`` instead of a redis-py
    pipeline: the message's entry when it arrives (``append``) and its
    removal on the ack. Redelivery after a lost worker reads exactly what
    kombu's own QoS writes (``restore_visible`` and ``restore_by_tag`` are
    kombu's). A client kombu wraps (``global_keyprefix``) keeps kombu's
    pipeline.

    A message delivered to a consumer (``Channel.basic_consume``) has its
    entry's write, and its task's arrival work (``ARRIVAL_SENDS``), sent
    before the message is handed to Celery and their replies read after:
    the round trip overlaps the hand-over instead of preceding it. An ack
    or reject of that message first waits for its entry's reply, so the
    removal never goes before the entry."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferring = False
        self._sent: list = []
        # delivery tag -> its entry's write, sent and not read yet
        self._entries: dict = {}

    def _plain_client(self):
        client = self.channel._create_client()
        return client if type(client) is redis.Redis else None

    def append(self, message, delivery_tag):
        client = self._plain_client()
        if client is None:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        # Arrival work that waits on a round trip of its own goes out first:
        # the two round trips overlap.
        arrived = _arrival_send(message)
        commands = Commands(transaction=True).zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
            self.unacked_key, delivery_tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))
        entry = None
        try:
            if self._deferring:
                entry = commands.send(client)
            if entry is None:
                commands.run(client)
        except BaseException:
            if arrived is not None:
                _arrival_read(arrived)
            raise
        if self._deferring:
            if entry is not None:
                self._entries[delivery_tag] = entry
            self._sent.append((delivery_tag, entry, arrived))
        elif arrived is not None:
            _arrival_read(arrived)
        virtual.QoS.append(self, message, delivery_tag)

    def _entry_written(self, delivery_tag) -> None:
        """Wait for the reply of the message's entry, if it is still out."""
        entry = self._entries.pop(delivery_tag, None)
        if entry is not None:
            entry.result()

    def deliveries_begin(self) -> None:
        self._deferring, self._sent = True, []

    def deliveries_end(self) -> None:
        """Read what ``append`` sent while deferring: each entry's replies
        (raising what a failed write raises, as ``append`` would have), then
        each arrival's answer (its owner handles its errors)."""
        sent, self._deferring, self._sent = self._sent, False, []
        failed = None
        for delivery_tag, entry, arrived in sent:
            try:
                if entry is not None:
                    # Read here unless an ack during the hand-over read it
                    # (then its error, if any, went to that ack).
                    self._entry_written(delivery_tag)
            except BaseException as exc:  # noqa: BLE001 - raised once every reply is read
                failed = failed or exc
            if arrived is not None:
                _arrival_read(arrived)
        if failed is not None:
            raise failed

    def _indices_remove(self, delivery_tag) -> bool:
        client = self._plain_client()
        if client is None:
            return False
        self._entry_written(delivery_tag)
        Commands(transaction=True).zrem(self.unacked_index_key, delivery_tag).hdel(
            self.unacked_key, delivery_tag).run(client)
        return True

    def ack(self, delivery_tag):
        if not self._indices_remove(delivery_tag):
            return super().ack(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if requeue:
            self._entry_written(delivery_tag)
        if requeue or not self._indices_remove(delivery_tag):
            return super().reject(delivery_tag, requeue=requeue)
        virtual.QoS.ack(self, delivery_tag)


# Task name -> what to start as one of its messages arrives, before its
# unacked entry is written: ``send(args=, kwargs=)`` sends a round trip of
# its own and returns it (a ``Sent``, read by whoever needs it first; QoS
# reads it after the hand-over at the latest), or None. Registered by the
# worker (llm_platform/celery.py).
ARRIVAL_SENDS: dict[str, Callable[..., Sent | None]] = {}


def _arrival_read(arrived) -> None:
    try:
        arrived.result()
    except Exception:  # noqa: BLE001 - its owner (the task) asks again and handles the error
        pass


def _arrival_send(message):
    """The arrival work of a task message sent now: only for a message to
    run at once (no ETA or countdown, not a retry: one the worker holds
    back must not start its work early)."""
    if not ARRIVAL_SENDS:
        return None
    headers = message.headers or {}
    send = ARRIVAL_SENDS.get(headers.get("task"))
    if send is None or headers.get("eta") or headers.get("countdown") or headers.get("retries"):
        return None
    try:
        # Its own parse of the JSON body, not kombu's ``message.decode()``:
        # that would cache the payload for Celery before Celery's consumer
        # sets the accepted content types, so Celery's check would not run.
        args, kwargs, _embed = json.loads(message.body)
        return send(args=list(args), kwargs=dict(kwargs))
    except Exception:  # noqa: BLE001 - a message Celery will judge itself; nothing early
        logger.debug("arrival work for %s not started", headers.get("id"), exc_info=True)
        return None


class Channel(kombu_redis.Channel):
    QoS = QoS
    _sync_client = None
    _sync_client_lock = threading.Lock()

    def basic_consume(self, queue, *args, **kwargs):
        """kombu's, with each delivery's replies read after its hand-over
        (``QoS.deliveries_begin`` / ``deliveries_end``)."""
        ret = super().basic_consume(queue, *args, **kwargs)
        consume = self.connection._callbacks[queue]
        qos = self.qos

        def deliver(raw_message):
            qos.deliveries_begin()
            try:
                return consume(raw_message)
            finally:
                qos.deliveries_end()

        self.connection._callbacks[queue] = deliver
        return ret

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
