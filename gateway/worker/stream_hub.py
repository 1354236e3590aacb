"""The lane worker's relay thread: every stream on the plain path, read and
relayed by one thread per process (docs/architecture.md, "Streaming").

A streamed call's thread (gateway/worker/streaming.py) opens the call as
before, hands the answer's socket to the hub and waits; the hub watches all
the process's pool sockets with one selector. Each pass reads what came on
every ready socket (one read each: one batch of tokens per stream), decodes
the HTTP body (chunked, sized or to the close), splits it into the events'
lines, and sends every stream's append of the pass in one write to Redis:
one round trip per pass instead of one per stream per batch, and no thread
woken per token. What a stream relays, when its cancel flag is read and
what it settles on stay the stream's own (``HubFlow``: the same code the
thread path runs); the hub only moves bytes.

A stream ends on its ``[DONE]`` (after the body's end, read within
``PlainStream.DRAIN_S``, so the connection is kept), an error event, the
caller's cancel, the worker's stop (its grace over: ``stopped``), the pool
closing the connection, a body the hub cannot decode (httpx's ``ReadError``,
as the thread path raises) or a socket quiet for the call's read timeout
(``ReadTimeout``). A failure of the Redis write fails the streams in it
with that error, as the thread path's append raises it."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Protocol

import httpx

from budgets.redis.clients import get_redis
from budgets.redis.composition import Commands
from gateway.core.request.streams import stream_append_cancelled, stream_append_commands, stream_notice_commands
from gateway.worker.pool_client import READ_BYTES, PlainStream, SseLines
from gateway.worker.shutdown import shutdown_grace_over

logger = logging.getLogger(__name__)

# How often a pass runs with streams open and no socket ready: the read
# timeouts, the worker's stop and the drain deadlines are checked then.
IDLE_PASS_S = 0.1
# A chunk-size or trailer line longer than this is not HTTP/1.1 chunking.
LINE_MAX = 4096


class HubFlow(Protocol):
    """What a stream's relay tells the hub (gateway/worker/streaming.py)."""

    request_id: str
    stream_wake: str  # the waiting web process's notice stream ('' none)

    def take(self, lines: list[str]) -> list[str]:
        """The events of one read's lines to relay now."""

    def mark(self, chunks: list[str]) -> tuple[bool, str | None]:
        """Count ``chunks`` as relayed: (read the cancel flag with them, the
        stored answer to set with them)."""

    def over(self) -> bool:
        """Whether the stream has said its last (``[DONE]`` or an error event)."""

    def done(self) -> bool:
        """Whether ``[DONE]`` came (the body's end is then waited for, briefly)."""

    def left(self) -> list[str]:
        """Events held back and not relayed yet (the opening chunk), taken."""


class BodyDecoder:
    """An HTTP/1.1 response body from its raw bytes: chunked, sized, or to
    the connection's close. ``feed`` gives the body's bytes; ``complete``
    once its end is read; ValueError for bytes that are not its framing."""

    __slots__ = ("chunked", "left", "buf", "state", "complete")

    def __init__(self, *, chunked: bool, length: int | None) -> None:
        self.chunked, self.left = chunked, length
        self.buf = bytearray()
        self.state = "size"
        self.complete = not chunked and length == 0

    def feed(self, data: bytes) -> bytes:
        if not self.chunked:
            if self.left is None:
                return data
            data = data[:self.left]
            self.left -= len(data)
            self.complete = self.left == 0
            return data
        buf = self.buf
        buf += data
        out = bytearray()
        while not self.complete:
            if self.state == "data":
                if not buf:
                    break
                take = min(self.left, len(buf))
                out += buf[:take]
                del buf[:take]
                self.left -= take
                if self.left == 0:
                    self.state = "crlf"
                continue
            if self.state == "crlf":
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise ValueError("a chunk does not end with CRLF")
                del buf[:2]
                self.state = "size"
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > LINE_MAX:
                    raise ValueError("a chunk-size line is too long")
                break
            line = bytes(buf[:end])
            del buf[:end + 2]
            if self.state == "trailer":
                self.complete = not line
                continue
            size = int(line.split(b";", 1)[0].strip() or b"x", 16)  # ValueError when not hex
            if size < 0:
                raise ValueError("a negative chunk size")
            self.state, self.left = ("trailer", 0) if size == 0 else ("data", size)
        return bytes(out)


class _Stream:
    """One stream in the hub: its socket, body, lines and outcome."""

    def __init__(self, stream: PlainStream, flow: HubFlow) -> None:
        self.stream, self.flow = stream, flow
        self.sock, head, chunked, length, self.timeout_s = stream.hand_over()
        self.body = BodyDecoder(chunked=chunked, length=length)
        self.lines = SseLines()
        self.head = head
        self.last_read = time.monotonic()
        self.drain_until: float | None = None
        self.cancelled = self.stopped = False
        self.error: BaseException | None = None
        self.closing = False  # ends once this pass's append is out
        self.ended = threading.Event()

    def url(self) -> str:
        return self.stream.url


class StreamHub:
    """The process's relay thread (``stream_hub_relay`` starts it)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[_Stream] = []
        self._streams: set[_Stream] = set()
        self._thread = threading.Thread(target=self._run, name="stream-hub", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, item: _Stream) -> None:
        with self._lock:
            self._new.append(item)
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:  # a wake is already pending
            pass

    def _run(self) -> None:
        while True:
            try:
                self._pass()
            except Exception as exc:  # a defect here must not leave its streams' threads waiting
                logger.exception("the stream hub's pass failed; its streams end with the error")
                for item in list(self._streams):
                    self._end(item, error=exc)

    def _pass(self) -> None:
        # With no stream there is nothing to time out: sleep until one is added.
        ready = self._selector.select(IDLE_PASS_S if self._streams else None)
        with self._lock:
            new, self._new = self._new, []
        appends: list[tuple[_Stream, list[str]]] = []
        for item in new:
            self._streams.add(item)
            try:
                self._selector.register(item.sock, selectors.EVENT_READ, item)
            except (ValueError, OSError) as exc:  # its socket already closed (the worker's stop cut it)
                item.error = httpx.ReadError(str(exc) or type(exc).__name__,
                                             request=httpx.Request("POST", item.url()))
                item.closing = True
                continue
            if item.head:  # what came with the answer's headers
                self._take(item, item.head, appends)
                item.head = b""
        for key, _ in ready:
            if key.data is None:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            item = key.data
            if item.ended.is_set() or item.closing:
                continue
            self._read(item, appends)
        if appends:
            self._send(appends)
        self._sweep()

    def _read(self, item: _Stream, appends: list) -> None:
        try:
            data = item.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            item.error = httpx.ReadError(str(exc) or type(exc).__name__, request=httpx.Request("POST", item.url()))
            item.closing = True
            return
        item.last_read = time.monotonic()
        if not data:  # the pool closed the connection
            lines = item.lines.end()
            if lines and not item.flow.over():
                self._relay(item, lines, appends)
            if not item.body.complete and item.body.chunked:
                item.error = httpx.RemoteProtocolError("the pool closed the stream before its end",
                                                       request=httpx.Request("POST", item.url()))
            self._close(item, appends)
            return
        self._take(item, data, appends)

    def _take(self, item: _Stream, data: bytes, appends: list) -> None:
        try:
            body = item.body.feed(data)
        except ValueError as exc:
            item.error = httpx.ReadError(f"the pool's answer is not HTTP/1.1: {exc}",
                                         request=httpx.Request("POST", item.url()))
            item.closing = True
            return
        if body and not item.flow.over():
            lines = item.lines.feed(body)
            if lines:
                self._relay(item, lines, appends)
        if item.flow.over():
            if item.body.complete or not item.flow.done():
                self._close(item, appends)
            elif item.drain_until is None:
                self._flush(item, appends)
                item.drain_until = time.monotonic() + PlainStream.DRAIN_S
        elif item.body.complete:
            lines = item.lines.end()
            if lines:
                self._relay(item, lines, appends)
            self._close(item, appends)

    def _relay(self, item: _Stream, lines: list[str], appends: list) -> None:
        chunks = item.flow.take(lines)
        if chunks:
            appends.append((item, chunks))

    def _flush(self, item: _Stream, appends: list) -> None:
        """The stream said its last: an event still held (the opening chunk
        of a stream that ended before its first token) goes out now."""
        if item.error is None:
            held = item.flow.left()
            if held:
                appends.append((item, held))

    def _close(self, item: _Stream, appends: list) -> None:
        self._flush(item, appends)
        item.closing = True

    def _send(self, appends: list[tuple[_Stream, list[str]]]) -> None:
        """Every stream's append of this pass in one write, and after them
        one notice per web process naming its streams of the pass."""
        batches = []
        notices: dict[str, tuple[list[str], list[bool]]] = {}
        for item, chunks in appends:
            watch, answer_if_lost = item.flow.mark(chunks)
            batches.append((item, watch, stream_append_commands(request_id=item.flow.request_id, chunks=chunks,
                                                                watch=watch, answer_if_lost=answer_if_lost)))
            if item.flow.stream_wake:
                named, renew = notices.setdefault(item.flow.stream_wake, ([], [False]))
                named.append(item.flow.request_id)
                renew[0] = renew[0] or watch
        notice_commands = [stream_notice_commands(Commands(), wake=wake, request_ids=named, renew=renew[0])
                           for wake, (named, renew) in notices.items()]
        try:
            replies = Commands.run_together([commands for _, _, commands in batches] + notice_commands,
                                            get_redis())[:len(batches)]
        except Exception as exc:
            for item, _, _ in batches:
                item.error, item.closing = exc, True
            return
        for (item, watch, _), reply in zip(batches, replies, strict=True):
            if isinstance(reply, BaseException):
                item.error, item.closing = reply, True
            elif stream_append_cancelled(reply, watch=watch):
                item.cancelled, item.closing = True, True
        if shutdown_grace_over():
            for item, _, _ in batches:
                if not item.closing:
                    item.stopped, item.closing = True, True

    def _sweep(self) -> None:
        now = time.monotonic()
        stopping = shutdown_grace_over()
        for item in list(self._streams):
            if item.closing:
                self._end(item)
            elif item.drain_until is not None and now >= item.drain_until:
                self._end(item)  # [DONE] came, the body's end did not: the connection is not kept
            elif stopping:
                item.stopped = True
                self._end(item)
            elif item.timeout_s is not None and now - item.last_read >= item.timeout_s:
                self._end(item, error=httpx.ReadTimeout("the pool's stream timed out",
                                                        request=httpx.Request("POST", item.url())))

    def _end(self, item: _Stream, *, error: BaseException | None = None) -> None:
        if item.ended.is_set():
            return
        if error is not None and item.error is None:
            item.error = error
        self._streams.discard(item)
        try:
            self._selector.unregister(item.sock)
        except (KeyError, ValueError, OSError):
            pass
        item.stream.take_back(complete=item.body.complete and item.error is None)
        item.ended.set()


_hub: StreamHub | None = None
_hub_lock = threading.Lock()


def _hub_of_process() -> StreamHub:
    global _hub
    with _hub_lock:
        if _hub is None or _hub.pid != os.getpid() or not _hub.alive():
            _hub = StreamHub()
        return _hub


def stream_hub_relay(stream: PlainStream, flow: HubFlow) -> tuple[bool, bool]:
    """Relay ``stream`` on the process's hub and wait for its end:
    (cancelled, stopped); a broken stream raises as the thread path raises."""
    item = _Stream(stream, flow)
    hub = _hub_of_process()
    hub.add(item)
    while not item.ended.wait(1.0):
        if not hub.alive():  # cannot happen short of a defect: do not wait forever
            raise httpx.ReadError("the stream hub stopped", request=httpx.Request("POST", stream.url))
    if item.error is not None:
        raise item.error
    return item.cancelled, item.stopped
