"""A lane worker's threads, sized by the pools behind the lane, not by hand
(docs/architecture.md, "Lanes").

A pool call holds its thread for the whole call (a stream for its whole
length), so a lane with fewer threads than the pools can hold calls keeps
work waiting in Sluice's queue while the GPU runs below its batch. Admission
already bounds what may be in flight: one lease per admitted request, at
most the pool's ``max_concurrency`` (budgets/admission/admit.lua), with the
learned limits of the long lanes below it (gateway/core/protection/
concurrency.py). So a lane's ceiling is the sum of its pools' in-flight
limits, split over the lane's processes: the worker side never becomes the
bottleneck below the admission's gate, for a 16-slot pool and a 1,024-slot
pool alike.

A ceiling costs nothing until it is used: ``LaneThreads`` starts a thread
only when a call finds none idle, and a thread idle for ``IDLE_EXIT_S`` ends
(its database connection closed), so a burst of a thousand streams leaves no
thousand threads behind. A worker starts at its lane's floor (``-c``, the
defaults in gateway/core/lanes.py) and ``LaneSizer`` grows it to the pools'
limits when it is ready and whenever they rise (pool_config_push writes them
to ``POOL_IN_FLIGHT_LIMITS``; one HVALS per ``SLUICE_LANE_SIZE_CHECK_S``).
Growing raises the consumer's prefetch with it (Celery's QoS, as Celery's
own ``pool_grow`` does): with ``worker_prefetch_multiplier`` 1 a worker
reserves exactly as many messages as it can run. A ceiling never shrinks
while the worker runs: calls in flight keep their threads; the threads
themselves go when idle. A lane whose size is set by hand
(``SLUICE_WORKERS_<LANE>``) keeps it.

Why threads and not an event loop per worker: every step of a call (the
claim, the pool's socket, the relay's XADDs, settlement, the ledger) is
synchronous code whose guarantees (redelivery, the deadline race, the
shutdown grace, heartbeats) are written and tested against a thread per
call; a thread waiting on a socket costs no CPU and, measured under a
burst of 1,024 streams, tens of KiB of memory (bench/burst.py reports the
platform's peak RSS). What a thread does cost is the GIL hand-over per
chunk relayed, which the relay keeps to one per batch of tokens the pool
sent together (gateway/worker/streaming.py)."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from celery.concurrency.base import BasePool, apply_target
from prometheus_client import Gauge, multiprocess
from celery.concurrency.thread import ApplyResult
from django.conf import settings
from django.db import connections

from budgets.admission.keys import POOL_IN_FLIGHT_LIMITS
from budgets.redis.clients import get_redis
from gateway.core.lanes import lane_fixed, lane_of_node, lane_processes

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 60.0
_STOP = object()

# A lane's workers, added up over its live processes (/metrics): the calls
# their threads run now, and how many they may run at once. Defined here, not
# in gateway/core/observability.py: the worker imports this module before
# Django's apps are ready.
LANE_CALLS_RUNNING = Gauge("sluice_lane_calls_running", "Calls a lane's worker threads run now.", ["lane"],
                           multiprocess_mode="livesum")
LANE_THREADS_CEILING = Gauge("sluice_lane_threads_ceiling",
                             "Calls a lane's workers may run at once (sized by the pools' in-flight limits).",
                             ["lane"], multiprocess_mode="livesum")


class LaneThreads:
    """Threads started when work finds none idle, up to ``ceiling``; a
    thread idle for ``idle_exit_s`` ends. Work past the ceiling waits in
    order for the next free thread."""

    def __init__(self, ceiling: int, *, name: str = "lane", idle_exit_s: float = IDLE_EXIT_S,
                 on_thread_exit: Callable[[], None] | None = None) -> None:
        self.ceiling = max(1, ceiling)
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._on_thread_exit = on_thread_exit
        self._work: SimpleQueue = SimpleQueue()
        # One permit per idle thread: work that takes one has a thread coming
        # for it; work that finds none starts a thread (below the ceiling).
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._started = 0
        self._busy = 0
        self._stopping = False
        # Told of each change in running work (+1, -1): the lane's gauge.
        self.on_busy: Callable[[int], None] | None = None

    @property
    def threads(self) -> int:
        return len(self._threads)

    @property
    def busy(self) -> int:
        """Work items running now."""
        return self._busy

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        if self._stopping:
            future.cancel()
            return future
        self._work.put((future, fn, args, kwargs))
        if not self._idle.acquire(blocking=False):
            self._thread_start()
        return future

    def _thread_start(self) -> bool:
        """Start one more thread unless the ceiling is reached; whether it did."""
        with self._lock:
            if len(self._threads) >= self.ceiling:
                return False
            self._started += 1
            thread = threading.Thread(target=self._serve, name=f"{self._name}-{self._started}", daemon=True)
            self._threads.add(thread)
        thread.start()
        return True

    def grow_to(self, ceiling: int) -> None:
        """Raise the ceiling (never lowers it); work waiting gets threads now."""
        with self._lock:
            if ceiling <= self.ceiling:
                return
            self.ceiling = ceiling
            waiting = self._work.qsize()
        for _ in range(waiting):
            if not self._thread_start():
                return

    def _serve(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                try:
                    item = self._work.get(timeout=self._idle_exit_s)
                except Empty:
                    # Take back this thread's idle permit; if work took it
                    # meanwhile, that work is in the queue for this thread.
                    if self._idle.acquire(blocking=False):
                        return
                    continue
                if item is _STOP:
                    return
                future, fn, args, kwargs = item
                if future.set_running_or_notify_cancel():
                    self._busy_change(1)
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as exc:  # the task's own errors are Celery's to report
                        future.set_exception(exc)
                    finally:
                        self._busy_change(-1)
                if self._stopping:
                    return
                self._idle.release()
        finally:
            with self._lock:
                self._threads.discard(me)
            if self._on_thread_exit is not None:
                try:
                    self._on_thread_exit()
                except Exception:
                    logger.warning("closing a lane thread's resources failed", exc_info=True)

    def _busy_change(self, delta: int) -> None:
        with self._lock:
            self._busy += delta
        if self.on_busy is not None:
            self.on_busy(delta)

    def stop(self, *, wait: bool = True) -> None:
        """Cancel work not started; let running work finish (``wait``)."""
        self._stopping = True
        while True:
            try:
                item = self._work.get_nowait()
            except Empty:
                break
            if item is not _STOP:
                item[0].cancel()
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._work.put(_STOP)
        if wait:
            for thread in threads:
                thread.join()


def _close_thread_connections() -> None:
    connections.close_all()


class LanePool(BasePool):
    """Celery's pool for a lane worker (``-P gateway.worker.lane_pool:LanePool``):
    Celery's thread pool, with threads started on demand and a ceiling that
    grows (``grow``, also what Celery's ``pool_grow`` control calls)."""

    body_can_be_buffer = True
    signal_safe = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads = LaneThreads(self.limit, name="lane-call", on_thread_exit=_close_thread_connections)

    def on_stop(self) -> None:
        self.threads.stop()
        super().on_stop()

    def on_apply(self, target, args=None, kwargs=None, callback=None, accept_callback=None, **_: Any) -> ApplyResult:
        return ApplyResult(self.threads.submit(apply_target, target, args, kwargs, callback, accept_callback))

    def grow(self, n: int = 1) -> None:
        self.limit += n
        self.threads.grow_to(self.limit)

    def shrink(self, n: int = 1) -> None:
        raise NotImplementedError("a lane's ceiling only grows; idle threads end by themselves")


def dead_workers_gauges_drop(directory: str) -> int:
    """Forget the live gauges of processes that are gone without a word
    (SIGKILL, OOM): a worker that stops cleanly drops its own
    (llm_platform/celery.py), a killed one is dropped by the next worker to
    start. Returns how many processes' gauges were dropped."""
    dropped = set()
    for path in Path(directory).glob("gauge_live*_*.db"):
        pid = path.stem.rpartition("_")[2]
        if not pid.isdigit() or int(pid) in dropped:
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(int(pid), directory)
            dropped.add(int(pid))
        except PermissionError:  # alive, someone else's
            pass
    return len(dropped)


def pools_in_flight_total(client=None) -> int:
    """The sum of the active pools' in-flight limits, as admission holds them."""
    return sum(int(v) for v in (client or get_redis()).hvals(POOL_IN_FLIGHT_LIMITS))


def lane_ceiling(lane: str, pools_total: int, *, floor: int) -> int:
    """Threads one process of ``lane`` needs: its share of the pools' total,
    never below ``floor`` (the lane's start size)."""
    return max(floor, math.ceil(pools_total / lane_processes(lane)))


class LaneSizer:
    """Grows a lane worker's pool to its pools' limits: when the worker is
    ready, then every ``SLUICE_LANE_SIZE_CHECK_S``."""

    def __init__(self, consumer, lane: str) -> None:
        self.consumer = consumer
        self.lane = lane
        self.floor = consumer.pool.limit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> int:
        """Grow now if the pools need it; returns the pool's ceiling."""
        pool = self.consumer.pool
        want = lane_ceiling(self.lane, pools_in_flight_total(), floor=self.floor)
        grow = want - pool.limit
        if grow > 0:
            pool.grow(grow)
            LANE_THREADS_CEILING.labels(self.lane).set(pool.limit)
            multiplier = self.consumer.prefetch_multiplier
            # What the consumer restores after a broker reconnect, and the
            # prefetch now (the consumer's loop applies it: Celery's pool_grow).
            self.consumer.initial_prefetch_count = pool.limit * multiplier
            self.consumer.qos.increment_eventually(grow * multiplier)
            logger.info("lane %s: %d calls at once in this process (the pools hold %d in flight)",
                        self.lane, pool.limit, want * lane_processes(self.lane))
        return pool.limit

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sluice-lane-sizer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # Redis away: the ceiling stays; the next check catches up
                logger.warning("lane %s: sizing from the pools failed", self.lane, exc_info=True)
            if self._stop.wait(settings.SLUICE_LANE_SIZE_CHECK_S):
                return


def lane_sizer_start(consumer, node: str) -> LaneSizer | None:
    """Report this worker's calls on its lane's gauges, and start sizing it
    by its pools, unless its lane is unknown (a worker named by hand), its
    pool is not a LanePool, or its size is set by hand."""
    lane = lane_of_node(node)
    if lane is None or not isinstance(consumer.pool, LanePool):
        return None
    running = LANE_CALLS_RUNNING.labels(lane)
    consumer.pool.threads.on_busy = running.inc
    LANE_THREADS_CEILING.labels(lane).set(consumer.pool.limit)
    if lane_fixed(lane):
        return None
    sizer = LaneSizer(consumer, lane)
    sizer.start()
    return sizer
