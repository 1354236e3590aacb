"""The request path's Prometheus metrics, defined once for both sides: the
web process counts admissions, refusals and answers; the worker counts what
the pool answered, the tokens it used, the time each phase took and how long
the ledger row trailed the admission. docs/observability.md lists them.

With ``PROMETHEUS_MULTIPROC_DIR`` set (settings.SLUICE_METRICS_DIR) every
process writes its values to files in that directory and ``/metrics``
(llm_platform/observability.py) adds them up, so a scrape of the web process
shows the workers' counters too. Live state (in-flight, lambda*W, queue depth,
capacity factor, retry budgets) is in Redis and read at scrape time.

Labels stay bounded: pool and workload ids, lanes, reason codes, HTTP
statuses; never a request id, a key or anything a caller can choose freely.

Recording a metric never fails a request: a broken metrics directory costs
the numbers, not the caller's answer."""

from __future__ import annotations

import functools
import logging
import re

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from gateway.core.lanes import LANE_NAMES
from gateway.core.request.records import Outcome, RequestRecord

logger = logging.getLogger(__name__)
# One line per settled request, from whichever process settled it (worker, web, reaper).
settlement_log = logging.getLogger("sluice.settlement")

# One ``_created`` series per counter child doubles the series count and
# multiprocess mode does not export them anyway.
prometheus_client.disable_created_metrics()

# Seconds, from a cache-hot interactive call to a batch job's upstream timeout.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

NONE = "none"  # label value for "not known": no workload yet (bad key), no lane yet (refused at the door)
_REASON = re.compile(r"^[a-z0-9_]{1,64}$")

ADMISSIONS = Counter("sluice_admissions", "Requests admitted and put on a lane (sync calls and jobs).",
                     ["pool_id", "workload_id", "lane", "borrowed"])
REFUSALS = Counter("sluice_refusals", "Chat completions and job submissions answered with an error, by its code "
                   "(lane 'none': refused before a lane was chosen).", ["reason", "workload_id", "lane"])
API_RESPONSES = Counter("sluice_api_responses", "Every /v1 answer, by route and HTTP status.", ["route", "status"])
ESTIMATED_TOKENS = Counter("sluice_estimated_tokens", "Tokens admission debited (the estimate).",
                           ["pool_id", "workload_id", "lane", "direction"])
ACTUAL_TOKENS = Counter("sluice_actual_tokens", "Tokens the pool reported, at settlement.",
                        ["pool_id", "workload_id", "lane", "direction"])
SETTLED = Counter("sluice_settled_requests", "Admitted requests settled, by how they ended "
                  "(ok, upstream_error, queue_timeout, lease_expired).", ["lane", "status"])
UPSTREAM_ANSWERS = Counter("sluice_upstream_responses", "The pool's answers per attempt, by HTTP status "
                           "(or timeout, unreachable, invalid_response).", ["pool_id", "status"])
QUEUE_WAIT = Histogram("sluice_queue_wait_seconds", "Admission to a worker picking the request up.", ["lane"],
                       buckets=LATENCY_BUCKETS)
UPSTREAM_TIME = Histogram("sluice_upstream_seconds", "Time in the pool's calls, retries included.", ["lane"],
                          buckets=LATENCY_BUCKETS)
TOTAL_TIME = Histogram("sluice_request_seconds", "Admission to settlement.", ["lane"], buckets=LATENCY_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram("sluice_time_to_first_token_seconds",
                                "Admission to the first streamed token (streams only).", ["lane"],
                                buckets=LATENCY_BUCKETS)
LEDGER_LAG = Histogram("sluice_ledger_write_lag_seconds", "Admission to the request's ledger row being written.",
                       ["lane"], buckets=LATENCY_BUCKETS)
# The web processes' doors (gateway/web/admission_turns.py), added up over
# the live processes. Recorded only by a request that waits: one that finds
# a turn free records nothing.
DOOR_WAITING = Gauge("sluice_web_door_waiting", "Requests waiting at the web processes' doors for a turn to "
                     "be admitted.", multiprocess_mode="livesum")
DOOR_WAITED_OUT = Counter("sluice_web_door_waited_out", "Requests that waited at the door for their whole bound "
                          "(SLUICE_REDIS_BUSY_WAIT_S) and went on without a turn.")

# Key checks the database did not answer (gateway/web/auth.py): away, or
# holding the lookup past SLUICE_AUTH_LOOKUP_WAIT_S; by what the caller got.
KEY_CHECKS_UNANSWERED = Counter("sluice_web_key_checks_unanswered",
                                "Key checks the database did not answer (away, or holding the lookup past "
                                "SLUICE_AUTH_LOOKUP_WAIT_S), by what the caller got: served as the key was last "
                                "checked, or refused 503 database_unavailable.", ["answer"])
KEY_CHECK_ANSWERS = ("served", "refused")

# How late a timer fires on a web process's event loop, sampled twice a
# second (gateway/web/loop_lag.py): what every step of every request waits
# for when the loop is busy.
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WEB_LOOP_LAG = Histogram("sluice_web_loop_lag_seconds", "How late a timer fired on the web processes' event "
                         "loops (sampled every 0.5 s): how long a turn of the loop takes.",
                         buckets=LOOP_LAG_BUCKETS)

# The web processes' shared stream reads (gateway/web/stream_reads.py): how
# many streams each read names. A read holds Redis for every other caller
# for a time that grows with the streams it names, so a tail here is time
# the admissions and the workers' appends wait.
STREAM_READ_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WEB_STREAM_READS = Histogram("sluice_web_stream_read_streams", "Streams named in each of the web processes' "
                             "shared stream reads (one XREAD each; the process's notice stream not counted).",
                             buckets=STREAM_READ_BUCKETS)

# Every lane's histograms exist from the start (zero counts), so a quiet lane
# reads 0 instead of "no data" and rate() has a starting point.
for _lane in LANE_NAMES:
    for _histogram in (QUEUE_WAIT, UPSTREAM_TIME, TOTAL_TIME, TIME_TO_FIRST_TOKEN, LEDGER_LAG):
        _histogram.labels(lane=_lane)
for _answer in KEY_CHECK_ANSWERS:
    KEY_CHECKS_UNANSWERED.labels(answer=_answer)

_failed: set[str] = set()

# A metric's child per label values, looked up once: prometheus_client's
# ``labels()`` checks and orders its arguments and takes the metric's lock on
# every call, and a request makes eight. The values are bounded (see above),
# so is this.
_children: dict[tuple, object] = {}


def _child(metric, *values: str):
    """``metric.labels(*values)``, values in the metric's label order."""
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


def _never_raises(record_metric):
    @functools.wraps(record_metric)
    def wrapper(*args, **kwargs) -> None:
        try:
            record_metric(*args, **kwargs)
        except Exception:  # noqa: BLE001 - losing a number beats failing the request
            if record_metric.__name__ not in _failed:  # once per process, not once per request
                _failed.add(record_metric.__name__)
                logger.warning("metrics: %s failed; the metric is not recorded", record_metric.__name__,
                               exc_info=True)

    return wrapper


def reason_label(code: object) -> str:
    """An error code as a label value: our codes are short snake_case; anything
    else (an unexpected body) is 'other', never free text."""
    return code if isinstance(code, str) and _REASON.match(code) else "other"


@_never_raises
def admission_observe(*, record: RequestRecord) -> None:
    pool, workload, lane = str(record.pool_id), str(record.workload_id), record.lane
    _child(ADMISSIONS, pool, workload, lane, "true" if record.borrowed else "false").inc()
    _child(ESTIMATED_TOKENS, pool, workload, lane, "input").inc(record.estimated_input_tokens)
    _child(ESTIMATED_TOKENS, pool, workload, lane, "output").inc(record.estimated_output_tokens)


@_never_raises
def refusal_observe(*, reason: object, workload_id: int | None, lane: str | None) -> None:
    _child(REFUSALS, reason_label(reason), str(workload_id) if workload_id else NONE,
           lane if lane in LANE_NAMES else NONE).inc()


@_never_raises
def api_response_observe(*, route: str, status: int) -> None:
    _child(API_RESPONSES, route, str(status)).inc()


@_never_raises
def door_waiting_observe(change: int) -> None:
    DOOR_WAITING.inc(change)


@_never_raises
def door_waited_out_observe() -> None:
    DOOR_WAITED_OUT.inc()


@_never_raises
def key_check_unanswered_observe(*, served: bool) -> None:
    KEY_CHECKS_UNANSWERED.labels(answer="served" if served else "refused").inc()


@_never_raises
def web_loop_lag_observe(seconds: float) -> None:
    WEB_LOOP_LAG.observe(seconds)


@_never_raises
def web_stream_read_observe(streams: int) -> None:
    WEB_STREAM_READS.observe(streams)


@_never_raises
def upstream_answer_observe(*, pool_id: int, status: str) -> None:
    _child(UPSTREAM_ANSWERS, str(pool_id), status).inc()


def settlement_report(*, record: RequestRecord, outcome: Outcome, pool_called: bool, total_ms: int,
                      ledger_lag_s: float) -> None:
    """A request settled and its ledger row is written: its metrics, and the
    worker's one log line about it (the web side's access line has the
    caller's view; this one has the pool's)."""
    _settlement_observe(record=record, outcome=outcome, pool_called=pool_called, total_ms=total_ms,
                        ledger_lag_s=ledger_lag_s)
    error = "" if outcome.status == "ok" else (outcome.body or {}).get("error", {}).get("code", "")
    settlement_log.info("request %s settled: %s", record.request_id, outcome.status, extra={
        "request_id": record.request_id, "status": outcome.status, "reason": str(error or ""), "lane": record.lane,
        "pool_id": record.pool_id, "workload_id": record.workload_id, "http_status": outcome.http_status,
        "upstream_status": outcome.upstream_status, "attempts": outcome.attempts, "queue_ms": outcome.queue_wait_ms,
        "upstream_ms": outcome.upstream_ms, "total_ms": total_ms, "ledger_lag_ms": int(ledger_lag_s * 1000),
        "input_tokens": outcome.input_tokens, "output_tokens": outcome.output_tokens,
        "estimated_input_tokens": record.estimated_input_tokens,
        "estimated_output_tokens": record.estimated_output_tokens,
    })


@_never_raises
def _settlement_observe(*, record: RequestRecord, outcome: Outcome, pool_called: bool, total_ms: int,
                        ledger_lag_s: float) -> None:
    lane = record.lane
    _child(SETTLED, lane, outcome.status).inc()
    _child(QUEUE_WAIT, lane).observe(outcome.queue_wait_ms / 1000)
    _child(TOTAL_TIME, lane).observe(total_ms / 1000)
    _child(LEDGER_LAG, lane).observe(max(0.0, ledger_lag_s))
    if pool_called:
        _child(UPSTREAM_TIME, lane).observe(outcome.upstream_ms / 1000)
        pool, workload = str(record.pool_id), str(record.workload_id)
        _child(ACTUAL_TOKENS, pool, workload, lane, "input").inc(outcome.input_tokens)
        _child(ACTUAL_TOKENS, pool, workload, lane, "output").inc(outcome.output_tokens)


def lease_expiry_report(*, record: RequestRecord, ledger_lag_s: float) -> None:
    """The reaper settled a request whose worker vanished (its estimate stays charged)."""
    _lease_expiry_observe(record=record, ledger_lag_s=ledger_lag_s)
    settlement_log.warning("request %s: lease expired; its estimate stays charged", record.request_id, extra={
        "request_id": record.request_id, "status": "lease_expired", "lane": record.lane, "pool_id": record.pool_id,
        "workload_id": record.workload_id, "ledger_lag_ms": int(ledger_lag_s * 1000)})


@_never_raises
def _lease_expiry_observe(*, record: RequestRecord, ledger_lag_s: float) -> None:
    SETTLED.labels(lane=record.lane, status="lease_expired").inc()
    LEDGER_LAG.labels(lane=record.lane).observe(max(0.0, ledger_lag_s))
