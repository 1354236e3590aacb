"""Admission cost against the number of workloads on one pool (issue 9):
budgets/admission/admit.lua at 10, 100 and 1,000 workloads, for a request paid from its
workload's protected bucket, a loan (needs the pool's protected sum S) and a
refused loan (needs the time at which P - S will fit it).

Redis's own time per script call (INFO commandstats: the time Redis is
blocked, which every other caller of the pool waits behind) and the client's
round trip, with the 10-workload row as the same-run baseline. When git has
it, the script as it was before S became an incremental aggregate (commit
BASELINE_REV: a loop over every workload's protected level, HGETALL of the
pool's hashes) runs on an identical pool in the same run as a second
baseline. No HTTP, no database: the bucket config comes from the same
``pool_bucket_fields`` the gateway pushes, built from unsaved models.

Run alone: ``python -m bench.admission_scale --seed 1``."""

from __future__ import annotations

import random
import subprocess
import time
import uuid
from pathlib import Path

from bench.common import PLOTS_DIR, fmt, log, md_table, ratio, run_standalone, write_result
from bench.platform import Services

NAME = "admission_scale"
SIZES = (10, 100, 1_000)
BASELINE_REV = "5a4493b"  # the last commit with the O(n) admission script
TARGET_US = 200.0
# budgets/admission/admit.lua's last arguments as the chat API passes them: a body digest is
# given (its held mark is looked up), and the fresh arrivals' averaging time
# (SLUICE_HELD_PACE_S). The script before BASELINE_REV ignores them.
ADMIT_TAIL = ("1", 10_000)


def _baseline_source() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", "show", f"{BASELINE_REV}:budgets/admission/admit.lua"], cwd=root,
                              capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _pool_push(redis, pool_id: int, n: int) -> tuple[int, list[int]]:
    """A pool with one borrower (lends nothing, protects nothing: every
    request is a loan) and n - 1 strict workloads whose reservations take 60%
    of the pool. Returns the borrower's id and the others'."""
    from budgets.admission import keys
    from budgets.admission.bucket_config import pool_bucket_fields
    from budgets.admission.capacity import capacity_signal
    from budgets.models import InferencePool, Reservation
    from tenants.models import Workload

    provider_tpm, provider_rpm = 10_000_000, 1_000_000
    pool = InferencePool(id=pool_id, provider_tpm=provider_tpm, provider_rpm=provider_rpm, headroom=0.8,
                         burst_seconds=15.0, max_concurrency=0)
    reserved = int(0.6 * 0.8 * provider_tpm / (n - 1))
    rpm = max(1, int(0.6 * 0.8 * provider_rpm / (n - 1)))
    reservations = [Reservation(workload=Workload(id=pool_id * 10_000 + 1, workload_class="batch"),
                                reserved_tpm=1_000, ceiling_tpm=provider_tpm, lend_fraction=1.0, rpm=provider_rpm // 10,
                                max_concurrency=0)]
    for i in range(2, n + 1):
        reservations.append(Reservation(workload=Workload(id=pool_id * 10_000 + i, workload_class="interactive"),
                                        reserved_tpm=reserved, ceiling_tpm=reserved, lend_fraction=0.0,
                                        rpm=rpm, max_concurrency=0))
    for r in reservations:
        r.workload_id = r.workload.id
    redis.hset(keys.pool_config(pool_id), mapping=pool_bucket_fields(pool, reservations))
    redis.sadd(keys.pool_workloads(pool_id), *[r.workload_id for r in reservations])
    capacity_signal(pool_id=pool_id, event="recompute")
    ids = [r.workload_id for r in reservations]
    return ids[0], ids[1:]


def _server_us(redis) -> float:
    stats = redis.info("commandstats").get("cmdstat_evalsha") or {}
    return float(stats.get("usec", 0)), int(stats.get("calls", 0))


def _measure(redis, script, keys_for, calls: list[tuple[int, int]], ok_codes: set[int]) -> dict:
    """Run the calls (workload id, tokens) through ``script``; Redis's time and
    the client's per call, and how many answered with a code in ok_codes."""
    redis.config_resetstat()
    hits = 0
    t0 = time.perf_counter()
    for wid, tokens in calls:
        request_id = uuid.uuid4().hex
        raw = script(keys=keys_for(wid, request_id), args=[wid, request_id, 0, tokens, 600_000, *ADMIT_TAIL])
        hits += int(raw[0]) in ok_codes
    client_s = time.perf_counter() - t0
    usec, n = _server_us(redis)
    return {"calls": len(calls), "hits": hits, "server_us": usec / max(1, n), "client_us": client_s * 1e6 / len(calls)}


def _scale_row(redis, n: int, pool_id: int, source: str, keys_count: int, calls_n: int, rng: random.Random) -> dict:
    from budgets.admission import keys
    from budgets.admission.buckets import _lease_keys

    borrower, others = _pool_push(redis, pool_id, n)
    script = redis.register_script(source)

    def keys_for(wid: int, request_id: str) -> list[str]:
        # The last: the request body's held mark (as the chat API passes it; none is set).
        return [keys.pool_config(pool_id), keys.pool_workloads(pool_id),
                *_lease_keys(pool_id=pool_id, workload_id=wid, request_id=request_id),
                keys.held_body(pool_id, wid, request_id)][:keys_count]

    # Every protected bucket part-spent (each fills up at its own time).
    for wid in others:
        script(keys=keys_for(wid, uuid.uuid4().hex), args=[wid, uuid.uuid4().hex, 0, 100, 600_000, *ADMIT_TAIL])
    protected = _measure(redis, script, keys_for, [(rng.choice(others), 50) for _ in range(calls_n)], {1})
    loans = _measure(redis, script, keys_for, [(borrower, 50) for _ in range(calls_n)], {1})
    # Drain the free capacity with loans, then ask for loans that do not fit.
    while int(script(keys=keys_for(borrower, "x"),
                     args=[borrower, uuid.uuid4().hex, 0, 200_000, 600_000, *ADMIT_TAIL])[0]) == 1:
        pass
    refused = _measure(redis, script, keys_for, [(borrower, 150_000) for _ in range(calls_n)], {0})
    return {"workloads": n, "protected": protected, "loan": loans, "refused_loan": refused}


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    rng = random.Random(seed)
    calls_n = 200 if quick else 2_000
    try:
        services.fresh_redis()
        from budgets.admission.buckets import ADMIT

        redis = services.redis
        baseline = _baseline_source()
        rows, baseline_rows = [], []
        for i, n in enumerate(SIZES):
            rows.append(_scale_row(redis, n, 100 + i, ADMIT.source, 11, calls_n, rng))
            log(f"{NAME}: {n} workloads: loan {rows[-1]['loan']['server_us']:.0f} us in Redis")
            if baseline is not None:
                baseline_rows.append(_scale_row(redis, n, 200 + i, baseline, 8, calls_n, rng))
                log(f"{NAME}: {n} workloads, before ({BASELINE_REV}): loan "
                    f"{baseline_rows[-1]['loan']['server_us']:.0f} us in Redis")
    finally:
        if own:
            services.down()
    data = {"scenario": NAME, "seed": seed, "quick": quick, "calls_per_cell": calls_n, "rows": rows,
            "baseline_rev": BASELINE_REV if baseline is not None else None, "baseline_rows": baseline_rows}
    write_result(NAME, data)
    return data


KINDS = (("protected", "paid from its reservation"), ("loan", "loan (needs S)"),
         ("refused_loan", "refused loan (when P - S fits)"))


def summarize(data: dict) -> str:
    rows = data["rows"]
    base = {r["workloads"]: r for r in data.get("baseline_rows") or []}
    first = rows[0]
    table = []
    for r in rows:
        for kind, label in KINDS:
            cell = r[kind]
            before = base.get(r["workloads"], {}).get(kind)
            table.append([f"{r['workloads']:,}", label, fmt(cell["server_us"], 0), fmt(cell["client_us"], 0),
                          fmt(ratio(cell["server_us"], first[kind]["server_us"]), 2),
                          fmt(before["server_us"], 0) if before else "n/a",
                          fmt(ratio(before["server_us"], cell["server_us"]), 1) if before else "n/a",
                          f"{cell['hits']}/{cell['calls']}"])
    worst = max(r[k]["server_us"] for r in rows if r["workloads"] == max(SIZES) for k, _ in KINDS[:2])
    return "\n".join([
        f"{data['calls_per_cell']} calls per cell; µs per budgets/admission/admit.lua call: Redis's own time "
        "(INFO commandstats, the time every other caller of the pool waits) and the client's round trip; ratio "
        "against the 10-workload row of the same run; 'before' = the same script at commit "
        f"{data.get('baseline_rev') or '(git n/a)'} "
        "(a loop over every workload's protected level) on an identical pool in the same run.",
        "",
        md_table(["workloads", "admission", "Redis µs", "round trip µs", "× 10-workload row", "before: Redis µs",
                  "before ÷ now", "admitted (refused for the last kind)"], table),
        "",
        f"Target ≤ {TARGET_US:.0f} µs per admission at 1,000 workloads: worst admitted kind "
        f"**{worst:.0f} µs in Redis**: {'met' if worst <= TARGET_US else 'missed'}.",
    ])


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    return []


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
