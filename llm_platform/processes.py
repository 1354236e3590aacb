"""The processes that make up a running platform, as command lines. Used by
`make run` (llm_platform.run) and by the test harness, so tests exercise the
same layout operators run: a web server, one worker pool per lane, beat and
the simulated pool."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from django.conf import settings

from gateway.core.lanes import lane_concurrency, lane_processes, queue_for_lane


def sim_command(*, port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "inference_sim", "--host", "127.0.0.1", "--port", str(port), *(extra or [])]


def web_command(*, port: int, host: str = "127.0.0.1", workers: int = 1) -> list[str]:
    # No uvicorn access log: gateway/web/access_log.py writes one line per
    # /v1 request, with the workload, lane, reason and request id.
    return [
        sys.executable, "-m", "uvicorn", "llm_platform.asgi:application",
        "--host", host, "--port", str(port), "--workers", str(workers),
        "--no-access-log", "--timeout-keep-alive", "30",
        # What uvicorn[standard]'s "auto" picks already, named so a missing
        # package fails the start instead of silently costing more CPU.
        "--loop", "uvloop", "--http", "httptools",
        # No "server: uvicorn" header on every answer (bytes and a header
        # check per refusal).
        "--no-server-header",
        # The client address is Sluice's to decide (SLUICE_TRUSTED_PROXIES,
        # gateway/core/protection/throttle.py): uvicorn would otherwise
        # believe X-Forwarded-For from any peer on 127.0.0.1, so a caller on
        # the host could claim a fresh address for every throttled attempt.
        "--no-proxy-headers",
        # On SIGTERM: stop accepting, let requests in flight finish for a few
        # seconds, then close them (uvicorn's default waits for ever; a caller
        # waiting on its lane could hold a stop for minutes). Their admitted
        # work still runs on the workers, settles and reaches the ledger.
        "--timeout-graceful-shutdown", f"{settings.SLUICE_WEB_SHUTDOWN_GRACE_S:g}",
    ]


# Celery's -q: no start-up banner (plain text in a JSON log). Log levels come
# from settings.LOGGING (llm_platform/celery.py), not from -l. The pool is the
# app's (worker_pool: gateway/worker/lane_pool.py); -c is where its threads
# start, and it grows from there to what the pools hold in flight unless the
# lane's size is set by hand.
def worker_command(*, lane: str, concurrency: int | None = None, index: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "llm_platform", "-q", "worker",
        "-Q", queue_for_lane(lane), "-c", str(concurrency or lane_concurrency(lane)),
        "-n", f"{worker_node(lane, index)}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]


def worker_node(lane: str, index: int = 0) -> str:
    """The Celery node name (before ``@host``) of a lane's ``index``-th process."""
    return lane if index == 0 else f"{lane}-{index + 1}"


def lane_worker_commands(lane: str, *, concurrency: int | None = None,
                         processes: int | None = None) -> list[tuple[str, list[str]]]:
    """(node, command) for each worker process of ``lane``: its threads
    (``concurrency``, default the lane's setting) split evenly over its
    processes (default the lane's setting, gateway/core/lanes.py)."""
    count = max(1, processes or lane_processes(lane))
    threads = max(1, -(-(concurrency or lane_concurrency(lane)) // count))
    return [(worker_node(lane, i), worker_command(lane=lane, concurrency=threads, index=i)) for i in range(count)]


def beat_command(*, schedule_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "llm_platform", "-q", "beat", "-S",
        "llm_platform.beat:PacedDatabaseScheduler",
        "--pidfile", os.path.join(schedule_dir, "beat.pid"),
    ]


# -- running the processes (shared by the test harness and bench/) -------------


ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free a moment ago (the usual small race applies)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """One child process in its own session, logging to ``log_dir/<name>.log``,
    stopped together with its children (uvicorn/celery fork their own)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.command = command
        self.env = env
        self.log_path = Path(log_dir) / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    def start(self) -> Process:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()  # the child holds its own descriptor
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
    """Until ``url`` answers below 500 (a 401 proves the server is up)."""
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


def pacer_command() -> list[str]:
    return [sys.executable, "manage.py", "run_pacer"]


def metrics_dir_prepare(path: Path) -> Path:
    """Create the metrics directory (PROMETHEUS_MULTIPROC_DIR) and empty it,
    before any process starts: each process leaves a file per pid, and /metrics
    adds up every file there, so files of an earlier run would count again.
    Only prometheus-client's own ``*.db`` files are removed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return path


def local_secret_key(var_dir: Path) -> str:
    """The secret key of local runs (`make run`, the benchmarks): random,
    made once per checkout and kept in ``var_dir/secret_key`` (readable by its
    owner only), so sessions survive a restart and `manage.py` commands run
    beside it use the same key (llm_platform/settings.py reads that file
    outside production)."""
    path = Path(var_dir) / "secret_key"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another local run made it a moment ago
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50))
    return path.read_text().strip()
