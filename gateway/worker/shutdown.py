"""A lane worker's stop: out within 5 s of SIGTERM, nothing admitted lost,
no pool called twice (docs/RELIABILITY.md, "A worker stops").

Celery's warm shutdown (SIGTERM) stops consuming, then waits for the tasks
that run; a pool call may run for minutes (SLUICE_UPSTREAM_TIMEOUT_S), and a
cold shutdown cannot stop a thread. So a task decides for itself:

1. Not yet claimed when the stop begins: it hands its message back at once
   (``HandBack``: the task requeues it); the next worker claims the request
   and calls the pool, once.
2. A pool call in flight gets ``SLUICE_WORKER_SHUTDOWN_GRACE_S`` to answer.
   One that answers finishes as always (settled, ledger row, answer relayed).
3. A call still in flight after the grace is interrupted: the task stops
   waiting for it, keeps "interrupted" as the request's answer in Redis,
   and hands the message back. The redelivered task finds that answer and
   finishes the request from it without calling the pool
   (gateway/worker/execution.py). ``pool_call_within_grace`` runs a call
   on the task's own thread when it goes out on a socket of ours (the plain
   http.client path, gateway/worker/pool_client.py): the socket is watched
   (``call_socket_watched``), and at the end of the grace the watcher shuts
   it down, so the blocked read returns at once and the pool sees the
   connection close. Any other call (httpx's) runs on a daemon thread,
   which dies with the process; the threads are kept for the next call
   rather than started for each, a thread's start costing about as much
   CPU again as the handing over. The task's own thread saves the two
   hand-overs (a wake-up of another thread each way) on every plain call.
4. A retry waiting out its backoff stops waiting (``pause``): the last
   attempt's outcome stands.

The signal handler only writes one attribute (``shutdown_begin``) and one
byte to a pipe: it runs in the main thread between two bytecodes, and taking
a lock there can deadlock (gateway/worker/pacer.py); a write is a system
call, no lock. A watcher thread, started when the worker is ready, sleeps in
``select`` on that pipe (idle, it wakes every WATCH_IDLE_S instead of every
WATCH_INTERVAL_S) and turns the attribute into events the task threads wait
on."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Callable, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

# During the grace: how often the watcher looks at the clock.
WATCH_INTERVAL_S = 0.05
# Before the stop: the longest the watcher sleeps without looking, in case a
# wake-up byte never came (the handler writes one: it normally wakes at once).
WATCH_IDLE_S = 1.0


class HandBack(Exception):
    """The worker is stopping: put this request's message back on its queue."""


class CallInterrupted(Exception):
    """The worker's shutdown grace ran out before the pool answered.
    ``started`` False: the call was never made (the grace had already ended)."""

    def __init__(self, *, started: bool) -> None:
        super().__init__("the worker's shutdown grace ended before the pool answered")
        self.started = started


class _CallThreads:
    """Daemon threads for pool calls: one that finished its call waits for
    the next (up to ``keep`` of them idle); one whose call hangs past the
    grace never comes back and dies with the process. Handing a call to a
    waiting thread costs about half of starting a thread per call."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def run(self, job: Callable[[], None]) -> None:
        """Start ``job`` on a thread of its own (which never raises out of it)."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="pool-call", daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            inbox.get()()
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


class _Shutdown:
    def __init__(self) -> None:
        self.deadline: float | None = None  # written by the signal handler, nothing else
        self.stopping = threading.Event()  # set by the watcher: the stop began
        self.expired = threading.Event()  # set by the watcher: the grace is over
        self._lock = threading.Lock()
        self._in_flight: set[threading.Event] = set()
        self._sockets: set[socket.socket] = set()  # plain calls' sockets, shut down when the grace ends
        self._watcher: threading.Thread | None = None
        self.threads = _CallThreads()
        # The handler's wake-up for the watcher; never blocks the handler.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        os.set_blocking(self._wake_read, False)

    def begin(self, grace_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s
            try:
                os.write(self._wake_write, b"\0")
            except OSError:  # the pipe is full: the watcher has a byte to wake on already
                pass

    def watch(self) -> None:
        while self.deadline is None:
            select.select([self._wake_read], [], [], WATCH_IDLE_S)
        self.stopping.set()
        logger.warning("worker stopping: pool calls in flight get %.1fs to answer, work not started goes back",
                       max(0.0, self.deadline - time.monotonic()))
        while time.monotonic() < self.deadline:
            time.sleep(min(WATCH_INTERVAL_S, max(0.0, self.deadline - time.monotonic())))
        with self._lock:
            self.expired.set()
            if self._in_flight:
                logger.warning("worker stopping: %d pool calls still in flight are handed back", len(self._in_flight))
            for done in self._in_flight:
                done.set()  # wake the task waiting on it: CallInterrupted
            if self._sockets:
                logger.warning("worker stopping: %d pool calls on the task's thread are cut off", len(self._sockets))
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the pool sees the close
                except OSError:
                    pass

    def watch_start(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self.watch, name="shutdown-watch", daemon=True)
            self._watcher.start()

    @contextlib.contextmanager
    def socket_watched(self, sock: socket.socket) -> Iterator[None]:
        with self._lock:
            if self.expired.is_set():
                raise CallInterrupted(started=False)
            self._sockets.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._sockets.discard(sock)

    def call_inline(self, fn: Callable[[], T]) -> T:
        if self.expired.is_set():
            raise CallInterrupted(started=False)
        try:
            return fn()
        except CallInterrupted:
            raise
        except Exception as exc:
            # Whatever the cut socket made the call raise: the grace ended.
            if self.expired.is_set():
                raise CallInterrupted(started=True) from exc
            raise

    def call(self, fn: Callable[[], T]) -> T:
        box: dict[str, object] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting task as it is
                box["error"] = exc
            finally:
                done.set()

        with self._lock:
            if self.expired.is_set():
                raise CallInterrupted(started=False)
            self._in_flight.add(done)
        try:
            # A daemon: a call cut off by the stop must not hold the process.
            self.threads.run(run)
            done.wait()  # set by the call, or by the watcher when the grace ends
        finally:
            with self._lock:
                self._in_flight.discard(done)
        if "result" in box:
            return box["result"]  # type: ignore[return-value]
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        raise CallInterrupted(started=True)

    def reset(self) -> None:
        """Back to running (tests that exercise a stop in-process)."""
        with self._lock:
            self.deadline = None
            try:
                while os.read(self._wake_read, 512):
                    pass
            except BlockingIOError:  # drained
                pass
            self.stopping.clear()
            self.expired.clear()
            self._sockets.clear()
            self._watcher = None


_shutdown = _Shutdown()


def shutdown_begin(*, grace_s: float) -> None:
    """From Celery's ``worker_shutting_down`` (a signal handler): one write."""
    _shutdown.begin(grace_s)


def shutdown_watch_start() -> None:
    """Start the watcher (once, when the worker is ready)."""
    _shutdown.watch_start()


def shutdown_requested() -> bool:
    return _shutdown.deadline is not None


def pool_call_within_grace(fn: Callable[[], T], *, inline: bool = False) -> T:
    """``fn()`` (one blocking pool call), or CallInterrupted when the worker's
    shutdown grace ends first. ``inline``: ``fn`` blocks only on sockets it
    watches (``call_socket_watched``), so it runs on this thread."""
    return _shutdown.call_inline(fn) if inline else _shutdown.call(fn)


def call_socket_watched(sock: socket.socket) -> contextlib.AbstractContextManager[None]:
    """While the block runs, the end of the grace shuts ``sock`` down (a call
    on it then raises, and ``pool_call_within_grace`` turns that into
    CallInterrupted); entered after the grace ended, CallInterrupted."""
    return _shutdown.socket_watched(sock)


def shutdown_grace_over() -> bool:
    """Whether the stop's grace has ended: a stream being relayed (which no
    single blocking call covers) ends here (gateway/worker/streaming.py)."""
    return _shutdown.expired.is_set()


def pause(seconds: float) -> bool:
    """Sleep like ``time.sleep``; False when cut short by the stop."""
    return not _shutdown.stopping.wait(seconds)


def shutdown_reset() -> None:
    _shutdown.reset()
