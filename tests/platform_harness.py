"""Start and stop the real processes a test needs: the simulated pool, the
gateway (uvicorn), one Celery worker per lane. They talk to the same
PostgreSQL test database and Redis as the test itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from llm_platform import processes
from llm_platform.celery import WORKER_READY_KEY

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> Process:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

    def kill(self) -> None:
        self.stop(sig=signal.SIGKILL)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def assert_alive(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")


def wait_http(url: str, process: Process, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.assert_alive()
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} did not answer {url}:\n{process.log_tail()}")


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

    def stop_all(self) -> None:
        for lane in list(self.workers):
            self.stop_worker(lane)
        for process in (self.web, self.sim):
            if process is not None:
                process.stop()

    def sim_stats(self) -> dict:
        return httpx.get(f"{self.sim_url}/admin/stats", timeout=5).json()

    def sim_reset(self) -> None:
        httpx.post(f"{self.sim_url}/admin/reset", timeout=5).raise_for_status()
