"""Every stream a web process relays, read by one blocking XREAD
(docs/architecture.md, "Streaming").

A stream's wait for its first chunk (gateway/web/dispatch.py) and its relay
(gateway/web/relay.py) each ``subscribe`` to the request's Redis Stream; one
task per event loop reads all the subscribed streams at once (``XREAD
BLOCK ... STREAMS k1 k2 ...``) on a connection of its own and hands each
subscriber its entries. One read per batch of the whole process's chunks,
instead of one per stream per batch, and no pooled connection held per
waiting stream: a burst of a thousand streams opens no thousand
connections.

A read names only the streams that may have news, because its cost in
Redis grows with the streams it names (a read naming a thousand streams
held Redis for 1.7 ms, a hundred times a second, in a burst of a thousand
streams). The reader's wake stream is also its notice stream: a worker
that appends to a stream whose record names this reader
(``RequestRecord.stream_wake``) names the request there in the same write,
after the chunks (gateway/core/request/streams.py). A stream is named in
the next read when it subscribes, when a notice names it, when its last
read came back a whole batch (more is waiting), and when its subscriber's
wait ended quiet (a notice lost costs that interval, never a chunk). Every
stream it reads is one this process's dispatch recorded, naming this
reader (``stream_wake_key``). A reader that reads a whole
batch of notices may have fallen behind them: its next read names every
stream.

A new subscriber wakes the blocked read by an XADD to the reader's own wake
stream, which the read names too: the read that follows names the new
stream, and a wake sent before the read reached Redis still wakes it (the
read asks for entries after the last wake it saw). A subscriber whose
caller reads slowly holds at most ``STREAM_READ_BATCH`` entries: past that
its stream is left out of the reads until it catches up (the entries wait
in Redis, as before). A failed read fails every subscriber with its error
(each answers as a failed read of its own would have), and the next
subscriber starts a new reader.

On a Redis Cluster a read cannot name keys of several slots: each stream is
read on its own there (``shared_reads``)."""

from __future__ import annotations

import asyncio
import logging
import uuid

from django.conf import settings

from budgets.redis.clients import REDIS_UNAVAILABLE, async_reader_client, get_async_redis
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.observability import web_stream_read_observe
from gateway.core.request.streams import NOTICE_MAXLEN, NOTICE_TTL_MS, stream_notice_ids
from gateway.web.per_loop import PerLoop

logger = logging.getLogger(__name__)

# Entries per stream per read: a reader that fell behind catches up in few
# reads; also the most a subscriber holds before its stream waits in Redis.
STREAM_READ_BATCH = 256
# The shared read's own timeout: it ends early for every new subscriber, so
# this only bounds how long a reader with no subscribers left lingers.
READ_BLOCK_MS = 5_000

Entry = tuple[str, dict]


def shared_reads() -> bool:
    return not settings.SLUICE_REDIS_CLUSTER


class StreamSub:
    """One stream's subscription: its entries as the reader hands them over."""

    __slots__ = ("key", "last_id", "entries", "error", "_waiter", "_reader")

    def __init__(self, reader: _Reader, key: str, last_id: str) -> None:
        self.key, self.last_id = key, last_id
        self.entries: list[Entry] = []
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._reader = reader

    def _hand(self, entries: list[Entry] | None = None, error: BaseException | None = None) -> None:
        if entries:
            self.last_id = entries[-1][0]
            self.entries.extend(entries)
        if error is not None:
            self.error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self, timeout_s: float) -> list[Entry]:
        """The entries handed over since the last read, waiting up to
        ``timeout_s`` for one; [] when none came. A failed shared read
        raises its error."""
        if not self.entries and self.error is None:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            # A plain timer that ends the wait, not asyncio.timeout's
            # cancellation: a relayed stream waits once per batch it relays.
            timer = loop.call_later(timeout_s, _wait_over, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self.error is not None:
            raise self.error
        entries, self.entries = self.entries, []
        if not entries:
            # Quiet for a whole wait: named in the next read, in case its notice was lost.
            self._reader.due.add(self.key)
            self._reader.wake()
        elif len(entries) >= STREAM_READ_BATCH:
            self._reader.due.add(self.key)
            self._reader.wake()  # it was left out of the reads while full
        return entries

    def close(self) -> None:
        self._reader.unsubscribe(self)


def _wait_over(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Reader:
    """One event loop's shared read."""

    def __init__(self) -> None:
        self.subs: dict[str, StreamSub] = {}
        # The streams the next read names.
        self.due: set[str] = set()
        token = uuid.uuid4().hex
        self.wake_key = keys.web_stream_wake(token)
        self.name = f"sluice-stream-reads-{token[:12]}"  # its connection's CLIENT LIST name
        self.wake_id = "0-0"
        self.task: asyncio.Task | None = None
        self.reading = False  # a read is out: a new subscriber must wake it
        self.woken = False  # a wake is on its way for the read that is out
        self.client = None

    def subscribe(self, key: str, last_id: str) -> StreamSub:
        sub = StreamSub(self, key, last_id)
        self.subs[key] = sub
        self.due.add(key)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="stream-reads")
        else:
            self.wake()
        return sub

    def unsubscribe(self, sub: StreamSub) -> None:
        if self.subs.get(sub.key) is sub:
            del self.subs[sub.key]
            self.due.discard(sub.key)

    def wake(self) -> None:
        if self.reading and not self.woken:
            self.woken = True
            asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        try:
            await (Commands().command("XADD", self.wake_key, "MAXLEN", "~", NOTICE_MAXLEN, "*", "w", "1")
                   .pexpire(self.wake_key, NOTICE_TTL_MS).run_async(get_async_redis()))
        except REDIS_UNAVAILABLE:
            pass  # the read itself fails then, and tells every subscriber

    def _names(self) -> list[str]:
        """The streams the next read names: the due ones whose subscribers
        hold less than a batch. A due stream left out (its subscriber full)
        stays due."""
        chosen: list[str] = []
        full: set[str] = set()
        for key in self.due:
            sub = self.subs.get(key)
            if sub is not None:
                (chosen.append(key) if len(sub.entries) < STREAM_READ_BATCH else full.add(key))
        self.due = full
        return chosen

    def _noticed(self, entries: list) -> None:
        """Read notices (and wakes): the streams they name are due. A whole
        batch of them: the reader may be behind its notices (the oldest may
        be trimmed), so every stream is due."""
        self.wake_id = entries[-1][0]
        if len(entries) >= STREAM_READ_BATCH:
            self.due.update(self.subs)
            return
        for _, fields in entries:
            for request_id in stream_notice_ids(fields):
                key = keys.request_stream(request_id)
                if key in self.subs:
                    self.due.add(key)

    async def _run(self) -> None:
        try:
            if self.client is None:
                self.client = async_reader_client(name=self.name)
            while self.subs:
                names, ids = [self.wake_key], [self.wake_id]
                for key in self._names():
                    names.append(key)
                    ids.append(self.subs[key].last_id)
                self.woken = False
                self.reading = True
                try:
                    # Sent as it is (budgets/redis/composition.py Commands):
                    # a read naming many streams is packed in one call, not
                    # argument by argument through redis-py's xread.
                    (reply,) = await Commands().command(
                        "XREAD", "COUNT", STREAM_READ_BATCH, "BLOCK", READ_BLOCK_MS, "STREAMS", *names, *ids,
                    ).run_async(self.client)
                finally:
                    self.reading = False
                web_stream_read_observe(len(names) - 1)
                for key, entries in _streams_read(reply):
                    if key == self.wake_key:
                        self._noticed(entries)
                        continue
                    sub = self.subs.get(key)
                    if sub is not None and entries:
                        sub._hand([(entry_id, _fields(fields)) for entry_id, fields in entries])
                        if len(entries) >= STREAM_READ_BATCH:
                            self.due.add(key)  # more is waiting
        except (Exception, asyncio.CancelledError) as exc:
            if not isinstance(exc, REDIS_UNAVAILABLE):
                logger.exception("the web process's shared stream read failed")
            error = exc if isinstance(exc, REDIS_UNAVAILABLE) else ConnectionError("the shared stream read failed")
            subs, self.subs = list(self.subs.values()), {}
            self.due = set()
            for sub in subs:
                sub._hand(error=error)
            client, self.client = self.client, None
            if client is not None:
                await _close_quietly(client)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.task = None


def _streams_read(reply) -> list:
    """XREAD's reply as (stream, entries) pairs: a map under RESP3, a list
    of pairs under RESP2, nothing when the read timed out."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else reply


def _fields(fields) -> dict:
    """An entry's fields, flat as Redis sends them, as a dict."""
    if isinstance(fields, dict):
        return fields
    return dict(zip(fields[::2], fields[1::2])) if fields else {}


async def _close_quietly(client) -> None:
    try:
        await client.aclose()
    except (Exception, asyncio.CancelledError):
        pass


# This event loop's shared read.
_readers: PerLoop[_Reader] = PerLoop()


def _reader_of_loop() -> _Reader:
    return _readers.get(_Reader)


def stream_wake_key() -> str:
    """This event loop's shared read's notice stream: what a record of a
    stream this loop relays names (``RequestRecord.stream_wake``)."""
    return _reader_of_loop().wake_key


def stream_subscribe(key: str, last_id: str = "0-0") -> StreamSub:
    """Subscribe to the stream ``key`` from after ``last_id``, on this event
    loop's shared read: its appends name it on this loop's notice stream
    (its record's ``stream_wake`` is ``stream_wake_key()``), and reads name
    it when it has news. Close the subscription when done."""
    return _reader_of_loop().subscribe(key, last_id)
