"""A lane worker's many call threads share a few database connections
(gateway/core/db_threads.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import OperationalError, connection

from gateway.core.db_threads import database_threads_start, database_threads_stop, on_database


@pytest.fixture
def two_database_threads():
    database_threads_start(2)
    yield
    database_threads_stop()


def _backend_pid() -> tuple[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid(), pg_sleep(0.02)")
        return threading.current_thread().name, cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_forty_call_threads_use_two_connections_and_get_their_own_answers(two_database_threads):
    # when 40 threads (a lane's calls) each do their database work at once
    with ThreadPoolExecutor(40) as calls:
        seen = list(calls.map(lambda i: (i, on_database(_backend_pid)), range(40)))
    # then it ran on the two database threads, over two PostgreSQL connections
    assert {name for _, (name, _) in seen} <= {f"sluice-db_{i}" for i in range(2)}
    assert len({pid for _, (_, pid) in seen}) == 2
    assert [i for i, _ in seen] == list(range(40))


@pytest.mark.django_db(transaction=True)
def test_the_callers_get_the_works_exception(two_database_threads):
    def broken(*, why: str) -> None:
        raise LookupError(why)

    with pytest.raises(LookupError, match="no such row"):
        on_database(broken, why="no such row")


@pytest.mark.django_db(transaction=True)
def test_without_database_threads_the_work_runs_where_it_is_called():
    assert on_database(lambda: threading.current_thread().name) == threading.current_thread().name


@pytest.mark.django_db(transaction=True)
def test_work_held_up_past_the_wait_is_answered_as_the_database_away():
    # given one database thread whose callers wait 0.2 s at most
    database_threads_start(1, wait_s=0.2)
    try:
        started, release, ran = threading.Event(), threading.Event(), []

        def held_up() -> None:
            started.set()
            release.wait(10)

        # when its work is held up (a lock) and another caller's work queues behind it
        with ThreadPoolExecutor(1) as other:
            held = other.submit(on_database, held_up)
            assert started.wait(5)
            with pytest.raises(OperationalError, match="did not finish append"):
                on_database(ran.append, "queued")
            # then both callers are answered as the database away, the held work going on
            with pytest.raises(OperationalError, match="did not finish held_up"):
                held.result(timeout=5)
            assert not release.is_set()
        release.set()
        # and the queued work was dropped, not run later; the thread serves the next caller
        assert on_database(lambda: "next") == "next"
        assert ran == []
    finally:
        release.set()
        database_threads_stop()
