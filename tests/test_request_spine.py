"""The spine of one non-streamed chat request, measured: which project files
stand between the caller and the I/O it causes, and whether the walk enters
any file twice. The house issue's bound: "The spine of a non-streamed chat
request runs through at most 20 files, and the walk from the web view to the
ledger row enters no file twice."

What is measured (tests/spine_tracer.py does the tracing):

- One request, fully in this process, after one warm-up request on the same
  caller, event loop and worker thread (caches, connections and lazily built
  scripts warm, as in steady state). The web side runs through the ASGI app
  (``llm_platform.asgi.application``, over ``httpx.ASGITransport``); the
  worker side is a thread of this process that takes the lane's Celery
  message off Redis itself (the list Celery's Redis transport consumes, the
  queue named by gateway/core/lanes.py; kombu's JSON envelope, base64 body
  ``[args, kwargs, embed]``, adapters/celery.py) and calls
  ``gateway.worker.tasks.execute_request``'s function. No Celery worker runs
  (it would take the message first); the pool is a real ``inference_sim``
  process; PostgreSQL and Redis are the test session's.
- The tracer is installed (``sys.setprofile`` and ``threading.setprofile``)
  before the warm-up, so the threads started later (the worker thread, the
  loop's executor threads) are traced too, and records only from the
  measured request's send until its response is in and its task has
  returned (the ledger row is written after the answer is published).
  The web process's periodic work that rides on whichever request finds it
  due (the auth cache's refresh, the revocation poll, the last-use push:
  gateway/web/auth.py) is put off for an hour, so the warm-up does it and
  the measured request shows only its own work (``PERIODIC_PUT_OFF``).
- At every call into a library's I/O boundary (redis-py's sends, sync and
  async; ``http.client``'s request/putrequest/send; httpx's transports;
  Django's ``CursorWrapper.execute``/``executemany``/``callproc`` and
  ``connect``; any other send on an internet socket), the chain of project
  frames on the stack (``f_back``; inside an asyncio task, the task's chain
  of awaiting coroutines). Project: ``.py`` files under the repository root,
  not ``.venv/``, not ``tests/``.

Reported (printed, visible with ``pytest -s``; written as JSON to
``$SLUICE_SPINE_REPORT`` when it is set: a path ending in ``.json`` is the
file, anything else a folder that gets ``request_spine.json``):

(a) the spine: every project file on any chain;
(b) re-entries: a chain on which a file comes back after another file was
    entered in between (A -> B -> A), each distinct chain once;
(c) the Lua scripts the request ran, as their EVALSHAs went out (a composed
    round trip is one script named ``a+b+c``), and the single scripts in them;
(d) every project file executed at all during the request (context).

``test_the_spine_is_measured`` checks the measurement is sane;
``test_the_spine_is_within_the_bound`` asserts the issue's bound."""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import queue as queue_module
import sys
import tempfile
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connections

from budgets.models import UsageRecord
from gateway.core import keys
from gateway.core.request.enqueue import EXECUTE_REQUEST_TASK
from gateway.core.lanes import LANES
from tests.gateway.ledger import ledger_row
from tests.spine_tracer import SpineTracer, script_parts

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[1]
MAX_SPINE_FILES = 20
REENTRIES_ALLOWED: tuple[str, ...] = ()  # files a chain may enter twice (none, per the issue)
REPORT_ENV = "SLUICE_SPINE_REPORT"
MODEL = "sim-small"
OUTPUT_TOKENS = 12
MESSAGES = [{"role": "user", "content": "Say hello to the gateway, please."}]
WAIT_S = 30.0


# --- the pieces of the measurement ------------------------------------------


@pytest.fixture(scope="module")
def sim(django_db_setup, redis_client):
    """Only the simulated pool: no web process, no lane workers."""
    from tests.platform_harness import Platform

    log_dir = Path(tempfile.mkdtemp(prefix="sluice-spine-"))
    harness = Platform(env=dict(os.environ), log_dir=log_dir, redis_client=redis_client)
    try:
        harness.start_sim(["--time-scale", "50"])
        yield harness
    finally:
        harness.stop_all()


class LaneWorker(threading.Thread):
    """What a lane's Celery worker does with an ``execute_request`` message,
    in this process: pop it off its queue's list, decode kombu's envelope,
    run the task's function. A message whose request record is gone (left on
    the list by an earlier session whose records ``clean_redis`` deleted)
    cannot run anywhere and is dropped."""

    def __init__(self) -> None:
        super().__init__(name="spine-lane-worker", daemon=True)
        # its own client: the session's has a read timeout shorter than a BRPOP's wait
        self.redis = redis.Redis.from_url(settings.REDIS_URL)
        self.queues = [lane.queue for lane in LANES]
        self.stopping = threading.Event()
        self.dropped: list[str] = []
        self._finished: dict[str, queue_module.SimpleQueue] = {}
        self._lock = threading.Lock()

    def _inbox(self, request_id: str) -> queue_module.SimpleQueue:
        with self._lock:
            return self._finished.setdefault(request_id, queue_module.SimpleQueue())

    def run(self) -> None:
        from gateway.worker.tasks import execute_request

        try:
            while not self.stopping.is_set():
                popped = self.redis.brpop(self.queues, timeout=0.2)
                if not popped:
                    continue
                message = json.loads(popped[1])
                request_id, task = message["headers"]["id"], message["headers"]["task"]
                if task != EXECUTE_REQUEST_TASK or not self.redis.exists(keys.request_record(request_id)):
                    self.dropped.append(request_id)
                    continue
                args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
                try:
                    result = execute_request.run(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - handed to the test, which fails on it
                    result = exc
                self._inbox(request_id).put(result)
        finally:
            connections.close_all()
            self.redis.close()

    def finished(self, request_id: str, timeout_s: float = WAIT_S):
        """The task's return value once it has run ``request_id``'s message."""
        result = self._inbox(request_id).get(timeout=timeout_s)
        if isinstance(result, Exception):
            raise result
        return result


async def _chat(client: httpx.AsyncClient, api_key: str) -> httpx.Response:
    return await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                             json={"model": MODEL, "messages": MESSAGES, "max_tokens": 40,
                                   "sim": {"output_tokens": OUTPUT_TOKENS}})


async def _executor_connections_close(threads: int) -> None:
    """Close the database connections the loop's executor threads opened (a
    connection per thread): one call on each thread, held at a barrier until
    every thread has one."""
    meeting = threading.Barrier(threads)

    def close() -> None:
        connections.close_all()
        meeting.wait(timeout=WAIT_S)

    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(None, close) for _ in range(threads)))


def spine_measure(*, api_key: str) -> dict:
    """Warm up with one request, then trace one: the report (a)-(d), with the
    measured answer's request id, status and body."""
    from llm_platform.asgi import application

    tracer = SpineTracer(root=ROOT)
    tracer.install()  # before any thread the requests start
    worker = LaneWorker()
    worker.start()
    executor_threads = 4

    async def requests() -> httpx.Response:
        # the loop's default executor (sync_to_async(thread_sensitive=False) runs there), its size known
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=executor_threads, thread_name_prefix="spine-loop-executor"))
        try:
            return await _requests()
        finally:
            await _executor_connections_close(executor_threads)

    async def _requests() -> httpx.Response:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=WAIT_S) as client:
            warm = await _chat(client, api_key)
            assert warm.status_code == 200, warm.text
            await asyncio.to_thread(worker.finished, warm.headers["x-request-id"])
            tracer.start()
            try:
                measured = await _chat(client, api_key)
                if measured.status_code == 200:
                    await asyncio.to_thread(worker.finished, measured.headers["x-request-id"])
            finally:
                tracer.stop()
            return measured

    try:
        measured = asyncio.run(requests())
    finally:
        tracer.uninstall()
        worker.stopping.set()
        worker.join(timeout=5)
    calls = tracer.calls
    by_boundary: dict[str, int] = {}
    for call in calls:
        by_boundary[call.boundary] = by_boundary.get(call.boundary, 0) + 1
    lua = tracer.lua_scripts()
    return {
        "request_id": measured.headers.get("x-request-id", ""),
        "status": measured.status_code,
        "answer": measured.json(),
        "spine_files": tracer.spine_files(),
        "reentries": tracer.reentries(),
        "lua_scripts": lua,
        "lua_script_parts": script_parts(lua),
        "lua_script_calls": tracer.script_calls,
        "executed_files": sorted(tracer.executed),
        "boundary_calls": [{"boundary": c.boundary, "thread": c.thread, "detail": c.detail, "chain": list(c.chain)}
                           for c in calls],
        "boundary_counts": dict(sorted(by_boundary.items())),
        "calls_outside_project": tracer.calls_outside_project,
        "threads_untraced": tracer.threads_untraced,
        "messages_dropped": worker.dropped,
    }


def spine_print(report: dict) -> None:
    lines = [
        "",
        f"=== request spine: {report['request_id']} (HTTP {report['status']}) ===",
        f"(a) spine files: {len(report['spine_files'])} (bound {MAX_SPINE_FILES})",
        *(f"      {path}" for path in report["spine_files"]),
        f"    the {len(report['boundary_calls'])} boundary calls {report['boundary_counts']}, in order, "
        f"each with its chain's files, outermost first:",
    ]
    for call in report["boundary_calls"]:
        lines.append(f"      [{call['thread']}] {call['boundary']} {call['detail'][:90]}")
        lines.append("          " + " -> ".join(_files(call["chain"])))
    lines.append(f"(b) re-entries: {len(report['reentries'])} chains")
    for entry in report["reentries"]:
        lines.append(f"      re-enters {', '.join(entry['reentered'])}: [{entry['thread']}] {entry['boundary']} "
                     f"{entry['detail'][:60]}")
        lines.append("          " + " -> ".join(entry["chain"]))
    lines.append(f"(c) Lua scripts: {len(report['lua_scripts'])} round trips' scripts, "
                 f"{len(report['lua_script_parts'])} single scripts")
    lines += [f"      {name}" for name in report["lua_scripts"]]
    lines.append(f"(d) project files executed: {len(report['executed_files'])}")
    lines += [f"      {path}" for path in report["executed_files"]]
    lines.append(f"    boundary calls outside the project (the test's own): {report['calls_outside_project']}; "
                 f"threads running before the tracer (untraced): {report['threads_untraced']}")
    print("\n".join(lines))


def _files(chain: list[str]) -> list[str]:
    files: list[str] = []
    for frame in chain:
        path = frame.split(":", 1)[0]
        if not files or files[-1] != path:
            files.append(path)
    return files


def spine_write(report: dict) -> None:
    target = os.environ.get(REPORT_ENV)
    if not target:
        return
    path = Path(target)
    if path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "request_spine.json"
    path.write_text(json.dumps(report, indent=2, default=str))


_measured: dict = {}


# The web process's periodic work, done by whichever request comes by when
# it is due (gateway/web/auth.py): a request's own spine leaves it out, so
# the warm-up does it and the measured request does not find it due again.
PERIODIC_PUT_OFF = {"SLUICE_AUTH_CACHE_S": 3600.0, "SLUICE_AUTH_REVOCATION_POLL_S": 3600.0,
                    "SLUICE_KEY_LAST_USED_PUSH_S": 3600.0}


@pytest.fixture
def spine(sim, make_caller, settings, redis_of_its_own) -> dict:
    """The measurement, made once per module (both tests read the same one),
    on a Redis database of its own (the session's lane workers would take the
    message first)."""
    if not _measured:
        for name, value in PERIODIC_PUT_OFF.items():
            setattr(settings, name, value)
        pool = make_caller.pool(base_url=f"{sim.sim_url}/v1")
        caller = make_caller(pool=pool)
        report = spine_measure(api_key=caller.api_key)
        # the row read here, before the database is emptied for the next test
        report["ledger_row"] = {"request_id": ledger_row(report["request_id"]).request_id,
                                "rows": UsageRecord.objects.filter(request_id=report["request_id"]).count()}
        spine_print(report)
        spine_write(report)
        _measured.update(report)
    return _measured


# --- the tests ----------------------------------------------------------------


def _calls(report: dict, boundary_prefix: str, detail_part: str) -> list[dict]:
    return [c for c in report["boundary_calls"]
            if c["boundary"].startswith(boundary_prefix) and detail_part in c["detail"]]


def test_the_spine_is_measured(spine):
    # the request went through: answered, and its one ledger row written
    assert spine["status"] == 200, spine["answer"]
    assert spine["answer"]["usage"]["completion_tokens"] == OUTPUT_TOKENS
    assert spine["ledger_row"] == {"request_id": spine["request_id"], "rows": 1}
    # the tracer saw the project's own code (not some other checkout's)
    assert "gateway/web/views.py" in spine["executed_files"]
    # the admission's script, from the web view
    admitted = _calls(spine, "redis.asyncio", "budgets.admission/admit.lua")
    assert admitted and all("gateway/web/views.py" in _files(c["chain"]) for c in admitted)
    # the pool call, from the task
    pool_calls = _calls(spine, "http.client.", "/chat/completions")
    assert pool_calls and all("gateway/worker/tasks.py" in _files(c["chain"]) for c in pool_calls)
    # the ledger INSERT, from the task, through the writer
    table = UsageRecord._meta.db_table
    inserts = _calls(spine, "django.CursorWrapper.execute", f'INSERT INTO "{table}"')
    assert len(inserts) == 1
    assert {"gateway/worker/tasks.py", "budgets/ledger/writer.py"} <= set(_files(inserts[0]["chain"]))
    # every script call seen in Python went out as an EVALSHA; no I/O got past the named
    # boundaries, and no connection was opened (steady state: the warm-up opened them)
    assert set(spine["lua_script_calls"]) == set(spine["lua_scripts"])
    assert not [c for c in spine["boundary_calls"]
                if c["boundary"].startswith("socket.") or c["boundary"] == "django.DatabaseWrapper.connect"]
    # the spine is a part of what ran, and more than the handful of files in docs/architecture.md's count
    assert set(spine["spine_files"]) <= set(spine["executed_files"])
    assert len(spine["spine_files"]) >= 10
    assert not spine["threads_untraced"] or "spine-lane-worker" not in spine["threads_untraced"]


def test_the_spine_is_within_the_bound(spine):
    reentered = {path for entry in spine["reentries"] for path in entry["reentered"]}
    assert len(spine["spine_files"]) <= MAX_SPINE_FILES, spine["spine_files"]
    assert reentered <= set(REENTRIES_ALLOWED), spine["reentries"]


# --- the tracer, proved on planted modules ------------------------------------

PLANTED = {
    "planted_a.py": """
        import planted_b

        def outer(io):
            return planted_b.middle(io)

        def inner(io):
            return io()

        def straight(io):
            return helper(io)

        def helper(io):
            return planted_b.leaf(io)

        async def async_outer(io):
            return await planted_b.async_middle(io)

        async def async_inner(io):
            return await io()
    """,
    "planted_b.py": """
        import planted_a

        def middle(io):
            return planted_a.inner(io)

        def leaf(io):
            return io()

        async def async_middle(io):
            return await planted_a.async_inner(io)
    """,
}


@pytest.fixture
def planted(tmp_path):
    for name, source in PLANTED.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    root = str(tmp_path.resolve())
    sys.path.insert(0, root)
    try:
        yield tmp_path.resolve(), importlib.import_module("planted_a")
    finally:
        sys.path.remove(root)
        for name in PLANTED:
            sys.modules.pop(name.removesuffix(".py"), None)


def test_the_tracer_finds_a_reentry_on_a_planted_chain(planted, redis_client):
    import redis.asyncio

    root, planted_a = planted
    tracer = SpineTracer(root=root)
    async_client = redis.asyncio.Redis.from_url(settings.REDIS_URL)

    async def async_ping():
        try:
            return await planted_a.async_outer(async_client.ping)
        finally:
            await async_client.aclose()

    # given: the tracer installed, then a thread started (covered by threading.setprofile)
    tracer.install()
    try:
        tracer.start()
        # when: a -> b -> a -> Redis on that thread; a -> a -> b -> Redis here; the same re-entry awaited
        thread = threading.Thread(target=planted_a.outer, args=(redis_client.ping,))
        thread.start()
        thread.join()
        planted_a.straight(redis_client.ping)
        asyncio.run(async_ping())
        tracer.stop()
        redis_client.ping()  # not recording: not seen
    finally:
        tracer.uninstall()

    # then
    # (each chain once: a new connection's handshake is more sends on the same
    # chain; its connect, which no named boundary covers, is seen on its socket)
    chains = list(dict.fromkeys((call.boundary.rsplit(".", 1)[0], call.files, call.reentered)
                                for call in tracer.calls))
    assert chains == [
        ("redis.connection", ("planted_a.py", "planted_b.py", "planted_a.py"), ("planted_a.py",)),
        ("redis.connection", ("planted_a.py", "planted_b.py"), ()),
        ("socket", ("planted_a.py", "planted_b.py", "planted_a.py"), ("planted_a.py",)),
        ("redis.asyncio.connection", ("planted_a.py", "planted_b.py", "planted_a.py"), ("planted_a.py",)),
    ]
    assert [call.boundary for call in tracer.calls if call.boundary.startswith("socket.")] == ["socket.connect"]
    assert tracer.calls[0].thread == thread.name
    assert tracer.calls[0].chain == ("planted_a.py:outer", "planted_b.py:middle", "planted_a.py:inner")
    assert tracer.spine_files() == ["planted_a.py", "planted_b.py"]
    assert [entry["reentered"] for entry in tracer.reentries()] == [["planted_a.py"]]
    assert tracer.executed == {"planted_a.py", "planted_b.py"}
