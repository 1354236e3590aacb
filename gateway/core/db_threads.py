"""A lane worker's database work on a few threads of its own.

A lane worker runs a thread per pool call, and grows to as many threads as
its pools hold calls (gateway/worker/lane_pool.py): a thousand streams are a
thousand threads. Django gives every thread its own database connection, so
the ledger rows they write at their ends would open as many PostgreSQL
connections (its default max_connections is 100). Instead, a lane worker
sends the request path's database work (the ledger row, a job's completion)
to ``SLUICE_WORKER_DB_THREADS`` threads of its own and waits for it: as
many connections per process, each kept (``DB_CONN_MAX_AGE``), the call's
result or exception returned to the calling thread as if it had run there.
Any other process (web, beat, the pacer) runs the work where it is called.

A database that holds that work up instead of failing it (a migration's lock
on the ledger table, a hung host) counts as away once the caller has waited
``SLUICE_WORKER_DB_WAIT_S``: the caller gets an OperationalError, as from a
database that went away, and its task is retried later (gateway/worker/
tasks.py ``IDEMPOTENT_TASK``; every step it replays is idempotent on the
request id), so the lane's thread goes back to new calls instead of waiting
on the lock. The held statement goes on and may still commit: the retry's
row is then the same row (INSERT ... ON CONFLICT DO NOTHING). Work not
started by then is dropped from the threads' queue.

``connection_checked``: the web's database work runs in executor threads
(``sync_to_async``), which Django's request signals never reach, so nothing
there would replace a connection a database restart broke: each call checks
its thread's connection first (``database_off_loop``: such a call for an
event loop to await)."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitedOut
from typing import Any, Awaitable, Callable, TypeVar

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections, connections

T = TypeVar("T")

# The database away (a restart, a fail-over, a cut connection): waited out,
# retried or answered 503, never a 500.
DATABASE_AWAY = (OperationalError, InterfaceError)

_executor: ThreadPoolExecutor | None = None
_size = 0
_wait_s: float | None = None
_NAME = "sluice-db"


def database_threads_start(threads: int, *, wait_s: float | None = None) -> None:
    """Run this process's ``on_database`` work on ``threads`` threads (a lane
    worker, at start), each caller waiting for its work ``wait_s`` at most
    (None or 0: without a bound)."""
    global _executor, _size, _wait_s
    if _executor is None:
        _size = max(1, threads)
        _wait_s = wait_s if wait_s and wait_s > 0 else None
        _executor = ThreadPoolExecutor(max_workers=_size, thread_name_prefix=_NAME)


def database_threads_stop() -> None:
    """Close the threads' connections and run the work where it is called again (tests)."""
    global _executor
    executor, _executor = _executor, None
    if executor is None:
        return
    # One close per thread: each waits at the barrier until all are taken.
    threads = _size
    barrier = threading.Barrier(threads)

    def close() -> None:
        barrier.wait(timeout=10)
        connections.close_all()

    for _ in range(threads):
        executor.submit(close)
    executor.shutdown(wait=True)


def _run(fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
    # A connection a database restart broke is replaced, as a task's own is
    # at its start (gateway/worker/tasks.py).
    close_old_connections()
    return fn(*args, **kwargs)


def connection_checked(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with this thread's database connection checked first: one a
    database restart broke, or older than DB_CONN_MAX_AGE, is replaced."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> T:
        close_old_connections()
        return fn(*args, **kwargs)

    return checked


def database_off_loop(fn: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """``fn`` for an event loop to await: on an executor thread, its
    connection checked first."""
    return sync_to_async(connection_checked(fn), thread_sensitive=False)


def on_database(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the process's database threads when it has
    them, else here. Not done within their wait: OperationalError (the
    database away), the work dropped if it has not started."""
    executor = _executor
    if executor is None or threading.current_thread().name.startswith(_NAME):
        return fn(*args, **kwargs)
    work = executor.submit(_run, fn, args, kwargs)
    try:
        return work.result(timeout=_wait_s)
    except WaitedOut:
        work.cancel()
        raise OperationalError(f"the database did not finish {getattr(fn, '__name__', 'the work')} "
                               f"within {_wait_s:g} s") from None
