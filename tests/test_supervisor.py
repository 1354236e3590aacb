"""`make run`'s supervisor (llm_platform/supervisor.py) on plain processes:
a child that dies is started again with a doubling backoff and at most the
cap a minute, the stop goes stage by stage (each waited for before the next
gets its signal), a child that ignores SIGTERM is killed after its timeout,
a second Ctrl-C kills what may be killed but still lets Redis save, and a
child that must not be restarted ends the run. The whole platform under
`make run` is tests/test_make_run.py."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from llm_platform.supervisor import Supervisor


def _supervisor(tmp_path: Path, lines: list[str], *, backoff_s: float = 0.1, backoff_max_s: float = 0.3,
                restarts_per_minute: int = 3) -> Supervisor:
    return Supervisor(env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, log_dir=tmp_path, log=lines.append,
                      backoff_s=backoff_s, backoff_max_s=backoff_max_s, restarts_per_minute=restarts_per_minute)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait_until(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# A child that notes its start, and on SIGTERM notes it, takes 0.3 s to stop
# (a worker's grace in small), notes its exit and exits.
STOPPING_CHILD = """
import signal, sys, time
path, name = sys.argv[1], sys.argv[2]
def note(what):
    with open(path, "a") as f:
        f.write(f"{name} {what}\\n")
def on_term(signum, frame):
    note("term")
    time.sleep(0.3)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("ready")
while True:
    time.sleep(1)
"""


def _notes(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_child_that_dies_is_started_again_with_backoff_and_at_most_the_cap_a_minute(tmp_path):
    starts = tmp_path / "starts"
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines)
    child = supervisor.spawn("crashy", _python(f"open({str(starts)!r}, 'a').write('x\\n'); raise SystemExit(3)"),
                             stage=0, stop_timeout_s=5)
    # Backoffs 0.1 + 0.2 + 0.3 s, then the cap: three restarts in the minute.
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        assert supervisor.tick() is None
        time.sleep(0.02)
    assert len(_notes(starts)) == 4  # the first start and three restarts, no more
    exits = [line for line in lines if "exited" in line]
    assert [re.search(r"again in (\d+\.\d)s", line).group(1) for line in exits[:3]] == ["0.1", "0.2", "0.3"]
    assert all(line.startswith("crashy exited (code 3) after ") for line in exits)
    assert len(exits) == 4 and exits[3].endswith(
        "(3 restarts in the last minute, the most allowed); see " + str(tmp_path / "crashy.log"))
    assert 55 < child.restart_at - time.monotonic() < 60  # it waits for the oldest restart to leave the minute
    assert sum("started again" in line for line in lines) == 3
    supervisor.stop()
    assert not child.alive() and child.restart_at is None


def test_the_stop_goes_stage_by_stage_each_waited_for(tmp_path):
    notes = tmp_path / "notes"
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines)
    # Spawned in another order than they stop, as run.py does.
    for name, stage in [("redis", 2), ("worker", 1), ("web", 0), ("worker2", 1)]:
        supervisor.spawn(name, [sys.executable, "-c", STOPPING_CHILD, str(notes), name], stage=stage,
                         stop_timeout_s=10, restart=name != "redis")
    _wait_until(lambda: len(_notes(notes)) == 4, "every child to be ready")
    supervisor.stop()
    stopped = _notes(notes)[4:]
    assert stopped[:2] == ["web term", "web exit"]
    assert sorted(stopped[2:6]) == ["worker exit", "worker term", "worker2 exit", "worker2 term"]
    assert stopped[2:4] in (["worker term", "worker2 term"], ["worker2 term", "worker term"])  # together
    assert stopped[6:] == ["redis term", "redis exit"]
    assert [line.split(" in ")[0] for line in lines] == ["stopped web", "stopped worker, worker2", "stopped redis"]
    assert all(child.popen.returncode == 0 for child in supervisor.children)


def test_a_child_that_ignores_sigterm_is_killed_after_its_stop_timeout(tmp_path):
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines)
    ready = tmp_path / "ready"
    child = supervisor.spawn("stubborn", _python(
        f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close(); "
        "time.sleep(60)"), stage=0, stop_timeout_s=0.5)
    _wait_until(ready.exists, "the child to ignore SIGTERM")
    started = time.monotonic()
    supervisor.stop()
    assert 0.5 <= time.monotonic() - started < 3
    assert child.popen.returncode == -9
    assert lines[0] == "stubborn did not stop within 0.5s of SIGTERM; killing it"


def test_a_second_ctrl_c_kills_at_once_but_redis_still_gets_sigterm(tmp_path):
    notes = tmp_path / "notes"
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines)
    worker = supervisor.spawn("worker", [sys.executable, "-c", STOPPING_CHILD, str(notes), "worker"], stage=0,
                              stop_timeout_s=30)
    redis = supervisor.spawn("redis", [sys.executable, "-c", STOPPING_CHILD, str(notes), "redis"], stage=1,
                             stop_timeout_s=30, restart=False)
    _wait_until(lambda: len(_notes(notes)) == 2, "both children to be ready")
    supervisor.hurry = True
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 5
    assert worker.popen.returncode == -9
    assert redis.popen.returncode == 0
    assert _notes(notes)[2:] == ["redis term", "redis exit"]


def test_a_child_that_must_not_be_restarted_ends_the_run(tmp_path):
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, lines)
    other = supervisor.spawn("web", _python("import time; time.sleep(60)"), stage=0, stop_timeout_s=5)
    redis = supervisor.spawn("redis", _python("raise SystemExit(1)"), stage=1, stop_timeout_s=5, restart=False)
    _wait_until(lambda: not redis.alive(), "redis to exit")
    assert supervisor.tick() is redis
    assert other.alive() and redis.restart_at is None and lines == []
    supervisor.stop()
    assert not other.alive()
