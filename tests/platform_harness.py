"""Start and stop the real processes a test needs: the simulated pool, the
gateway (uvicorn), one Celery worker per lane. They talk to the same
PostgreSQL test database and Redis as the test itself."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx

from llm_platform import processes
from gateway.core.keys import WORKERS_READY as WORKER_READY_KEY
from llm_platform.processes import ROOT, Process, free_port, wait_http  # noqa: F401  (re-exported for tests)

# SLUICE_HEALTH_TOKEN of the test platform: health details for tests that read them.
HEALTH_TOKEN = "test-health-token"


class Platform:
    """The running processes of one test session."""

    def __init__(self, *, env: dict[str, str], log_dir: Path, redis_client):
        self.env = env
        self.log_dir = log_dir
        self.redis = redis_client
        self.sim_port = free_port()
        self.web_port = free_port()
        self.sim: Process | None = None
        self.web: Process | None = None
        self.workers: dict[str, Process] = {}
        self.pacer: Process | None = None

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def start_sim(self, extra: list[str] | None = None) -> None:
        self.sim = Process("sim", processes.sim_command(port=self.sim_port, extra=extra), self.env, self.log_dir).start()
        wait_http(f"{self.sim_url}/healthz", self.sim)

    def start_web(self) -> None:
        self.web = Process("web", processes.web_command(port=self.web_port), self.env, self.log_dir).start()
        wait_http(f"{self.base_url}/v1/models", self.web)

    def start_pacer(self) -> None:
        self.pacer = Process("pacer", processes.pacer_command(), self.env, self.log_dir).start()

    def start_worker(self, lane: str, concurrency: int = 8) -> Process:
        hostname = f"{lane}@{socket.gethostname()}"
        self.redis.hdel(WORKER_READY_KEY, hostname)
        worker = Process(f"worker-{lane}", processes.worker_command(lane=lane, concurrency=concurrency), self.env,
                         self.log_dir).start()
        self.workers[lane] = worker
        return worker

    def wait_workers_ready(self, lanes, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = {f"{lane}@{socket.gethostname()}": lane for lane in lanes}
        while pending and time.monotonic() < deadline:
            for hostname in list(pending):
                self.workers[pending[hostname]].assert_alive()
                if self.redis.hexists(WORKER_READY_KEY, hostname):
                    del pending[hostname]
            time.sleep(0.1)
        if pending:
            raise TimeoutError(f"workers not ready: {sorted(pending.values())}")

    def stop_worker(self, lane: str) -> None:
        worker = self.workers.pop(lane, None)
        if worker is not None:
            worker.stop()

    @contextlib.contextmanager
    def environment(self, overrides: dict[str, str], *, lanes: Iterable[str]) -> Iterator[Platform]:
        """Run the web process and these lanes' workers with ``overrides``
        on top of the session's environment, then restart them as they were
        (a setting a few tests need, such as private callback receivers,
        stays off for all the others)."""
        lanes = list(lanes)
        saved = self.env

        def restart(env: dict[str, str]) -> None:
            self.env = env
            for lane in lanes:
                self.stop_worker(lane)
            if self.web is not None:
                self.web.stop()
            self.start_web()
            for lane in lanes:
                self.start_worker(lane)
            self.wait_workers_ready(lanes)

        restart({**saved, **overrides})
        try:
            yield self
        finally:
            restart(saved)

    def stop_all(self) -> None:
        for lane in list(self.workers):
            self.stop_worker(lane)
        for process in (self.pacer, self.web, self.sim):
            if process is not None:
                process.stop()

    def sim_capacity(self, **changes) -> dict:
        response = httpx.post(f"{self.sim_url}/admin/capacity", json=changes, timeout=5)
        response.raise_for_status()
        return response.json()

    def sim_stats(self) -> dict:
        return httpx.get(f"{self.sim_url}/admin/stats", timeout=5).json()

    def sim_reset(self, *, quiet_s: float = 15.0) -> None:
        """Zero the simulator's counters once what earlier tests left running
        on it (a stream being cut, a retry in flight) has finished, so a test
        that counts calls counts only its own; after ``quiet_s`` it resets anyway."""
        deadline = time.monotonic() + quiet_s
        while time.monotonic() < deadline:
            stats = self.sim_stats()
            if not stats.get("running") and not stats.get("queued"):
                break
            time.sleep(0.05)  # polling with a deadline
        httpx.post(f"{self.sim_url}/admin/reset", timeout=5).raise_for_status()
