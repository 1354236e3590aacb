"""Every process kind exits within 5 s of SIGTERM under load, and nothing it
held is lost or charged twice (docs/RELIABILITY.md): the web server (uvicorn),
a lane worker (Celery, threads pool), the pacer, beat and the simulated pool.

After each stop (and a replacement process where the work needs one) every
admitted request ends with exactly one ledger row and a settled lease, the
pool saw each request exactly once, and the buckets' counters equal the
ledger's tokens."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import httpx
import pytest

from budgets.admission import keys
from budgets.models import UsageRecord
from gateway.core.lanes import queue_for_lane
from gateway.models import Job
from llm_platform import processes
from tests.platform_harness import Process, free_port, wait_http

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

STOP_WITHIN_S = 5.0
HELLO = [{"role": "user", "content": "Tell me when you are done."}]


def sigterm_and_time(process: Process) -> float:
    """SIGTERM to the process itself (as an orchestrator sends it) and the
    seconds until it exited (waiting a while longer than promised, so a
    failure says by how much it missed)."""
    started = time.monotonic()
    process.popen.send_signal(signal.SIGTERM)
    try:
        process.popen.wait(timeout=STOP_WITHIN_S * 4)
    except Exception:
        pytest.fail(f"{process.name} still running {STOP_WITHIN_S * 4:g}s after SIGTERM:\n{process.log_tail()}")
    elapsed = time.monotonic() - started
    assert elapsed < STOP_WITHIN_S, f"{process.name} took {elapsed:.1f}s to stop:\n{process.log_tail()}"
    return elapsed


def wait_until(check, what: str, timeout: float = 60.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def assert_every_admitted_request_settled_once(caller, redis_client, *, timeout: float = 60.0) -> list[UsageRecord]:
    """One ledger row per admitted request, no lease left, counters = ledger."""
    pool_id, workload_id = caller.pool.id, caller.workload.id

    def settled() -> bool:
        admitted = int(redis_client.hget(keys.pool_counters(pool_id), f"{workload_id}.admitted_req") or 0)
        rows = UsageRecord.objects.filter(workload=caller.workload).count()
        return admitted > 0 and rows == admitted and redis_client.zcard(keys.workload_leases(pool_id, workload_id)) == 0

    wait_until(settled, "every admitted request to settle", timeout)
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert len({row.request_id for row in rows}) == len(rows)
    debited = int(redis_client.hget(keys.pool_counters(pool_id), f"{workload_id}.debited_tok"))
    assert debited == sum(row.actual_input_tokens + row.actual_output_tokens for row in rows)
    return rows


def chat(base_url: str, api_key: str, *, latency_ms: int, output_tokens: int = 5) -> httpx.Response | Exception:
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 16,
                                "sim": {"output_tokens": output_tokens, "latency_ms": latency_ms}})
    except httpx.HTTPError as exc:  # a connection the stopping web server closed
        return exc


def start_lane_worker(platform, redis_client, name: str, lane: str, concurrency: int, tmp_path) -> Process:
    hostname = f"{lane}@{socket.gethostname()}"
    redis_client.hdel("sluice:workers:ready", hostname)
    worker = Process(name, processes.worker_command(lane=lane, concurrency=concurrency), platform.env, tmp_path).start()
    wait_until(lambda: worker.assert_alive() or redis_client.hexists("sluice:workers:ready", hostname),
               f"{name} to be ready")
    return worker


@pytest.fixture
def sim_caller(platform, make_caller):
    # queue timeout long enough that work handed back waits for the replacement
    return make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), queue_timeout_s=60)


def test_a_worker_stopped_mid_call_hands_work_back_and_nothing_is_called_twice(platform, sim_caller, redis_client,
                                                                              tmp_path):
    # given the interactive lane served by one worker of six threads
    platform.stop_worker("interactive")
    # (messages a worker killed by an earlier test left unacknowledged wait
    # for the visibility timeout; this test looks at its own only)
    unacked_before = set(redis_client.hkeys("unacked"))
    first = start_lane_worker(platform, redis_client, "interactive-first", "interactive", 6, tmp_path)
    second = None
    platform.sim_reset()
    try:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            # when three calls run past the stop's grace (40 s at the pool),
            # three end within it (2.5 s) and three more wait in the queue
            long_calls = [pool.submit(chat, platform.base_url, sim_caller.api_key, latency_ms=200_000) for _ in range(3)]
            short_calls = [pool.submit(chat, platform.base_url, sim_caller.api_key, latency_ms=12_500) for _ in range(3)]
            wait_until(lambda: platform.sim_stats()["requests_total"] == 6, "six calls at the pool", 30, 0.02)
            queued_calls = [pool.submit(chat, platform.base_url, sim_caller.api_key, latency_ms=0) for _ in range(3)]
            wait_until(lambda: redis_client.llen(queue_for_lane("interactive")) == 3, "three queued", 30, 0.02)
            # and the worker gets SIGTERM
            stopped_in = sigterm_and_time(first)
            # then it left within 5 s, the calls cut short and the ones never
            # started back on the queue at once (not after the broker's
            # visibility timeout), none left unacknowledged
            assert stopped_in < STOP_WITHIN_S
            assert first.popen.returncode == 0, first.log_tail()
            assert redis_client.llen(queue_for_lane("interactive")) == 6
            assert set(redis_client.hkeys("unacked")) - unacked_before == set()
            # and a replacement finishes everything
            second = start_lane_worker(platform, redis_client, "interactive-second", "interactive", 6, tmp_path)
            long_answers = [call.result(timeout=90) for call in long_calls]
            other_answers = [call.result(timeout=90) for call in short_calls + queued_calls]
        # the calls that finished in the grace and the queued ones succeeded
        assert [answer.status_code for answer in other_answers] == [200] * 6
        # the interrupted ones were told to retry, not run again
        for answer in long_answers:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "worker_shutdown"
            assert answer.headers["retry-after"] == "1"
        # the pool saw each request once
        assert platform.sim_stats()["requests_total"] == 9
        rows = assert_every_admitted_request_settled_once(sim_caller, redis_client)
        assert len(rows) == 9
        interrupted = [row for row in rows if row.error == "worker_shutdown"]
        assert len(interrupted) == 3
        # charged their estimate: what the pool did with a cut call is unknown
        for row in interrupted:
            assert row.status == "upstream_error"
            assert (row.actual_input_tokens, row.actual_output_tokens) == (row.estimated_input_tokens,
                                                                            row.estimated_output_tokens)
    finally:
        first.kill()
        if second is not None:
            second.stop()
        platform.start_worker("interactive")
        platform.wait_workers_ready(["interactive"])


def test_the_web_server_stops_within_5s_and_work_it_admitted_still_settles(platform, sim_caller, redis_client,
                                                                           tmp_path):
    # given a second web server taking calls, some of which last 8 s at the pool
    port = free_port()
    web = Process("web-stopped", processes.web_command(port=port), platform.env, tmp_path).start()
    wait_http(f"http://127.0.0.1:{port}/readyz", web)
    base_url = f"http://127.0.0.1:{port}"
    platform.sim_reset()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(chat, base_url, sim_caller.api_key, latency_ms=latency)
                     for latency in [2_500] * 4 + [40_000] * 4]
            wait_until(lambda: platform.sim_stats()["requests_total"] == 8, "eight calls at the pool", 30, 0.02)
            # when it gets SIGTERM
            stopped_in = sigterm_and_time(web)
            answers = [call.result(timeout=60) for call in calls]
        # then it left within 5 s: the short calls were answered, the long
        # ones' connections closed after the grace
        assert stopped_in < STOP_WITHIN_S
        assert [getattr(a, "status_code", None) for a in answers[:4]] == [200] * 4
        assert all(isinstance(a, httpx.HTTPError) for a in answers[4:]), answers[4:]
        # and everything it admitted ran once, settled once, and reached the ledger
        rows = assert_every_admitted_request_settled_once(sim_caller, redis_client)
        assert len(rows) == 8 and {row.status for row in rows} == {"ok"}
        assert platform.sim_stats()["requests_total"] == 8
        # while the platform's own web server carries on
        assert chat(platform.base_url, sim_caller.api_key, latency_ms=0).status_code == 200
    finally:
        web.kill()


def test_the_pacer_stops_within_5s_and_loses_no_delayed_job(platform, make_caller, redis_client, tmp_path):
    # given a scheduled workload whose twelve jobs leave its leaky bucket one
    # every ~0.9 s, and only our pacer releasing them
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="scheduled",
                         reserved_tpm=1_500, prompt_tokens_cap=200, max_tokens_cap=64)
    platform.pacer.stop()
    first = Process("pacer-first", processes.pacer_command(), platform.env, tmp_path).start()
    second = None
    platform.sim_reset()
    try:
        job_ids = []
        for _ in range(12):
            response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30,
                                  headers={"Authorization": f"Bearer {caller.api_key}"},
                                  json={"model": "sim-small", "messages": HELLO, "max_tokens": 8,
                                        "sim": {"output_tokens": 3}})
            assert response.status_code == 202, response.text
            job_ids.append(response.json()["id"])
        # when the pacer is stopped while it is releasing them
        wait_until(lambda: Job.objects.filter(pk__in=job_ids, status="succeeded").count() >= 2, "two jobs done")
        stopped_in = sigterm_and_time(first)
        assert stopped_in < STOP_WITHIN_S
        assert first.popen.returncode == 0, first.log_tail()
        left = redis_client.zcard("sluice:jobs:delayed")
        assert left > 0  # it was stopped mid-way
        # then every job is either done, on its lane, or still delayed: none dropped
        delayed = set(redis_client.zrange("sluice:jobs:delayed", 0, -1))
        for job in Job.objects.filter(pk__in=job_ids):
            assert job.status != "delayed" or str(job.id) in delayed, job.id
        # and a replacement pacer releases the rest
        second = Process("pacer-second", processes.pacer_command(), platform.env, tmp_path).start()
        wait_until(lambda: Job.objects.filter(pk__in=job_ids, status="succeeded").count() == 12, "all twelve jobs",
                   90, 0.2)
        rows = assert_every_admitted_request_settled_once(caller, redis_client)
        assert len(rows) == 12
        assert platform.sim_stats()["requests_total"] == 12
    finally:
        first.kill()
        if second is not None:
            second.stop()
        platform.start_pacer()


def test_an_idle_lane_worker_stops_within_5s_with_its_queue_read_in_flight(platform, redis_client, tmp_path):
    # given a second worker of the scheduled lane, idle past its queue read's
    # wait (llm_platform.celery.BROKER_POLL_S): a BRPOP is always in flight
    from llm_platform.celery import BROKER_POLL_S

    node = f"{processes.worker_node('scheduled', 1)}@{socket.gethostname()}"
    redis_client.hdel("sluice:workers:ready", node)
    worker = Process("worker-idle", processes.worker_command(lane="scheduled", concurrency=2, index=1), platform.env,
                     tmp_path).start()
    try:
        wait_until(lambda: worker.assert_alive() or redis_client.hexists("sluice:workers:ready", node),
                   "the idle worker to be ready")
        time.sleep(BROKER_POLL_S + 1)  # an idle span, not a wait for another process
        # when it is stopped, then it exits within the bound, its read in flight or not
        assert sigterm_and_time(worker) < STOP_WITHIN_S
        assert worker.popen.returncode == 0, worker.log_tail()
    finally:
        worker.kill()


def test_beat_stops_within_5s(platform, tmp_path):
    command = [*processes.beat_command(schedule_dir=str(tmp_path)), "-l", "INFO"]  # to see it send tasks
    beat = Process("beat-stopped", command, platform.env, tmp_path).start()
    try:
        # running: sending the tasks due at its start
        wait_until(lambda: beat.assert_alive() or "Sending due task" in beat.log_tail(20_000), "beat to send tasks", 60)
        assert sigterm_and_time(beat) < STOP_WITHIN_S
        assert not (tmp_path / "beat.pid").exists()  # a clean exit removes it
    finally:
        beat.kill()


def test_the_simulated_pool_stops_within_5s_with_calls_in_flight(tmp_path):
    port = free_port()
    sim = Process("sim-stopped", processes.sim_command(port=port), dict(os.environ), tmp_path).start()
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", sim)
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            calls = [pool.submit(httpx.post, f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                                 json={"model": "sim-small", "messages": HELLO, "max_tokens": 8,
                                       "sim": {"latency_ms": 60_000}}) for _ in range(5)]
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/admin/stats").json()["requests_total"] == 5,
                       "five calls in flight", 30, 0.02)
            assert sigterm_and_time(sim) < STOP_WITHIN_S
            # the calls it cut short were not answered as if they had succeeded
            for call in calls:
                try:
                    assert call.result(timeout=30).status_code >= 500
                except httpx.HTTPError:
                    pass
    finally:
        sim.kill()
