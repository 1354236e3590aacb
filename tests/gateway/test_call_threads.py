"""The daemon threads a lane worker's pool calls run on
(gateway/worker/shutdown.py ``_CallThreads``): a thread that finished its call
takes the next one, so calls one after another reuse one thread; concurrent
calls each get a thread of their own; a call that hangs holds only its own
thread while the others go on; at most ``keep`` threads wait idle; and a
call's result or exception reaches its caller through ``_Shutdown.call``.
A call on a socket of ours (the plain path) runs on the caller's own thread
instead, and the end of the grace cuts its socket."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gateway.worker import pool_client as pc
from gateway.worker.shutdown import (CallInterrupted, _CallThreads, _Shutdown, pool_call_within_grace, shutdown_begin,
                                     shutdown_reset, shutdown_watch_start)


def test_calls_one_after_another_reuse_one_thread():
    shutdown = _Shutdown()
    seen = {shutdown.call(lambda: threading.get_ident()) for _ in range(50)}
    assert len(seen) == 1
    assert shutdown.call(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        shutdown.call(lambda: 1 / 0)
    assert shutdown.call(lambda: threading.get_ident()) in seen  # an exception did not cost the thread


def test_concurrent_calls_get_threads_of_their_own_and_a_hung_one_holds_only_its_own():
    threads = _CallThreads(keep=3)
    release_hung = threading.Event()
    all_in = threading.Barrier(5)
    done = threading.Event()
    hung_on: list[int] = []
    ran: list[int] = []

    def hung():
        # Its own list: a thread starts when the scheduler lets it, so the
        # hung call's thread may log in after the four others.
        hung_on.append(threading.get_ident())
        release_hung.wait(10)

    def together():
        ran.append(threading.get_ident())
        all_in.wait(5)  # four of them at once (and the test): needs four threads

    threads.run(hung)
    for _ in range(4):
        threads.run(together)
    all_in.wait(5)
    assert len(set(ran)) == 4 and not set(hung_on) & set(ran)  # the hung call's thread and four more
    # the four go back to wait: ``keep`` of them, the fourth ends
    deadline = time.monotonic() + 5
    while threads.idle() < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # while the hung call still hangs, later calls go on the freed threads
    later = []
    for _ in range(3):
        threads.run(lambda: (later.append(threading.get_ident()), done.set()))
        assert done.wait(5)
        done.clear()
    assert set(later) <= set(ran)
    assert threads.idle() <= 3
    release_hung.set()


def test_an_inline_call_runs_on_the_callers_thread_and_its_result_or_exception_comes_back():
    shutdown = _Shutdown()
    assert shutdown.call_inline(lambda: threading.get_ident()) == threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        shutdown.call_inline(lambda: 1 / 0)


@pytest.fixture
def silent_pool():
    """A pool that accepts a connection, reads the request and never answers;
    the connections it saw, and one entry for each its caller closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[socket.socket] = []
    closed: list[bool] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            seen.append(conn)
            try:
                while conn.recv(65536):  # the request, in as many pieces as it comes; then the caller's close
                    pass
            except OSError:  # reset: closed too
                pass
            closed.append(True)

    threading.Thread(target=serve, daemon=True).start()
    pc._clients.clear()
    pc._plain.clear()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", seen, closed
    finally:
        listener.close()
        shutdown_reset()
        pc._clients.clear()
        pc._plain.clear()


def test_a_plain_call_on_the_tasks_thread_is_cut_off_when_the_grace_ends(silent_pool, settings):
    settings.SLUICE_POOL_PLAIN_HTTP = True
    url, seen, closed = silent_pool
    client = pc.pool_client(base_url=url, api_key_env="")
    assert pc.pool_call_inline(client)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    # when the worker's stop begins while a plain call waits on a pool that never answers
    shutdown_watch_start()
    started = time.monotonic()
    shutdown_begin(grace_s=0.3)
    with pytest.raises(CallInterrupted) as interrupted:
        pool_call_within_grace(lambda: pc.pool_post(client, body=body), inline=True)
    # then the call ends at the grace, on this thread, as a call that may have reached the pool
    assert 0.25 <= time.monotonic() - started < 3.0
    assert interrupted.value.started is True
    # and the pool sees its connection close (a pool stops generating for it)
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [True] and len(seen) == 1
    # and a call after the grace never goes out
    with pytest.raises(CallInterrupted) as late:
        pool_call_within_grace(lambda: pc.pool_post(client, body=body), inline=True)
    assert late.value.started is False
    time.sleep(0.2)
    assert len(seen) == 1
