"""The pacer waits in Redis instead of polling (gateway/worker/pacer.py): a
job parked while it waits wakes it, and a stop asked while it waits ends it
within its longest wait. The pacer runs in-process on a thread, against a
Redis database of the test's own (no pacer of the session's platform takes
the job first) and the real job service."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from budgets.admission.keys import ALERT_RETRIES
from budgets.redis.clients import get_redis, redis_now_ms
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.jobs.lifecycle import job_submit
from gateway.core.request.chat import validate_chat_request
from gateway.core.request.context import context_for_workload
from gateway.models import Batch, Job
from gateway.worker import pacer
from gateway.worker.pacer import StopFlag, pacer_run

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "Summarize the quarterly report."}],
        "max_tokens": 8}


def wait_until(check, what: str, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def pacer_waiting_in_blpop(redis_client) -> bool:
    """Whether a client of the test's Redis database is blocked in BLPOP (the
    pacer's wait). Of its database only: the session platform's pacer waits
    in BLPOP on the session's, all the time."""
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    return any(client.get("cmd") == "blpop" and "b" in client.get("flags", "") and str(client.get("db")) == db
               for client in redis_client.client_list())


@pytest.fixture
def running_pacer():
    """Start ``pacer_run`` on a thread; stop it (and close its database connection) after the test."""
    started: list[tuple[StopFlag, threading.Thread]] = []

    def start() -> tuple[StopFlag, threading.Thread]:
        stop = StopFlag()

        def run() -> None:
            try:
                pacer_run(stop=stop)
            finally:
                connection.close()

        thread = threading.Thread(target=run, name="pacer-under-test", daemon=True)
        thread.start()
        started.append((stop, thread))
        return stop, thread

    yield start
    for stop, thread in started:
        stop.request()
        get_redis().lpush(keys.PACER_WAKE, 1)  # a test may have made its wait long
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_job_parked_while_the_pacer_waits_wakes_it_and_leaves_at_its_time(
        redis_of_its_own, make_caller, running_pacer, monkeypatch):
    # given a pacer with nothing to do, waiting up to 30 s between looks
    monkeypatch.setattr(pacer, "WAIT_MAX_S", 30.0)
    caller = make_caller(workload_class="scheduled", reserved_tpm=6_000, ceiling_tpm=6_000, prompt_tokens_cap=200,
                         max_tokens_cap=64)
    ctx = context_for_workload(caller.workload)
    running_pacer()
    wait_until(lambda: pacer_waiting_in_blpop(redis_of_its_own), "the pacer to wait in BLPOP", 10)
    # when two jobs of a scheduled workload arrive: its leaky bucket (100
    # tokens/s) lets the first out now and parks the second for a fraction
    # of a second
    jobs = [job_submit(ctx=ctx, chat=validate_chat_request(BODY), body=BODY).job for _ in range(2)]
    parked = Job.objects.get(pk=jobs[1].pk)
    assert parked.status == Job.Status.DELAYED and parked.reason == "paced"
    assert redis_of_its_own.zscore(keys.DELAYED_JOBS, str(parked.id)) is not None
    # then the pacer releases it onto its lane well before its 30 s wait would end
    wait_until(lambda: Job.objects.get(pk=parked.pk).status == Job.Status.QUEUED, "the parked job's release", 3)
    assert redis_of_its_own.zcard(keys.DELAYED_JOBS) == 0
    # and goes back to waiting, the wake-up taken
    wait_until(lambda: pacer_waiting_in_blpop(redis_of_its_own), "the pacer to wait again", 3)
    assert redis_of_its_own.llen(keys.PACER_WAKE) == 0


def test_a_stop_asked_while_the_pacer_waits_ends_it_within_its_longest_wait(redis_of_its_own, running_pacer):
    # given a pacer waiting in Redis with nothing to do (longest wait: WAIT_MAX_S)
    stop, thread = running_pacer()
    wait_until(lambda: pacer_waiting_in_blpop(redis_of_its_own), "the pacer to wait in BLPOP", 10)
    # when its stop is asked (what its SIGTERM handler does)
    stop.request()
    # then it ends without waking anyone (generous bound: WAIT_MAX_S plus a step on a slow machine)
    thread.join(timeout=pacer.WAIT_MAX_S + 4)
    assert not thread.is_alive()


def test_an_alert_retry_parked_while_the_pacer_waits_leaves_at_its_time_not_before(
        redis_of_its_own, running_pacer, monkeypatch):
    # given a running pacer, and alert attempts recorded with Redis's clock
    # when they go to the broker
    from budgets.services import alerts

    sent: list[tuple[tuple, float]] = []
    monkeypatch.setattr(alerts, "_send", lambda *attempt: sent.append((attempt, redis_now_ms())))
    running_pacer()
    wait_until(lambda: pacer_waiting_in_blpop(redis_of_its_own), "the pacer to wait in BLPOP", 10)
    # when a failed webhook parks its next attempt 1.5 s out (no wake-up: budgets pushes none)
    due_ms = alerts.alert_retry_schedule(notification_id=41, channel="webhook", attempt=2, delay_s=1.5)
    assert redis_of_its_own.llen(keys.PACER_WAKE) == 0
    # then the pacer sends it once it is due, not before, and within its
    # longest wait after (generous bound for a loaded machine)
    wait_until(lambda: sent, "the alert retry's release", 10)
    (attempt, sent_ms), = sent
    assert attempt == (41, "webhook", 2)
    assert due_ms <= sent_ms <= due_ms + (pacer.WAIT_MAX_S + 1.5) * 1000
    assert redis_of_its_own.zcard(ALERT_RETRIES) == 0


def batch_reads(queries) -> int:
    return sum(Batch._meta.db_table in query["sql"] for query in queries.captured_queries)


def test_an_idle_pacer_reads_the_batches_only_when_woken_or_once_its_idle_look_is_due(redis_of_its_own, monkeypatch):
    # given a pacer that has just looked at the batches and found none running
    monkeypatch.setattr(pacer, "_batches_active", False)
    monkeypatch.setattr(pacer, "_woken", False)
    monkeypatch.setattr(pacer, "_batches_look_next", 0.0)
    with CaptureQueriesContext(connection) as first:
        pacer.pacer_step()
    assert batch_reads(first) == 1
    # when it reads its heads and steps again, nobody having woken it
    with CaptureQueriesContext(connection) as idle:
        for _ in range(3):
            pacer.pacer_wait()
            pacer.pacer_step()
    # then it asks the database nothing about batches
    assert batch_reads(idle) == 0
    # when a batch's start pushes its wake-up before the pacer reads its heads
    Commands().lpush(keys.PACER_WAKE, 1).run(redis_of_its_own)
    pacer.pacer_wait()
    with CaptureQueriesContext(connection) as woken:
        pacer.pacer_step()
        pacer.pacer_step()
    # then the next step looks, once
    assert batch_reads(woken) == 1
    # and likewise when the wake-up lands while it waits in BLPOP
    Commands().lpush(keys.PACER_WAKE, 1).run(redis_of_its_own)
    pacer._wait(pacer.PacerWait(seconds=pacer.WAIT_MAX_S), StopFlag())
    with CaptureQueriesContext(connection) as woken_in_wait:
        pacer.pacer_step()
    assert batch_reads(woken_in_wait) == 1
    # and, unwoken, once its idle look comes due (a lost wake-up's bound)
    monkeypatch.setattr(pacer, "_batches_look_next", time.monotonic() - 0.001)
    with CaptureQueriesContext(connection) as due:
        pacer.pacer_step()
        pacer.pacer_step()
    assert batch_reads(due) == 1
