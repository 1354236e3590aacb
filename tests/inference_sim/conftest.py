"""Runs the simulator as a real subprocess; no Django involved.

No __init__.py in this folder on purpose: with one, pytest would import this
folder as a package named ``inference_sim`` and shadow the real one.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

REPO_ROOT = Path(__file__).resolve().parents[2]
# The tests import inference_sim and llm_tokens from the checkout even when
# pytest runs without the project installed or a rootdir conftest.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
READY_PREFIX = "inference_sim listening on "
# Fast enough for a quick suite, slow enough that steps still take real time.
TEST_TIME_SCALE = 50.0
# For tests that need several requests inside one 60 s (simulated) rate-limit
# window or outage: at this scale the window lasts 30 real seconds, so a slow
# machine cannot let it slide between two requests.
SLOW_TIME_SCALE = 2.0
TEST_SEED = 1234


class SimProcess:
    """A running ``python -m inference_sim`` and clients pointed at it."""

    def __init__(self, proc: subprocess.Popen[str], base_url: str, stderr_path: str) -> None:
        self.proc = proc
        self.base_url = base_url
        self.stderr_path = stderr_path
        self.http = httpx.Client(base_url=base_url, timeout=30)
        self.openai = OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)

    def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("model", "sim-small")
        body.setdefault("messages", [{"role": "user", "content": "Say something."}])
        return self.http.post("/v1/chat/completions", json=body)

    def stats(self) -> dict[str, Any]:
        response = self.http.get("/admin/stats")
        response.raise_for_status()
        return response.json()

    def capacity(self, **changes: Any) -> httpx.Response:
        return self.http.post("/admin/capacity", json=changes)

    def reset(self) -> None:
        self.http.post("/admin/reset").raise_for_status()

    def stop(self) -> None:
        self.http.close()
        self.openai.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        os.unlink(self.stderr_path)


def start_sim(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> SimProcess:
    """Start the simulator on a free port (``--port 0``) and wait until it is healthy."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_")}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    child_env.update(env or {})
    stderr_fd, stderr_path = tempfile.mkstemp(prefix="inference_sim-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_sim", "--host", "127.0.0.1", "--port", "0", *args],
        cwd=REPO_ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=stderr_fd,
        text=True,
    )
    os.close(stderr_fd)

    def fail(reason: str) -> None:
        proc.kill()
        proc.wait()
        log = Path(stderr_path).read_text()
        os.unlink(stderr_path)
        pytest.fail(f"inference_sim did not start: {reason}\n{log}")

    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    line = ""
    while not line.startswith(READY_PREFIX):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            fail("no ready line")
        if selector.select(timeout=remaining):
            line = proc.stdout.readline()
    selector.close()
    base_url = line.strip().removeprefix(READY_PREFIX)

    sim = SimProcess(proc, base_url, stderr_path)
    while True:
        try:
            if sim.http.get("/healthz").status_code == 200:
                return sim
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            fail("healthz never answered")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def sim_server() -> Iterator[SimProcess]:
    sim = start_sim("--time-scale", str(TEST_TIME_SCALE), "--seed", str(TEST_SEED))
    yield sim
    sim.stop()


@pytest.fixture
def sim(sim_server: SimProcess) -> SimProcess:
    """The shared simulator, reset to its starting state for this test."""
    sim_server.reset()
    return sim_server


@pytest.fixture(scope="session")
def slow_sim_server() -> Iterator[SimProcess]:
    sim = start_sim("--time-scale", str(SLOW_TIME_SCALE), "--seed", str(TEST_SEED))
    yield sim
    sim.stop()


@pytest.fixture
def slow_sim(slow_sim_server: SimProcess) -> SimProcess:
    """A simulator whose rate-limit window cannot slide during a test."""
    slow_sim_server.reset()
    return slow_sim_server


@pytest.fixture
def start_extra_sim() -> Iterator[Any]:
    """Start more simulators with their own flags/env; all stopped after the test."""
    started: list[SimProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> SimProcess:
        started.append(start_sim(*args, env=env))
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture(autouse=True)
def clean_redis() -> Iterator[None]:
    """Overrides tests/conftest.py's autouse Redis cleanup: the simulator
    needs no Redis, so these tests also run where there is none."""
    yield
