"""How late the web process's event loop runs a timer: the length of its
turns, on ``/metrics`` (``sluice_web_loop_lag_seconds``).

A web process reads, admits and relays every /v1 request on one event
loop, and each await of a request waits for one turn of it: the steps of
every other request ready by then. Under a burst of relayed streams a turn
can last tens of milliseconds, and a refusal needs about three of them
(docs/architecture.md, request path step 1). The request's own
CPU time says nothing of that wait; this does.

Every ``INTERVAL_S`` a timer falls due; when it runs, how late it is goes to
the histogram, and the next one is set. A plain timer, not a task: a loop
that closes (a test's) drops it without a warning. Watching starts with the
loop's first /v1 request (``loop_lag_watch``, called by llm_platform/asgi.py)."""

from __future__ import annotations

import asyncio

from gateway.core.observability import web_loop_lag_observe
from gateway.web.per_loop import PerLoop

INTERVAL_S = 0.5

_watched: PerLoop[bool] = PerLoop()


def loop_lag_watch() -> None:
    """Watch this event loop's lag from now on (once per loop)."""
    _watched.get(_watch_start)


def _watch_start() -> bool:
    _set(asyncio.get_running_loop())
    return True


def _set(loop: asyncio.AbstractEventLoop) -> None:
    due = loop.time() + INTERVAL_S
    loop.call_at(due, _fired, loop, due)


def _fired(loop: asyncio.AbstractEventLoop, due: float) -> None:
    web_loop_lag_observe(max(0.0, loop.time() - due))
    _set(loop)
