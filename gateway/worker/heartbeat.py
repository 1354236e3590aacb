"""Heartbeats of the calls a worker process is running, so that a worker
that dies without a word (SIGKILL, OOM, a host gone) is noticed within
seconds instead of at the broker's visibility timeout.

One daemon thread per process renews every running call's heartbeat key
(``<generation>|<holder>``, expiring after ``SLUICE_HEARTBEAT_TTL_S``) in one
pipeline each ``SLUICE_HEARTBEAT_INTERVAL_S``: with 40 calls in flight, one
round trip a second. gateway/core/request/claim.lua sets the first beat when the delivery
starts; a key that has expired is what a lost worker looks like to the web
process and the reaper (gateway/core/request/takeover.py)."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from typing import Iterator

from django.conf import settings

from budgets.redis.clients import get_redis
from gateway.core import keys
from gateway.core.request.records import WORKER, heartbeat_holder, heartbeat_value

logger = logging.getLogger(__name__)


class Heartbeats:
    """The running calls of this process and the thread that beats for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}  # request id -> generation
        self._thread: threading.Thread | None = None
        self._pid = 0

    @property
    def holder(self) -> str:
        return heartbeat_holder(WORKER)

    @contextmanager
    def kept(self, *, request_id: str, generation: int) -> Iterator[None]:
        """Beat for the call while the block runs (it must finish the request:
        once its row is written and it departs, nobody reads the heartbeat
        again; between its publish and its row only the reaper does)."""
        with self._lock:
            self._running[request_id] = generation
            self._thread_ensure()
        try:
            yield
        except BaseException:
            # The attempt failed (its task is retried, maybe by another
            # process): fall silent now, so the retry or a taker need not
            # wait out the TTL.
            self._forget(request_id, generation)
            try:
                client = get_redis()
                key = keys.request_heartbeat(request_id)
                if client.get(key) == heartbeat_value(generation, self.holder):  # not a later delivery's
                    client.delete(key)
            except Exception:  # Redis away: the key expires by itself
                pass
            raise
        self._forget(request_id, generation)

    def _forget(self, request_id: str, generation: int) -> None:
        with self._lock:
            if self._running.get(request_id) == generation:
                del self._running[request_id]

    def running(self) -> dict[str, int]:
        with self._lock:
            return dict(self._running)

    def beat(self) -> int:
        """Renew every running call's heartbeat once; returns how many."""
        running = self.running()
        if not running:
            return 0
        ttl_ms = int(settings.SLUICE_HEARTBEAT_TTL_S * 1000)
        holder = self.holder
        pipe = get_redis().pipeline(transaction=False)
        for request_id, generation in running.items():
            pipe.set(keys.request_heartbeat(request_id), heartbeat_value(generation, holder), px=ttl_ms)
        pipe.execute()
        return len(running)

    def _thread_ensure(self) -> None:
        # A forked child (prefork pool) inherits the registry but not the thread.
        if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="sluice-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = threading.Event()  # never set: a timer that cannot be woken early
        while True:
            tick.wait(settings.SLUICE_HEARTBEAT_INTERVAL_S)
            try:
                self.beat()
            except Exception:  # Redis away: the calls' keys expire, takers act
                logger.warning("heartbeat failed", exc_info=True)


HEARTBEATS = Heartbeats()
