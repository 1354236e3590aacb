"""What an operator runs Sluice by: /metrics (every process's counters added
up, live numbers from Redis), the Grafana dashboard's queries, one JSON access
line per /v1 request, the request id from the API through the worker to the
ledger, and secrets that never reach a log file. Real processes throughout:
the platform fixture's web server, lane workers and simulated pool."""

from __future__ import annotations

import ast
import json
import logging
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.test import RequestFactory, override_settings
from prometheus_client.parser import text_string_to_metric_families

from budgets.models import UsageRecord
from gateway.core.log_context import log_annotate, log_context
from gateway.core.observability import reason_label
from llm_platform.log_format import REDACTED, ContextFilter, JsonFormatter, PlainFormatter
from llm_platform.observability import metrics_access_allowed
from tests.conftest import PLANTED_POOL_KEY_ENV

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana-sluice.json"
HELLO = [{"role": "user", "content": "Hello, operator."}]


# --- helpers ------------------------------------------------------------------------


def slow_refill_pool(platform, make_caller):
    """A pool whose buckets hold a full minute: a workload allowed N requests a
    minute gets exactly N in a test (one more only after 60/N s)."""
    return make_caller.pool(base_url=f"{platform.sim_url}/v1", headroom=0.5, burst_seconds=60)


def chat(platform, api_key: str, *, output_tokens: int = 5, headers: dict | None = None, **sim) -> httpx.Response:
    return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {api_key}", **(headers or {})},
                      json={"model": "sim-small", "messages": HELLO, "max_tokens": 8,
                            "sim": {"output_tokens": output_tokens, **sim}})


def scrape(platform) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    response = httpx.get(f"{platform.base_url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    """One series' value (0 when it does not exist yet)."""
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def total(samples, name: str, **labels) -> float:
    """The sum over every series of ``name`` whose labels include ``labels``."""
    wanted = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def log_lines(path: Path) -> list[dict]:
    """The JSON lines of a log (test_every_line_of_every_django_process_is_json
    checks there are no others)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def wait_for_line(path: Path, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log_lines(path) if predicate(line)]
        if found:
            assert len(found) == 1, found
            return found[0]
        assert time.monotonic() < deadline, f"no such line in {path.name}"
        time.sleep(0.1)


# --- /metrics over the real processes ------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_metrics_add_up_web_and_workers_with_exact_counts(platform, make_caller):
    # given: a workload allowed 3 requests a minute on the simulated pool
    pool = slow_refill_pool(platform, make_caller)
    caller = make_caller(pool=pool, rpm=3)
    wid, pid = caller.workload.id, pool.id
    before = scrape(platform)

    # when: two completions, one the pool throttles (429, its retry refused by
    # the pool's empty retry budget), one refused at the door (rpm), one bad key
    ok = [chat(platform, caller.api_key, output_tokens=n) for n in (3, 4)]
    throttled = chat(platform, caller.api_key, fail_status=429, fail_retry_after=0)
    refused = chat(platform, caller.api_key)
    bad_key = chat(platform, "sk-sluice-not-a-key-" + secrets.token_hex(8))
    # a worker reports a settlement after the answer's ledger row and
    # departure, a moment after the answer itself: scrape until all three are in
    settled = "sluice_ledger_write_lag_seconds_count"
    deadline = time.monotonic() + 10
    while (value(after := scrape(platform), settled, lane="interactive") - value(before, settled, lane="interactive")
           < 3 and time.monotonic() < deadline):
        time.sleep(0.05)

    # then: the web's counts, the workers' counts and Redis's numbers are all in one scrape
    assert [r.status_code for r in ok] == [200, 200]
    assert throttled.status_code == 429 and throttled.json()["error"]["code"] == "upstream_rate_limited"
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "workload_rpm"
    assert bad_key.status_code == 401
    lane = {"pool_id": pid, "workload_id": wid, "lane": "interactive"}
    assert value(after, "sluice_admissions_total", **lane, borrowed="false") == 3
    assert value(after, "sluice_refusals_total", reason="workload_rpm", workload_id=wid, lane="none") == 1
    assert value(after, "sluice_refusals_total", reason="upstream_rate_limited", workload_id=wid,
                 lane="interactive") == 1
    bad_key_refusals = ("sluice_refusals_total", {"reason": "invalid_api_key", "workload_id": "none", "lane": "none"})
    assert value(after, bad_key_refusals[0], **bad_key_refusals[1]) - value(before, bad_key_refusals[0],
                                                                             **bad_key_refusals[1]) == 1
    prompt = int(ok[0].headers["x-sluice-estimated-prompt-tokens"])
    assert value(after, "sluice_estimated_tokens_total", **lane, direction="input") == 3 * prompt
    assert value(after, "sluice_estimated_tokens_total", **lane, direction="output") == 3 * 8
    assert value(after, "sluice_actual_tokens_total", **lane, direction="output") == 3 + 4
    assert value(after, "sluice_actual_tokens_total", **lane, direction="input") == sum(
        r.json()["usage"]["prompt_tokens"] for r in ok)
    assert value(after, "sluice_upstream_responses_total", pool_id=pid, status="200") == 2
    assert value(after, "sluice_upstream_responses_total", pool_id=pid, status="429") == 1
    for histogram in ("sluice_queue_wait_seconds", "sluice_upstream_seconds", "sluice_request_seconds",
                      "sluice_ledger_write_lag_seconds"):
        counted = value(after, f"{histogram}_count", lane="interactive") - value(before, f"{histogram}_count",
                                                                               lane="interactive")
        assert counted == 3, histogram
    assert value(after, "sluice_ledger_write_lag_seconds_sum", lane="interactive") > value(
        before, "sluice_ledger_write_lag_seconds_sum", lane="interactive")
    assert value(after, "sluice_settled_requests_total", lane="interactive", status="upstream_error") - value(
        before, "sluice_settled_requests_total", lane="interactive", status="upstream_error") == 1
    # live numbers, read from Redis at scrape time
    assert value(after, "sluice_live_metrics_up") == 1
    assert value(after, "sluice_pool_info", pool_id=pid, pool=pool.slug) == 1
    assert value(after, "sluice_workload_info", workload_id=wid, workload=caller.workload.slug,
                 tenant=caller.tenant.slug) == 1
    assert value(after, "sluice_pool_capacity_factor", pool_id=pid) == 0.5  # halved by the upstream 429
    assert value(after, "sluice_pool_in_flight", pool_id=pid) == 0
    assert value(after, "sluice_lane_in_flight", pool_id=pid, lane="interactive") == 0
    assert value(after, "sluice_lane_arrival_rate", pool_id=pid, lane="interactive") == pytest.approx(3 / 60, abs=1e-3)
    assert value(after, "sluice_lane_lambda_w", pool_id=pid, lane="interactive") > 0
    assert value(after, "sluice_queue_depth", lane="interactive") == 0
    assert value(after, "sluice_lane_relay_tokens_per_second", pool_id=pid, lane="interactive") == pytest.approx(
        (3 + 4) / 60, abs=0.1)
    # the lane workers' own gauges: nothing running now; the session's
    # interactive worker's 8 threads (and any worker an earlier test killed
    # outright, whose gauges stay until the next start)
    assert value(after, "sluice_lane_calls_running", lane="interactive") == 0
    assert value(after, "sluice_lane_threads_ceiling", lane="interactive") >= 8
    assert value(after, "sluice_pool_retry_first_attempts_total", pool_id=pid) == 3
    assert value(after, "sluice_pool_retries_total", pool_id=pid) == 0
    assert value(after, "sluice_pool_retry_refusals_total", pool_id=pid, budget="pool") == 1
    # none of these calls streamed: the lane's first-token series exists and did not move
    assert ("sluice_time_to_first_token_seconds_count", frozenset({("lane", "interactive")})) in after
    assert value(after, "sluice_time_to_first_token_seconds_count", lane="interactive") == value(
        before, "sluice_time_to_first_token_seconds_count", lane="interactive")
    # the scrape added up files of several processes: the web server's and a worker's at least
    metric_files = list(Path(platform.env["PROMETHEUS_MULTIPROC_DIR"]).glob("*.db"))
    assert len({re.search(r"_(\d+)\.db$", f.name).group(1) for f in metric_files}) >= 2


@pytest.mark.django_db(transaction=True)
def test_metrics_labels_never_carry_request_ids_or_keys(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    response = chat(platform, caller.api_key)
    text = httpx.get(f"{platform.base_url}/metrics", timeout=30).text
    assert response.status_code == 200
    assert response.headers["x-request-id"] not in text
    assert "req_" not in text
    assert "sk-" not in text
    label_names = {name for family in text_string_to_metric_families(text) for s in family.samples for name in s.labels}
    assert label_names <= {"pool_id", "pool", "workload_id", "workload", "tenant", "lane", "borrowed", "reason",
                           "route", "status", "direction", "budget", "le",
                           # bounded enums: a circuit's state; tokens or requests; what a key
                           # check the database did not answer got (served, refused)
                           "state", "unit", "answer",
                           # the process collector of a single-process scrape
                           "generation", "implementation", "major", "minor", "patchlevel", "version"}


@pytest.mark.django_db(transaction=True)
def test_metrics_refuse_a_request_relayed_by_a_proxy(platform):
    # A proxy on this host makes every outside client look local: a request
    # that carries a forwarding header is never served by address alone.
    for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
        response = httpx.get(f"{platform.base_url}/metrics", headers={header: "203.0.113.9"}, timeout=10)
        assert response.status_code == 403, header
        assert "sluice_" not in response.text
    assert httpx.post(f"{platform.base_url}/metrics", timeout=10).status_code == 405


@pytest.mark.django_db(transaction=True)
def test_grafana_dashboard_queries_only_metrics_that_a_scrape_has(platform, make_caller):
    # given: traffic that touches every metric: a completion, a refusal
    pool = slow_refill_pool(platform, make_caller)
    caller = make_caller(pool=pool, rpm=1)
    assert chat(platform, caller.api_key).status_code == 200
    assert chat(platform, caller.api_key).status_code == 429
    names = {name for name, _ in scrape(platform)}

    # when: every query of the dashboard is read
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
              for variable in dashboard["templating"]["list"] if variable["type"] == "query"]

    # then: each names our metrics only, and each of those is in the scrape
    assert len(exprs) >= 20
    used = set()
    for expr in exprs:
        metric_names = set(re.findall(r"\bsluice_[a-z0-9_]+", expr))
        assert metric_names, expr
        used |= metric_names
    assert sorted(used - names) == []
    # every metric we export has a panel
    exported = {name for name in names if name.startswith("sluice_")}
    exported_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    used_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert sorted(exported_families - used_families) == []


# prometheus_client's metric classes and what a scrape adds to a name given to them.
METRIC_CLASSES = {"Counter": "_total", "CounterMetricFamily": "_total", "Gauge": "", "GaugeMetricFamily": "",
                  "Histogram": "", "HistogramMetricFamily": ""}
OBSERVABILITY_GUIDE = ROOT / "docs" / "observability.md"


def declared_metrics(packages: list[Path]) -> dict[str, str]:
    """Every metric the code declares (a prometheus_client metric or metric
    family named by a string literal), as a scrape names it: counters with
    ``_total``. Name -> the file that declares it."""
    found = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    continue
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in METRIC_CLASSES and node.args[0].value.startswith("sluice_"):
                    suffix = METRIC_CLASSES[func]
                    name = node.args[0].value.removesuffix(suffix) + suffix
                    found[name] = str(path.relative_to(ROOT))
    return found


def test_every_metric_the_code_declares_has_a_row_in_the_observability_guide():
    # given: the metric table of docs/observability.md, what an operator reads a scrape by
    documented = {name for line in OBSERVABILITY_GUIDE.read_text().splitlines() if line.startswith("| `sluice_")
                  for name in re.findall(r"`(sluice_[a-z0-9_]+)", line.split(" | ")[0])}

    # when: every metric the web, worker and budget code declares is listed
    declared = declared_metrics([ROOT / "gateway", ROOT / "budgets", ROOT / "llm_platform"])

    # then: the finder sees the kinds of declaration there are (so an empty
    # walk cannot pass), and each metric it finds has its row
    assert {"sluice_admissions_total", "sluice_queue_wait_seconds", "sluice_lane_calls_running",
            "sluice_lane_relay_tokens_per_second", "sluice_pool_retries_total"} <= set(declared)
    assert len(declared) >= 30
    assert sorted(f"{name} ({path})" for name, path in declared.items() if name not in documented) == []


# --- access log, request ids --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_one_access_line_per_v1_request_and_the_request_id_reaches_worker_and_ledger(platform, make_caller):
    # given
    pool = slow_refill_pool(platform, make_caller)
    caller = make_caller(pool=pool, rpm=2)
    web_log = platform.log_dir / "web.log"
    worker_log = platform.log_dir / "worker-interactive.log"

    # when: a completion, every kind of refusal and an unknown path
    ok = chat(platform, caller.api_key, output_tokens=6)
    responses = {
        "ok": ok,
        "bad_body": httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=10, content=b"{not json",
                               headers={"Authorization": f"Bearer {caller.api_key}"}),
        "over_budget": [chat(platform, caller.api_key) for _ in range(2)][-1],
        "no_key": httpx.post(f"{platform.base_url}/v1/chat/completions", json={}, timeout=10),
        "bad_key": chat(platform, "sk-sluice-wrong-" + secrets.token_hex(8)),
        "wrong_method": httpx.get(f"{platform.base_url}/v1/chat/completions", timeout=10),
        "unknown_path": httpx.get(f"{platform.base_url}/v1/no/such/thing", timeout=10),
        "models": httpx.get(f"{platform.base_url}/v1/models", timeout=10,
                            headers={"Authorization": f"Bearer {caller.api_key}"}),
    }

    # then: every answer has a request id, and exactly one access line under it
    expected = {
        "ok": (200, ""), "bad_body": (400, "invalid_json"), "over_budget": (429, "workload_rpm"),
        "no_key": (401, "missing_api_key"), "bad_key": (401, "invalid_api_key"),
        "wrong_method": (405, "method_not_allowed"), "unknown_path": (404, "not_found"), "models": (200, ""),
    }
    ids = set()
    for name, response in responses.items():
        request_id = response.headers.get("x-request-id", "")
        assert re.fullmatch(r"req_[0-9a-f]{32}", request_id), name
        ids.add(request_id)
        line = wait_for_line(web_log, lambda l, rid=request_id: l.get("logger") == "sluice.access"
                             and l.get("request_id") == rid)
        status, reason = expected[name]
        assert (line["status"], line["reason"]) == (status, reason), name
        assert line["method"] == response.request.method
        assert line["path"] == response.request.url.path
        assert line["level"] == "INFO" and isinstance(line["total_ms"], int)
        if name not in {"no_key", "bad_key", "wrong_method", "unknown_path"}:
            assert (line["tenant"], line["workload"], line["workload_id"]) == (
                caller.tenant.slug, caller.workload.slug, caller.workload.id), name
    assert len(ids) == len(responses)

    # the completion's line has its lane and phases; the worker's lines and the ledger row carry its id
    request_id = ok.headers["x-request-id"]
    access = wait_for_line(web_log, lambda l: l.get("logger") == "sluice.access" and l.get("request_id") == request_id)
    assert access["lane"] == "interactive"
    assert access["queue_ms"] == int(ok.headers["x-sluice-queue-ms"])
    assert access["upstream_ms"] >= 0 and access["attempts"] == 1 and access["upstream_status"] == 200
    settled = wait_for_line(worker_log, lambda l: l.get("logger") == "sluice.settlement"
                            and l.get("request_id") == request_id)
    assert (settled["status"], settled["output_tokens"], settled["lane"]) == ("ok", 6, "interactive")
    assert settled["workload_id"] == caller.workload.id and settled["ledger_lag_ms"] >= 0
    row = UsageRecord.objects.get(request_id=request_id)
    assert (row.actual_output_tokens, row.lane) == (6, "interactive")


@pytest.mark.django_db(transaction=True)
def test_a_client_that_hangs_up_still_leaves_an_access_line(platform, make_caller, redis_client):
    # given: a completion the pool takes seconds to answer, sent on a raw socket
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    body = json.dumps({"model": "sim-small", "messages": HELLO, "max_tokens": 8,
                       "sim": {"latency_ms": 20_000}}).encode()
    client = socket.create_connection(("127.0.0.1", platform.web_port))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   + f"Authorization: Bearer {caller.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    # when: the client hangs up while the web process waits for the worker
    # (a worker owns the request: the web side is parked on its result)
    def owned_by_a_worker() -> bool:
        return any(redis_client.hget(key.removesuffix(":owner"), "workload_id") == str(caller.workload.id)
                   for key in redis_client.scan_iter(match="sluice:req:*:owner"))

    deadline = time.monotonic() + 10
    while not owned_by_a_worker():
        assert time.monotonic() < deadline, "the request never reached a worker"
        time.sleep(0.05)
    client.close()

    # then: the web process logged it, as nginx would, 499
    line = wait_for_line(platform.log_dir / "web.log", lambda l: l.get("logger") == "sluice.access"
                         and l.get("workload_id") == caller.workload.id)
    assert (line["status"], line["reason"], line["lane"]) == (499, "client_closed_request", "interactive")
    assert line["request_id"].startswith("req_") and line["level"] == "INFO"


@pytest.mark.django_db(transaction=True)
def test_a_streams_access_line_is_written_when_it_ends_with_its_whole_time(platform, make_caller):
    # given: a stream of 80 tokens, read chunk by chunk
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    body = {"model": "sim-small", "messages": HELLO, "max_tokens": 80, "stream": True, "sim": {"output_tokens": 80}}
    first = None
    with httpx.Client(timeout=30) as client:  # built before the clock starts: its TLS context takes tens of ms
        sent = time.monotonic()
        with client.stream("POST", f"{platform.base_url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {caller.api_key}"}) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data:") and first is None:
                    first = time.monotonic()
        ended = time.monotonic()
    assert ended - first > 0.15, "the stream was too short to tell its end from its start"

    # then: its line came when it ended, and its time is the whole stream's, not its first chunk's
    line = wait_for_line(platform.log_dir / "web.log", lambda l: l.get("logger") == "sluice.access"
                         and l.get("request_id") == request_id)
    assert (line["status"], line["reason"], line["route"]) == (200, "", "chat-completions")
    assert line["total_ms"] >= (ended - sent) * 1000 - 50


@pytest.mark.django_db(transaction=True)
def test_every_line_of_every_django_process_is_json(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    assert chat(platform, caller.api_key).status_code == 200
    files = [platform.log_dir / "web.log", platform.log_dir / "pacer.log",
             *sorted(platform.log_dir.glob("worker-*.log"))]
    assert len(files) == 6
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # Celery prints this from its signal handler, past any logging
            # configuration, when a test stops a worker.
            if line.strip() and not re.fullmatch(r"worker: (Warm|Cold) shutdown \(MainProcess\)", line):
                entry = json.loads(line)  # raises on a plain-text line
                assert {"ts", "level", "logger", "msg", "pid"} <= set(entry), f"{path.name}:{number}"


# --- secrets ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_no_secret_reaches_any_log_file(platform, make_caller):
    # given: a pool whose API key is a planted secret, a workload key, a wrong key
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", api_key_env=PLANTED_POOL_KEY_ENV, headroom=0.5,
                            burst_seconds=60)
    caller = make_caller(pool=pool, rpm=3)
    wrong_key = "sk-sluice-" + secrets.token_urlsafe(32)
    planted = {
        "workload key": caller.api_key,
        "its Authorization header": f"Bearer {caller.api_key}",
        "wrong key": wrong_key,
        "wrong key's header": f"Bearer {wrong_key}",
        "DJANGO_SECRET_KEY": platform.env["DJANGO_SECRET_KEY"],
        "pool API key": platform.env[PLANTED_POOL_KEY_ENV],
    }

    # when: the keys go through every path: success, pool error, refusal,
    # bad key, a key in a query string, a key as a body field
    ok = chat(platform, caller.api_key)
    assert ok.status_code == 200
    assert chat(platform, caller.api_key, fail_status=503).status_code == 502
    assert chat(platform, caller.api_key).status_code == 200
    assert chat(platform, caller.api_key).status_code == 429
    assert chat(platform, wrong_key).status_code == 401
    assert httpx.get(f"{platform.base_url}/v1/models?api_key={caller.api_key}", timeout=10).status_code == 401
    assert httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {wrong_key}"},
                      json={"model": "sim-small", "messages": HELLO, "api_key": caller.api_key}).status_code == 401
    assert httpx.get(f"{platform.base_url}/v1/models", timeout=10,
                     headers={"Authorization": f"Basic {caller.api_key}"}).status_code == 401
    request_id = ok.headers["x-request-id"]
    wait_for_line(platform.log_dir / "worker-interactive.log",
                  lambda l: l.get("logger") == "sluice.settlement" and l.get("request_id") == request_id)

    # then: not one log file of the platform holds any of them...
    logs = {path.name: path.read_text() for path in platform.log_dir.glob("*.log")}
    assert {"web.log", "pacer.log", "sim.log", "worker-interactive.log"} <= set(logs)
    leaks = [(what, name) for what, secret in planted.items() for name, text in logs.items() if secret in text]
    assert leaks == []
    # ...though the same search finds what is there: the request in the web's and the worker's logs
    assert request_id in logs["web.log"] and request_id in logs["worker-interactive.log"]


# --- the pieces, without processes ----------------------------------------------------------


def _record(message: str, *args, **extra) -> logging.LogRecord:
    record = logging.LogRecord("sluice.test", logging.INFO, __file__, 1, message, args, None)
    for name, field in extra.items():
        setattr(record, name, field)
    return record


def test_json_lines_carry_the_request_context_and_extra_fields():
    formatter, context = JsonFormatter(), ContextFilter()
    with log_context(request_id="req_1", lane="batch"):
        log_annotate(workload="chat")
        record = _record("settled %s\nsecond line", "ok", queue_ms=12, client=object())
        context.filter(record)
    line = formatter.format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["msg"] == "settled ok\nsecond line"
    assert (entry["request_id"], entry["lane"], entry["workload"], entry["queue_ms"]) == ("req_1", "batch", "chat", 12)
    assert entry["level"] == "INFO" and entry["logger"] == "sluice.test"
    assert "client" not in entry  # only plain values: str() of an object may say too much
    outside = _record("no request")
    context.filter(outside)
    assert "request_id" not in json.loads(formatter.format(outside))


def test_formatters_scrub_credentials_and_configured_secrets():
    secret_key = "planted-" + secrets.token_hex(8)
    key = "sk-sluice-" + secrets.token_urlsafe(32)
    message = (f"Authorization: Bearer {key} bearer abcdefghijklmnop {key} redis://user:hunter2pass@redis:6379/0 "
               f"{secret_key} token bucket refilled")
    for formatter in (JsonFormatter(secrets=[secret_key, ""]), PlainFormatter(secrets=[secret_key])):
        line = formatter.format(_record(message, path=f"/v1/x?{key}"))
        assert key not in line and secret_key not in line and "hunter2pass" not in line
        assert "abcdefghijklmnop" not in line
        assert f"Bearer {REDACTED}" in line and "redis://user:[redacted]@redis:6379/0" in line
        assert "token bucket refilled" in line  # ordinary words survive


def test_scrubbing_skips_a_pattern_only_where_it_cannot_match():
    # Each credential pattern runs only on a line holding its literal; a
    # line scrubbed so must equal one with every pattern run on it.
    import random

    from llm_platform.log_format import _CREDENTIALS

    def every_pattern(text: str) -> str:
        for _, pattern, replacement in _CREDENTIALS:
            text = pattern.sub(replacement, text)
        return text

    fragments = ["Bearer ", "bEaReR\t", "BEARER  ", "bearer", "sk-", "SK-", "sk_", "://", "https://", "Redis://",
                 "user", ":", "pw", "@", "/", " ", "\n", "abcdefghijklmnop", "0123456789", "-_.~+=", "ſ", "K", "İ",
                 "token", "x"]
    rng = random.Random(7)
    formatter = JsonFormatter()
    lines = ["".join(rng.choice(fragments) for _ in range(rng.randrange(1, 30))) for _ in range(5_000)]
    lines += ["bEaReR abcdefghijklmnop1", "SK-abcdefghij sk-abcdefghij", "HTTPS://u:p@h/", "a://:p@"]
    for line in lines:
        assert formatter.scrub(line) == every_pattern(line), line
    # and the planted credentials of every kind are among the lines changed
    assert sum(formatter.scrub(line) != line for line in lines) > 500


def test_plain_lines_quote_values_so_they_cannot_forge_fields():
    line = PlainFormatter().format(_record("GET", path="/v1/a b\nlevel=ERROR", status=200))
    assert "\n" not in line
    assert line.endswith('path="/v1/a b\\nlevel=ERROR" status=200')


def test_reason_labels_are_bounded():
    assert reason_label("workload_tpm") == "workload_tpm"
    for unbounded in ("Workload TPM", "x" * 65, "", None, 429, "a\nb", "sk-sluice-abc"):
        assert reason_label(unbounded) == "other"


def _metrics_request(address: str, **headers):
    request = RequestFactory().get("/metrics", **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()})
    request.META["REMOTE_ADDR"] = address
    return request


@override_settings(SLUICE_METRICS_TOKEN="")
def test_metrics_access_by_network():
    assert metrics_access_allowed(_metrics_request("127.0.0.1"))
    assert metrics_access_allowed(_metrics_request("::1"))
    assert metrics_access_allowed(_metrics_request("::ffff:127.0.0.1"))
    assert not metrics_access_allowed(_metrics_request("10.0.0.8"))
    assert not metrics_access_allowed(_metrics_request("127.0.0.1", x_forwarded_for="203.0.113.9"))
    assert not metrics_access_allowed(_metrics_request("not-an-address"))
    # a wrong token does not take away what the address allows
    assert metrics_access_allowed(_metrics_request("127.0.0.1", authorization="Bearer anything"))


@override_settings(SLUICE_METRICS_TOKEN="scrape-" + "t0ken-with-entropy", SLUICE_METRICS_ALLOWED_NETWORKS=[])
def test_metrics_access_by_token():
    assert metrics_access_allowed(_metrics_request("10.0.0.8", authorization="Bearer scrape-t0ken-with-entropy"))
    assert not metrics_access_allowed(_metrics_request("10.0.0.8", authorization="Bearer scrape-t0ken-with-entropY"))
    assert not metrics_access_allowed(_metrics_request("10.0.0.8", authorization="scrape-t0ken-with-entropy"))
    assert not metrics_access_allowed(_metrics_request("127.0.0.1"))  # no networks: token only


def test_an_unknown_log_format_stops_the_process_at_start():
    result = subprocess.run([sys.executable, "-c", "import llm_platform.settings"], cwd=ROOT, capture_output=True,
                            text=True, env={"PATH": "", "SLUICE_LOG_FORMAT": "xml"})
    assert result.returncode != 0
    assert "SLUICE_LOG_FORMAT must be 'json' or 'plain'" in result.stderr
