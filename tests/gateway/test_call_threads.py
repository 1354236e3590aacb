"""The daemon threads a lane worker's pool calls run on
(gateway/worker/shutdown.py ``_CallThreads``): a thread that finished its call
takes the next one, so calls one after another reuse one thread; concurrent
calls each get a thread of their own; a call that hangs holds only its own
thread while the others go on; at most ``keep`` threads wait idle; and a
call's result or exception reaches its caller through ``_Shutdown.call``."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.worker.shutdown import _CallThreads, _Shutdown


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
    ran: list[int] = []

    def hung():
        ran.append(threading.get_ident())
        release_hung.wait(10)

    def together():
        ran.append(threading.get_ident())
        all_in.wait(5)  # four of them at once (and the test): needs four threads

    threads.run(hung)
    for _ in range(4):
        threads.run(together)
    all_in.wait(5)
    assert len(set(ran)) == 5  # the hung call's thread and four more
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
    assert set(later) <= set(ran[1:])
    assert threads.idle() <= 3
    release_hung.set()
