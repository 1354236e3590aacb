"""A lane holds as many calls as its pools can (gateway/worker/lane_pool.py):
threads started on demand up to a ceiling that grows with the pools'
in-flight limits, at start and when a pool's limit rises."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from budgets.admission.keys import POOL_IN_FLIGHT_LIMITS
from budgets.admission.pool_config import pool_config_push
from gateway.core.keys import WORKERS_READY
from gateway.core.lanes import INTERACTIVE
from gateway.worker.lane_pool import LaneThreads, dead_workers_gauges_drop, lane_ceiling
from llm_platform import processes
from tests.platform_harness import Process

WAIT_S = 10.0


def _blocked_jobs(threads: LaneThreads, n: int, release: threading.Event) -> tuple[list, list]:
    started: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            started.append(i)
        release.wait(WAIT_S)
        return i

    return [threads.submit(job, i) for i in range(n)], started


def _until(condition, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_threads_start_only_when_work_finds_none_idle_and_are_reused():
    threads = LaneThreads(100)
    release = threading.Event()
    try:
        assert threads.threads == 0  # a ceiling of 100 costs nothing until used
        futures, started = _blocked_jobs(threads, 5, release)
        assert _until(lambda: len(started) == 5)  # all five run at once
        assert threads.threads == 5 and threads.busy == 5
        release.set()
        assert [f.result(WAIT_S) for f in futures] == [0, 1, 2, 3, 4]
        # idle threads take the next work: no sixth thread for five more jobs in turn
        for i in range(5):
            assert threads.submit(lambda x: x * 2, i).result(WAIT_S) == i * 2
        assert threads.threads == 5
    finally:
        release.set()
        threads.stop()


def test_work_past_the_ceiling_waits_and_runs_when_the_ceiling_grows():
    threads = LaneThreads(2)
    release = threading.Event()
    try:
        futures, started = _blocked_jobs(threads, 5, release)
        assert _until(lambda: len(started) == 2)
        time.sleep(0.2)
        assert len(started) == 2 and threads.threads == 2  # the other three wait, in order
        threads.grow_to(5)
        assert _until(lambda: len(started) == 5)  # the waiting work got threads at once
        assert sorted(started) == [0, 1, 2, 3, 4]
        threads.grow_to(3)  # never lowers it
        assert threads.ceiling == 5
        release.set()
        assert sorted(f.result(WAIT_S) for f in futures) == [0, 1, 2, 3, 4]
    finally:
        release.set()
        threads.stop()


def test_idle_threads_end_with_their_resources_closed():
    closed: list[str] = []
    threads = LaneThreads(10, idle_exit_s=0.2, on_thread_exit=lambda: closed.append(threading.current_thread().name))
    release = threading.Event()
    futures, started = _blocked_jobs(threads, 4, release)
    assert _until(lambda: len(started) == 4)
    release.set()
    for future in futures:
        future.result(WAIT_S)
    assert _until(lambda: threads.threads == 0)
    assert len(closed) == 4
    # and work after that starts a thread again
    assert threads.submit(lambda: "again").result(WAIT_S) == "again"
    threads.stop()


def test_stop_cancels_work_not_started_and_lets_running_work_finish():
    threads = LaneThreads(1)
    release = threading.Event()
    futures, started = _blocked_jobs(threads, 3, release)
    assert _until(lambda: started == [0])
    stopper = threading.Thread(target=threads.stop)
    stopper.start()
    assert _until(lambda: futures[1].cancelled() and futures[2].cancelled())
    assert not futures[0].done()
    release.set()
    stopper.join(WAIT_S)
    assert futures[0].result(WAIT_S) == 0
    assert threads.submit(lambda: 1).cancelled()


def test_a_lane_processs_share_of_the_pools_never_goes_below_its_floor(settings):
    settings.SLUICE_LANE_PROCESSES = {"interactive": 2}
    assert lane_ceiling("interactive", 1024, floor=20) == 512
    assert lane_ceiling("interactive", 1025, floor=20) == 513
    assert lane_ceiling("interactive", 16, floor=20) == 20


# -- a real lane worker, on default settings, behind a real pool ------------------------------------------------------


def _peak_running_while(platform, calls) -> tuple[int, list[int]]:
    """Run ``calls`` at once; the simulator's peak of sequences running, and the statuses."""
    platform.sim_reset()
    with ThreadPoolExecutor(len(calls)) as executor:
        statuses = list(executor.map(lambda call: call(), calls))
    return platform.sim_stats()["max_running"], statuses


@pytest.mark.slow
def test_a_lane_worker_grows_to_what_its_pools_hold_in_flight_at_start_and_on_a_change(
        platform, make_caller, redis_client, tmp_path):
    # given a pool that holds 6 calls in flight (the only pool the lanes
    # size by: earlier tests' pools are forgotten; the simulator runs 16 at once)
    redis_client.delete(POOL_IN_FLIGHT_LIMITS)
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", max_concurrency=6)
    caller = make_caller(pool=pool, rpm=2_000, reserved_tpm=500_000)
    # and the interactive lane served by one worker process started with 2
    # threads, its size not set by hand
    env = {k: v for k, v in platform.env.items() if k != INTERACTIVE.concurrency_env}
    env.update({INTERACTIVE.processes_env: "1", "SLUICE_LANE_SIZE_CHECK_S": "0.5"})
    platform.stop_worker("interactive")
    hostname = f"interactive@{os.uname().nodename}"
    redis_client.hdel(WORKERS_READY, hostname)
    worker = Process("worker-interactive-sized", processes.worker_command(lane="interactive", concurrency=2), env,
                     tmp_path).start()

    def call():
        return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 300, "sim": {"output_tokens": 300}}).status_code

    try:
        assert _until(lambda: redis_client.hexists(WORKERS_READY, hostname), 60)
        time.sleep(1.0)  # its first look at the pools
        # when 6 calls come at once
        peak, statuses = _peak_running_while(platform, [call] * 6)
        # then the pool runs all 6 together, not 2 at a time
        assert statuses == [200] * 6
        assert peak == 6, worker.log_tail()

        # when the pool's limit rises to 14 (as an admin saves it)
        pool.max_concurrency = 14
        pool.save()
        pool_config_push(pool=pool)
        time.sleep(1.5)
        peak, statuses = _peak_running_while(platform, [call] * 14)
        # then the worker grew with it, without a restart
        assert statuses == [200] * 14
        assert peak == 14, worker.log_tail()
        assert worker.popen.poll() is None
    finally:
        worker.stop()
        redis_client.delete(POOL_IN_FLIGHT_LIMITS)
        platform.start_worker("interactive")
        platform.wait_workers_ready(["interactive"])


def test_the_live_gauges_of_a_worker_killed_outright_are_dropped_by_the_next_to_start(tmp_path):
    # given a process that set a live gauge and was then killed, and one still alive
    code = ("import os; os.environ['PROMETHEUS_MULTIPROC_DIR'] = {d!r};"
            "from prometheus_client import Gauge;"
            "Gauge('t_running', 'x', ['lane'], multiprocess_mode='livesum').labels('interactive').set(3);"
            "print(os.getpid(), flush=True);"
            "import sys; sys.stdin.read()").format(d=str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    dead_pid, alive_pid = int(dead.stdout.readline()), int(alive.stdout.readline())
    dead.kill()
    dead.wait()
    try:
        # when the next worker starts
        assert dead_workers_gauges_drop(str(tmp_path)) == 1
        # then only the dead one's file is gone
        assert sorted(p.name for p in tmp_path.glob("gauge_live*")) == [f"gauge_livesum_{alive_pid}.db"]
        assert dead_pid != alive_pid
    finally:
        alive.kill()
        alive.wait()
