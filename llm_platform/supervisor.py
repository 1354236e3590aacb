"""`make run`'s supervisor: it starts the platform's processes, starts again
one that dies, and stops them all in order (docs/RELIABILITY.md, "`make run`:
an ordered stop, restarts, a Redis that keeps its data").

Why an order: the embedded Redis holds the lanes' queues, the leases and the
requests' records. A lane worker in its shutdown grace settles the calls that
answer and hands the rest back through Redis (gateway/worker/shutdown.py),
and the web process pushes its last refusal counts there as it exits. So
each stage is stopped and waited for before the next one gets its signal:
the web first (no new work), the lane workers (they finish or hand back
within their grace), beat, the pacer, the simulator (which the workers' last
calls still need), and Redis last, which writes its append-only file on
SIGTERM.

Why restarts: a lane worker's death loses nothing by itself (its messages
come back, its calls are taken over), but only while the rest keeps running.
So a child that dies is started again after a backoff that doubles while it
keeps dying young, and at most ``restarts_per_minute`` times a minute: a
crash loop waits for the minute to pass instead of spinning. A child made
with ``restart=False`` (Redis: every other process depends on what it holds)
ends the run instead.

No Django here: run.py passes the settings in, and the tests drive this
module with plain processes."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# A child that ran this long before dying was healthy: its backoff starts over.
HEALTHY_AFTER_S = 60.0
RESTART_WINDOW_S = 60.0
TICK_S = 0.1


@dataclass
class Child:
    name: str
    command: list[str]
    stage: int  # stopped in ascending order of stage; equal stages together
    stop_timeout_s: float  # SIGTERM to SIGKILL
    restart: bool = True
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again
    quick_deaths: int = 0  # deaths in a row, each within HEALTHY_AFTER_S of its start
    restarts: collections.deque = field(default_factory=collections.deque)  # monotonic times, last minute

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Supervisor:
    def __init__(self, *, env: dict[str, str], cwd: Path, log_dir: Path, log: Callable[[str], None],
                 backoff_s: float, backoff_max_s: float, restarts_per_minute: int):
        self.env = env
        self.cwd = cwd
        self.log_dir = log_dir
        self.log = log
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.restarts_per_minute = restarts_per_minute
        self.children: list[Child] = []
        self.hurry = False  # set from a signal handler: stages wait no longer, Redis still gets SIGTERM

    def spawn(self, name: str, command: list[str], *, stage: int, stop_timeout_s: float,
              restart: bool = True) -> Child:
        child = Child(name=name, command=command, stage=stage, stop_timeout_s=stop_timeout_s, restart=restart)
        self.children.append(child)
        self._start(child)
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _start(self, child: Child) -> None:
        with open(self.log_dir / f"{child.name}.log", "ab") as out:
            # Its own session: the terminal's Ctrl-C reaches only run.py, which
            # then stops the children in order.
            child.popen = subprocess.Popen(child.command, cwd=self.cwd, env=self.env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        child.started_at = time.monotonic()
        child.restart_at = None

    def tick(self) -> Child | None:
        """Notice dead children and start due ones again. Returns a dead child
        that must not be restarted (the run should stop), else None."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts.append(now)
                    self._start(child)
                    self.log(f"{child.name} started again (pid {child.popen.pid})")
                continue
            if child.popen is None or child.popen.poll() is None:
                continue
            if not child.restart:
                return child
            self._schedule_restart(child, now)
        return None

    def _schedule_restart(self, child: Child, now: float) -> None:
        lived = now - child.started_at
        child.quick_deaths = child.quick_deaths + 1 if lived < HEALTHY_AFTER_S else 1
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (child.quick_deaths - 1))
        while child.restarts and now - child.restarts[0] >= RESTART_WINDOW_S:
            child.restarts.popleft()
        capped = ""
        if len(child.restarts) >= self.restarts_per_minute:
            window_frees = child.restarts[-self.restarts_per_minute] + RESTART_WINDOW_S - now
            if window_frees > delay:
                delay = window_frees
                capped = f" ({len(child.restarts)} restarts in the last minute, the most allowed)"
        child.restart_at = now + delay
        self.log(f"{child.name} exited (code {child.popen.returncode}) after {lived:.1f}s; starting it again in "
                 f"{delay:.1f}s{capped}; see {self.log_dir / (child.name + '.log')}")

    def stop(self) -> None:
        """Stop every child, stage by stage: SIGTERM to a stage's children,
        wait for them (up to their stop timeout, then SIGKILL), then the next
        stage. With ``hurry`` set (a second Ctrl-C), children still running
        get SIGKILL at once, except those with ``restart=False`` (Redis),
        which still get SIGTERM and their time, so what they hold is saved."""
        for child in self.children:
            child.restart_at = None  # a child waiting for its restart stays down
        for stage in sorted({c.stage for c in self.children}):
            members = [c for c in self.children if c.stage == stage and c.alive()]
            if not members:
                continue
            started = time.monotonic()
            for child in members:
                self._signal(child, signal.SIGKILL if self.hurry and child.restart else signal.SIGTERM)
            for child in members:
                self._wait(child, started)
            self.log(f"stopped {', '.join(c.name for c in members)} in {time.monotonic() - started:.1f}s")

    def _wait(self, child: Child, started: float) -> None:
        deadline = started + child.stop_timeout_s
        while child.popen.poll() is None and time.monotonic() < deadline:
            if self.hurry and child.restart:
                self._signal(child, signal.SIGKILL)
            time.sleep(min(TICK_S, max(0.0, deadline - time.monotonic())))
        if child.popen.poll() is None:
            self.log(f"{child.name} did not stop within {child.stop_timeout_s:g}s of SIGTERM; killing it")
            self._signal(child, signal.SIGKILL)
            child.popen.wait()

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        try:
            os.killpg(child.popen.pid, sig)
        except ProcessLookupError:
            pass
