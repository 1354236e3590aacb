"""8. Request log at scale: keyset pages over a large ledger on PostgreSQL.

Seeds N ledger rows (1,000,000 by default, 20,000 with --quick) over 30 days
with one ``INSERT ... SELECT generate_series`` into a PostgreSQL database of
its own, then times the request log's own selectors (the code the pages
run): a tenant's first page, filtered first pages (a rare status, one API
key, a lane), and a page half-way down the tenant's rows, by keyset and,
as the baseline in the same run, by OFFSET at the same depth. Target: every
keyset page under 300 ms.

PostgreSQL only (the embedded SQLite has no such scale): DATABASE_URL when it
is PostgreSQL, else 127.0.0.1:5432 if it answers; else the scenario is
skipped, saying why. The measurement runs in a child process whose Django
points at a database named ``sluice_bench_request_log`` on that server
(dropped and created afresh), so it never touches the run's own database.

    .venv/bin/python -m bench.request_log [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone as dt_timezone
from urllib.parse import urlsplit, urlunsplit

from .common import ROOT, log, md_table, run_standalone, write_result

NAME = "request_log"
DATABASE = "sluice_bench_request_log"
TENANTS = 10
WORKLOADS_PER_TENANT = 5
KEYS_PER_WORKLOAD = 2
REPEATS = 7
TARGET_MS = 300.0


def _server_url(database_url: str) -> str | None:
    """A PostgreSQL URL on the run's server (or the local one), naming our database."""
    if database_url.startswith("postgres"):
        parts = urlsplit(database_url)
        return urlunsplit((parts.scheme, parts.netloc, f"/{DATABASE}", "", ""))
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1.0):
            return f"postgres://postgres@127.0.0.1:5432/{DATABASE}"
    except OSError:
        return None


def main(seed: int = 1, quick: bool = False, services=None, rows: int | None = None) -> dict:
    rows = rows or (20_000 if quick else 1_000_000)
    url = _server_url(services.database_url if services is not None else os.environ.get("DATABASE_URL", ""))
    if url is None:
        reason = "no PostgreSQL: DATABASE_URL is not PostgreSQL and nothing answers on 127.0.0.1:5432"
        log(f"{NAME}: skipped ({reason})")
        data = {"scenario": NAME, "skipped": reason, "quick": quick}
        write_result(NAME, data)
        return data
    env = {**(services.env if services is not None else os.environ), "DATABASE_URL": url,
           "DJANGO_SETTINGS_MODULE": "llm_platform.settings"}
    env.setdefault("DJANGO_SECRET_KEY", "bench-only-" + "x" * 40)
    log(f"{NAME}: seeding {rows:,} ledger rows into {DATABASE} and timing the log's pages")
    done = subprocess.run([sys.executable, "-m", "bench.request_log", "--child", "--rows", str(rows),
                           "--seed", str(seed)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{NAME} child failed: {done.stderr[-2000:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    data.update({"scenario": NAME, "quick": quick, "seed": seed})
    write_result(NAME, data)
    return data


# --- the child: its own Django, pointed at the bench database ----------------------


def _database_recreate(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit((parts.scheme.replace("postgresql", "postgres"), parts.netloc, "/postgres", "", ""))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')


SEED_SQL = """
INSERT INTO budgets_usagerecord (
    request_id, created_at, tenant_id, workload_id, pool_id, model, lane, status, borrowed,
    estimated_input_tokens, estimated_output_tokens, actual_input_tokens, actual_output_tokens, cost,
    queue_wait_ms, upstream_ms, total_ms, attempts, error, api_key_id, usage_source, overflow, failed_over,
    completion_id, endpoint)
SELECT 'req_bench_' || g,
       %(end)s::timestamptz - (g::bigint * %(step_us)s::bigint) * interval '1 microsecond',
       t.tenant_id, t.workload_id, %(pool)s, 'sim-small',
       (ARRAY['interactive', 'interactive', 'interactive', 'batch', 'interactive-long'])[1 + g %% 5],
       CASE WHEN g %% 100 = 7 THEN 'upstream_error' WHEN g %% 100 = 13 THEN 'queue_timeout' ELSE 'ok' END,
       g %% 17 = 0, 200 + g %% 800, 64, 200 + g %% 800, g %% 64, (200 + g %% 800) * 0.00000015,
       g %% 50, 100 + g %% 900, 150 + g %% 950, 1, '', t.key_id, 'pool', false, false, '',
       '/v1/chat/completions'
FROM generate_series(1, %(rows)s) AS g
JOIN bench_slots t ON t.slot = g %% %(slots)s
"""


def _seed(rows: int, end: datetime) -> dict:
    from django.db import connection

    from budgets.models import InferencePool
    from tenants.models import ApiKey, Tenant, Workload

    pool = InferencePool.objects.create(name="bench", slug="bench", base_url="http://127.0.0.1:9/v1",
                                        served_models=["sim-small"], provider_tpm=10_000_000, provider_rpm=100_000)
    slots = []
    for t in range(TENANTS):
        tenant = Tenant.objects.create(name=f"Tenant {t}", slug=f"tenant-{t}")
        for w in range(WORKLOADS_PER_TENANT):
            workload = Workload.objects.create(tenant=tenant, name=f"wl {t}-{w}", slug=f"wl-{t}-{w}")
            for k in range(KEYS_PER_WORKLOAD):
                key = ApiKey.objects.create(workload=workload, name=f"k{k}", prefix=f"sk-{t}{w}{k}",
                                            key_hash=f"{t:04d}{w:04d}{k:04d}".ljust(64, "0"))
                slots.append((len(slots), tenant.id, workload.id, key.id))
    step_us = int(timedelta(days=30) / timedelta(microseconds=1) / rows)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE bench_slots (slot int, tenant_id bigint, workload_id bigint, key_id bigint)")
        cursor.executemany("INSERT INTO bench_slots VALUES (%s, %s, %s, %s)", slots)
        started = time.perf_counter()
        cursor.execute(SEED_SQL, {"end": end, "step_us": step_us, "pool": pool.id, "rows": rows, "slots": len(slots)})
        seeded_s = time.perf_counter() - started
        cursor.execute("ANALYZE budgets_usagerecord")
    return {"seed_s": seeded_s, "slots": slots}


def _median_ms(call) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def child(rows: int) -> dict:
    _database_recreate(os.environ["DATABASE_URL"])
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, check=True)
    import django

    django.setup()
    from budgets.models import UsageRecord
    from budgets.selectors.latency import latency_by_workload_lane
    from budgets.selectors.request_log import Cursor, LogFilters, ledger_entry_of, request_log_page
    from budgets.selectors.usage import tokens_by_workload_bucket

    end = datetime.now(tz=dt_timezone.utc)
    seeded = _seed(rows, end)
    _slot, tenant_id, workload_id, key_id = seeded["slots"][0]
    workload_ids = sorted({slot[2] for slot in seeded["slots"] if slot[1] == tenant_id})
    scope = frozenset({tenant_id})
    month = dict(start=end - timedelta(days=30, minutes=1), end=end + timedelta(minutes=1), tenant_ids=scope)
    tenant_rows = UsageRecord.objects.filter(tenant_id=tenant_id).count()
    depth = tenant_rows // 2
    # the entry at half the tenant's depth: the cursor a reader paging down would hold there
    middle = UsageRecord.objects.filter(tenant_id=tenant_id).order_by("-created_at", "-id").select_related(
        "workload", "api_key", "price")[depth]
    cursor = ledger_entry_of(middle).cursor
    assert Cursor.decode(cursor.encode()) == cursor

    def offset_page():
        return list(UsageRecord.objects.filter(tenant_id=tenant_id, created_at__gte=month["start"])
                    .select_related("workload", "api_key", "price").order_by("-created_at", "-id")[depth:depth + 50])

    cases = {
        "first page (tenant, 30 days)": lambda: request_log_page(filters=LogFilters(**month)),
        "first page, status upstream_error": lambda: request_log_page(filters=LogFilters(**month, status="upstream_error")),
        "first page, one API key": lambda: request_log_page(filters=LogFilters(**month, api_key_id=key_id)),
        "first page, lane batch": lambda: request_log_page(filters=LogFilters(**month, lane="batch")),
        "first page, one workload, last hour": lambda: request_log_page(filters=LogFilters(
            start=end - timedelta(hours=1), end=end, tenant_ids=scope, workload_id=workload_id)),
        f"deep page by keyset (row {depth:,})": lambda: request_log_page(filters=LogFilters(**month), cursor=cursor),
        f"deep page by OFFSET {depth:,} (baseline)": offset_page,
        "latency p50/p95/p99 table (tenant, 24 h)": lambda: latency_by_workload_lane(filters=LogFilters(
            start=end - timedelta(hours=24), end=end, tenant_ids=scope)),
        "tenant chart, 7 d in hour buckets (ledger)": lambda: tokens_by_workload_bucket(
            workload_ids=workload_ids, start=end - timedelta(days=7), end=end, bucket="hour"),
    }
    timings = {name: _median_ms(call) for name, call in cases.items()}
    keyset = timings[f"deep page by keyset (row {depth:,})"]
    offset = timings[f"deep page by OFFSET {depth:,} (baseline)"]
    return {"rows": rows, "tenant_rows": tenant_rows, "depth": depth, "seed_s": seeded["seed_s"],
            "timings_ms": timings, "offset_over_keyset": offset / keyset if keyset else None,
            "target_ms": TARGET_MS, "repeats": REPEATS}


# --- report -------------------------------------------------------------------------


def summarize(data: dict) -> str:
    if data.get("skipped"):
        return f"Skipped: {data['skipped']}."
    def is_page(name: str) -> bool:
        return "page" in name and "OFFSET" not in name

    pages = {k: v for k, v in data["timings_ms"].items() if is_page(k)}
    worst = max(pages.values())
    rows = [[name, f"{ms:,.1f}", ("met" if ms < data["target_ms"] else "missed") if is_page(name) else ""]
            for name, ms in data["timings_ms"].items()]
    return "\n".join([
        f"{data['rows']:,} ledger rows over 30 days on PostgreSQL ({TENANTS} tenants x {WORKLOADS_PER_TENANT} "
        f"workloads x {KEYS_PER_WORKLOAD} keys; the tenant measured holds {data['tenant_rows']:,}), seeded in "
        f"{data['seed_s']:.0f} s by one INSERT ... SELECT generate_series. Median of {data['repeats']} calls of the "
        "log's own selectors (50 entries a page, ledger and rejections merged).",
        "",
        md_table(["query", "median ms", f"< {data['target_ms']:.0f} ms"], rows),
        "",
        f"Slowest keyset page: **{worst:,.1f} ms**. At row {data['depth']:,}, OFFSET is "
        f"**{data['offset_over_keyset']:,.0f}x** the keyset page in the same run: OFFSET reads and discards every "
        "row above the page, the keyset page starts at its cursor in the (tenant, created_at, id) index.",
    ])


def plot(data: dict, plots_dir=None) -> list[str]:
    return []


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(child(int(sys.argv[sys.argv.index("--rows") + 1]))))
    else:
        run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
