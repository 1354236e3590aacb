"""`make run` itself (``python -m llm_platform.run``, embedded Redis, SQLite)
loses no ledger row (docs/RELIABILITY.md, "`make run`: an ordered stop,
restarts, a Redis that keeps its data"):

- Ctrl-C with calls in flight stops it in order; the next run finds a ledger
  row for every call that was admitted (calls handed back by the workers are
  finished from the embedded Redis's append-only file), the admission
  counters as they were, no lease left, and every refusal counted;
- a lane worker SIGKILLed while serving is started again, and the platform
  keeps serving meanwhile.

Each run gets a fresh var dir and its own ports. The database and Redis are
the run's own (SQLite, the embedded redis-server): read here directly."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from budgets.admission import keys
from gateway.core.lanes import LANE_NAMES
from llm_platform.processes import ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

UP_WITHIN_S = 240.0  # two cores shared with other test runs: migrate, seed and ten processes


class MakeRun:
    """One `python -m llm_platform.run` in its own session (so a signal sent
    here reaches run.py alone, as the terminal's Ctrl-C does), on var_dir."""

    def __init__(self, var_dir: Path, port: int):
        self.var_dir = var_dir
        self.port = port
        self.popen: subprocess.Popen | None = None
        self.output_path = var_dir.parent / f"make-run-{port}.out"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MakeRun:
        env = {name: value for name, value in os.environ.items()
               if name not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "PROMETHEUS_MULTIPROC_DIR"}}
        env.update(PORT=str(self.port), SLUICE_VAR_DIR=str(self.var_dir),
                   # One process per lane: the killed worker is its lane's only one.
                   SLUICE_PROCESSES_INTERACTIVE="1")
        with open(self.output_path, "ab") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "llm_platform.run"], cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + UP_WITHIN_S
        while "Sluice is up." not in self.output():
            assert self.popen.poll() is None, f"make run exited while starting:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"make run not up in {UP_WITHIN_S:g}s:\n{self.output()[-4000:]}"
            time.sleep(0.2)
        return self

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def log(self, name: str) -> str:
        path = self.var_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def interrupt_and_wait(self, timeout: float = 90.0) -> int:
        self.popen.send_signal(signal.SIGINT)
        return self.popen.wait(timeout=timeout)

    def children(self) -> dict[str, int]:
        """pid by Celery node name (``interactive@...``) or first argument, of run.py's children."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) != self.popen.pid:
                continue
            words = [a.decode(errors="replace") for a in args if a]
            node = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "-n"), None)
            found[node.split("@")[0] if node else " ".join(words[1:4])] = int(entry)
        return found

    def close(self) -> None:
        """Whatever a failed test left running: Ctrl-C, a second one (no
        grace) if that is not enough, then SIGKILL to run.py and its children."""
        if self.popen is None or self.popen.poll() is not None:
            return
        children = list(self.children().values())
        for timeout in (60, 30):
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=timeout)
                return
            except subprocess.TimeoutExpired:
                pass
        self.popen.kill()
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- the run's own database and Redis ------------------------------------

    def sql(self, query: str, *params) -> list[tuple]:
        with sqlite3.connect(self.var_dir / "sluice.sqlite3", timeout=20) as db:
            return db.execute(query, params).fetchall()

    def redis(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.var_dir / "redis.sock"), decode_responses=True)

    def api_key(self, workload: str) -> str:
        return json.loads((self.var_dir / "demo-keys.json").read_text())[workload]

    def admitted(self, workload: str) -> int:
        """Calls of ``workload`` admitted on the demo pool, by the admission's own counter."""
        [(workload_id,)] = self.sql("SELECT id FROM tenants_workload WHERE slug = ?", workload)
        [(pool_id,)] = self.sql("SELECT id FROM budgets_inferencepool WHERE slug = 'sim-pool'")
        with self.redis() as client:
            return int(client.hget(keys.pool_counters(pool_id), f"{workload_id}.admitted_req") or 0)


@pytest.fixture
def make_run(tmp_path):
    runs: list[MakeRun] = []

    def start(var_dir: Path | None = None, port: int | None = None) -> MakeRun:
        run = MakeRun(var_dir or tmp_path / "var", port or free_port()).start()
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def chat(run: MakeRun, key: str, *, latency_ms: int, max_tokens: int, content: str = "Tell me when you are done.",
         timeout: float = 120.0) -> httpx.Response | Exception:
    try:
        return httpx.post(f"{run.base_url}/v1/chat/completions", timeout=timeout,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "sim-small", "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "sim": {"output_tokens": 5, "latency_ms": latency_ms}})
    except httpx.HTTPError as exc:
        return exc


def wait_until(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_ctrl_c_with_calls_in_flight_loses_no_ledger_row_and_the_next_run_finishes_them(make_run):
    run = make_run()
    key = run.api_key("acme-chat")
    [(workload_id, prompt_cap)] = run.sql("SELECT id, prompt_tokens_cap FROM tenants_workload WHERE slug = 'acme-chat'")
    [(pool_id,)] = run.sql("SELECT id FROM budgets_inferencepool WHERE slug = 'sim-pool'")
    client = run.redis()

    def admitted() -> int:
        return run.admitted("acme-chat")

    # Three groups, told apart by max_tokens (the ledger's estimated output):
    # answered before the stop (0.2 s), in flight when it starts (4 s: the
    # web closes them after its grace, the workers finish them in theirs), and
    # longer than every grace (60 s: the workers hand them back to Redis).
    groups = {16: 200, 17: 4000, 18: 60000}
    answers: dict[int, list] = {tokens: [] for tokens in groups}

    def call(tokens: int) -> None:
        answers[tokens].append(chat(run, key, latency_ms=groups[tokens], max_tokens=tokens))

    quick = [threading.Thread(target=call, args=(16,)) for _ in range(4)]
    for thread in quick:
        thread.start()
    for thread in quick:
        thread.join()
    slow = [threading.Thread(target=call, args=(tokens,)) for tokens in (17, 18) for _ in range(4)]
    for thread in slow:
        thread.start()
    wait_until(lambda: admitted() == 12, "the twelve calls to be admitted")
    # Refusals counted by the web process, not yet flushed to the database
    # (beat flushes a minute only after it has ended).
    too_long = "word " * (prompt_cap + 100)
    refused = [chat(run, key, latency_ms=0, max_tokens=16, content=too_long) for _ in range(3)]
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert [r.json()["error"]["code"] for r in refused] == ["context_length_exceeded"] * 3

    assert run.interrupt_and_wait() == 0
    for thread in slow:
        thread.join(timeout=30)
    stops = [line.split(" in ")[0] for line in run.output().splitlines() if line.startswith("[sluice] stopped ")]
    assert stops == ["[sluice] stopped web", "[sluice] stopped " + ", ".join(f"worker-{lane}" for lane in LANE_NAMES),
                     "[sluice] stopped beat", "[sluice] stopped pacer", "[sluice] stopped sim, sim-overflow",
                     "[sluice] stopped redis"]
    assert [r.status_code for r in answers[16]] == [200] * 4
    assert not any(isinstance(r, httpx.Response) and r.status_code == 200 for r in answers[18])
    answered = {r.headers["x-request-id"] for group in answers.values() for r in group
                if isinstance(r, httpx.Response) and r.status_code == 200}
    # Every call in the 60 s group was handed back, unsettled: no row yet.
    before = dict(run.sql("SELECT estimated_output_tokens, COUNT(*) FROM budgets_usagerecord GROUP BY 1"))
    assert before.get(18, 0) == 0 and before[16] == 4

    run = make_run(var_dir=run.var_dir, port=run.port)
    client = run.redis()
    assert admitted() == 12  # the embedded Redis kept its counters

    def rows() -> list[tuple]:
        return run.sql("SELECT request_id, estimated_output_tokens, status, error FROM budgets_usagerecord "
                       "WHERE workload_id = ?", workload_id)

    wait_until(lambda: len(rows()) == 12, "a ledger row for every admitted call", timeout=120)
    ledger = rows()
    assert len({row[0] for row in ledger}) == 12
    assert answered <= {row[0] for row in ledger}
    by_group = {tokens: sorted((status, error) for _, t, status, error in ledger if t == tokens) for tokens in groups}
    assert by_group[16] == [("ok", "")] * 4
    assert len(by_group[17]) == 4
    # Finished by the next run from the answer the stopping worker kept, without calling the pool again.
    assert by_group[18] == [("upstream_error", "worker_shutdown")] * 4
    wait_until(lambda: client.zcard(keys.workload_leases(pool_id, workload_id)) == 0, "no lease left")

    # The three refusals: flushed to the database, or still counted in Redis.
    flushed = run.sql("SELECT COALESCE(SUM(count), 0) FROM budgets_rejectionstat WHERE workload_id = ? "
                      "AND reason = 'context_length_exceeded'", workload_id)[0][0]
    pending = sum(int(count) for name in client.scan_iter(match="sluice:*:rej:*:n")
                  for field, count in client.hgetall(name).items()
                  if field.startswith(f"{workload_id}|") and field.endswith("|context_length_exceeded"))
    assert flushed + pending == 3


def test_a_lane_worker_killed_while_serving_is_started_again_and_the_platform_keeps_serving(make_run):
    run = make_run()
    key = run.api_key("acme-chat")
    before = run.children()
    old_pid = before["interactive"]
    assert chat(run, key, latency_ms=0, max_tokens=16).status_code == 200

    answers: list = []
    in_flight = [threading.Thread(target=lambda: answers.append(chat(run, key, latency_ms=3000, max_tokens=16)))
                 for _ in range(4)]
    for thread in in_flight:
        thread.start()
    wait_until(lambda: run.admitted("acme-chat") == 5, "four calls in flight")
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # The interactive lane's only worker is gone: a new call on it answers once the supervisor has started it again.
    answer = chat(run, key, latency_ms=0, max_tokens=16, timeout=60)
    answered_in = time.monotonic() - killed_at
    assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
    assert answered_in < 20, f"{answered_in:.1f}s:\n{run.log('worker-interactive')}"
    assert run.popen.poll() is None
    after = run.children()
    assert after["interactive"] != old_pid
    assert {name for name in after} == {name for name in before}
    assert {pid for name, pid in after.items() if name != "interactive"} == \
        {pid for name, pid in before.items() if name != "interactive"}
    assert "[sluice] worker-interactive exited (code -9) after " in run.output()
    assert f"[sluice] worker-interactive started again (pid {after['interactive']})" in run.output()
    # The calls the killed worker held are taken over and run once more
    # (docs/RELIABILITY.md, "A worker is lost"): every caller answered, every call on the ledger.
    for thread in in_flight:
        thread.join(timeout=60)
    assert [getattr(a, "status_code", a) for a in answers] == [200] * 4
    wait_until(lambda: run.sql("SELECT COUNT(*) FROM budgets_usagerecord")[0][0] == 6, "six ledger rows")
    assert run.admitted("acme-chat") == 6


def test_a_burst_of_acme_chat_past_its_slice_is_answered_by_both_demo_pools(make_run):
    # given the demo as `make run` seeds it: acme-chat's slice of sim-pool (ceiling 80,000 TPM: a burst of
    # 20,000 tokens) and its overflow slice of sim-overflow, a second simulator process
    run = make_run()
    key = run.api_key("acme-chat")
    assert "(sim-overflow)" in run.output()

    def call(n: int) -> httpx.Response:
        return httpx.post(f"{run.base_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "sim-small", "messages": [{"role": "user", "content": f"burst {n}"}],
                                "max_tokens": 1000, "sim": {"output_tokens": 1000}})

    # when 26 calls of about 1,010 tokens each, all of them used, come at once (more than the primary's burst holds)
    with ThreadPoolExecutor(26) as callers:
        answers = list(callers.map(call, range(26)))
    # then every one is answered, by both pools, and the ledger bills each at its own pool's price
    assert [a.status_code for a in answers] == [200] * 26
    served = Counter(a.headers["x-sluice-pool"] for a in answers)
    assert set(served) == {"sim-pool", "sim-overflow"} and served["sim-pool"] >= 15
    ids = [a.headers["x-request-id"] for a in answers]
    wait_until(lambda: run.sql("SELECT COUNT(*) FROM budgets_usagerecord")[0][0] >= 26, "26 ledger rows")
    rows = run.sql("SELECT r.request_id, p.slug, r.overflow FROM budgets_usagerecord r "
                   "JOIN budgets_inferencepool p ON p.id = r.pool_id")
    assert sorted((rid, slug, bool(overflow)) for rid, slug, overflow in rows if rid in ids) == sorted(
        (a.headers["x-request-id"], a.headers["x-sluice-pool"], a.headers["x-sluice-pool"] == "sim-overflow")
        for a in answers)
