"""Scenario 11, burst: N streamed chat completions started at once (N = 256
and 1,024; 32 with ``--quick``), each asking for TOKENS tokens (the
simulator is told to produce exactly that many), against the simulator's
A100 calibration (``--profile a100-llama3-8b``: 256 slots, a 12 ms decode
step; wall clock, no time scale). First straight to the simulator, then
through Sluice on its default settings (no lane size or process count
set), each path on a fresh platform (simulator, and for Sluice web, every
lane worker, beat, the pacer), stopped after it.

The pool row's in-flight limit (``max_concurrency``) is N + 64, so the
admission's limit holds every stream, and the workload's TPM and RPM are
far above what N streams need: what limits the burst is the platform, not
its budgets. The workload keeps the default queue timeout (10 s).

The client is its own process (bench/burst_client.py: asyncio streams, one
connection per stream, only the events that matter parsed), so its CPU does
not share an interpreter with this process, which samples the platform
meanwhile: CPU seconds of each process tree (user + system, from /proc,
from the burst's start to its last ledger row, idle included) and, every
SAMPLE_S, VmRSS of every process and its descendants (the peak of each, and
the peak of their sum at one sample).

Per path and N: streams finished (read to [DONE] without an error) and the
error codes of the rest; time to first token (TTFT, from the burst's start:
the N requests are all sent at once) p50/p99; the last stream's end; tokens
relayed per second (completion tokens of the finished streams' usage over
the time to the last stream's end); CPU of all Sluice processes per 1,000
relayed tokens, with the simulator's own beside it; peak RSS. Through
Sluice, PROBES streamed requests of a second workload over its RPM are sent
meanwhile (from a third process, starting PROBE_AFTER_S into the burst,
PROBE_EVERY_S apart): their answer time and status (429 expected).

Targets: every stream finishes; TTFT p99 ≤ 1.25 × direct; tokens/s ≥
0.85 × direct at 256; at 1,024 no failure and the platform's peak RSS
under 1.5 GB; a refused stream answered in under 50 ms.

Run alone: ``python -m bench.burst --seed 1 [--quick]``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter

from bench.common import OUT_DIR, PLOTS_DIR, ROOT, fmt, log, md_table, pcts, ratio, run_standalone, write_result
from bench.http import HttpClient
from bench.platform import Platform, Services
from bench.procs import CpuMeter, RssPeaks, delta
from bench.seed import config_push, pool_create, workload_create

NAME = "burst"
SIM_ARGS = ["--profile", "a100-llama3-8b"]
TOKENS = 256
SIZES = (256, 1024)
QUICK_SIZES = (32,)
SAMPLE_S = 0.2
PROBES = 5
PROBE_AFTER_S = 1.0
PROBE_EVERY_S = 0.3
CLIENT_TIMEOUT_S = 600
SETTLE_TIMEOUT_S = 60
TARGET_TTFT_P99_RATIO = 1.25
TARGET_TOKENS_RATIO = 0.85
TARGET_RSS_BYTES = 1.5e9
TARGET_REFUSAL_MS = 50.0
# The over-budget workload's RPM: its bucket holds RPM x 15 s / 60 s = one
# request (a smaller one never fits a request: 413 request_too_large), spent
# just before the burst; the next one refills 15 s later, after the probes.
OVER_RPM = 4


def _body(i: int, tokens: int = TOKENS) -> dict:
    return {"model": "sim-small", "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            "sim": {"output_tokens": tokens},
            "messages": [{"role": "user", "content": f"Burst {i}: tell me a long story."}]}


def _client(spec: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.burst_client", json.dumps(spec)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)


def _measure(*, url: str, headers: dict, n: int, sluice: dict[str, int], sim_pid: int, probe: dict | None = None,
             settled=None) -> dict:
    """One burst of ``n`` streams at ``url`` while this process samples the
    ``sluice`` process trees and the simulator; ``probe`` (a workload over
    budget) is sent from a third process meanwhile; ``settled()`` waits for
    the platform's last work after the last stream (its ledger rows)."""
    out = OUT_DIR / f"{NAME}-client.json"
    probe_out = OUT_DIR / f"{NAME}-probe.json"
    for path in (out, probe_out):
        path.unlink(missing_ok=True)
    cpu = CpuMeter({**sluice, "sim": sim_pid})
    rss, sim_rss = RssPeaks(sluice), RssPeaks({"sim": sim_pid})
    at_rest = RssPeaks(sluice)
    at_rest.sample()
    client = _client({"mode": "burst", "url": url, "headers": headers, "body": _body(0), "n": n, "out": str(out)})
    prober = None
    try:
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"burst client did not start (exit {client.wait(timeout=10)})")
        before = cpu.read()
        started = time.monotonic()
        while client.poll() is None:
            rss.sample()
            sim_rss.sample()
            if probe is not None and prober is None and time.monotonic() - started >= PROBE_AFTER_S:
                prober = _client({"mode": "probe", "n": PROBES, "every_s": PROBE_EVERY_S, "out": str(probe_out),
                                  **probe})
            if time.monotonic() - started > CLIENT_TIMEOUT_S:
                raise TimeoutError(f"burst of {n} streams not over in {CLIENT_TIMEOUT_S} s")
            time.sleep(SAMPLE_S)  # the sampling period, not a wait for another process
        if client.returncode:
            raise RuntimeError(f"burst client failed (exit {client.returncode})")
        streams = json.loads(out.read_text())
        if settled is not None:
            settled(streams, sample=lambda: (rss.sample(), sim_rss.sample()))
        after = cpu.read()
        busy_s = time.monotonic() - started
        probes = []
        if prober is not None:
            prober.wait(timeout=60)
            probes = json.loads(probe_out.read_text()) if probe_out.exists() else []
    finally:
        for process in (client, prober):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    used = delta(after, before)
    stats = _stats(streams)
    tokens = stats["tokens"]
    sluice_cpu = sum(v for k, v in used.items() if k != "sim")
    return {**stats, "n": n, "cpu_s": used, "measured_s": busy_s,
            "sluice_cpu_s": sluice_cpu if sluice else None,
            "sluice_ms_per_1k_tokens": 1e6 * sluice_cpu / tokens if sluice and tokens else None,
            "sim_ms_per_1k_tokens": 1e6 * used["sim"] / tokens if tokens else None,
            "rss_peak_bytes": rss.peak, "rss_peak_total_bytes": rss.peak_total if sluice else None,
            "rss_sum_of_peaks_bytes": sum(rss.peak.values()) if sluice else None,
            "rss_at_rest_bytes": at_rest.peak_total if sluice else None,
            "sim_rss_peak_bytes": sim_rss.peak["sim"], "rss_samples": rss.samples,
            "probes": [{"status": p["status"], "code": p["code"], "answer_ms": 1000 * p["answer_s"]} for p in probes]}


def _stats(streams: list[dict]) -> dict:
    finished = [s for s in streams if s["status"] == 200 and not s["code"]]
    codes = Counter(s["code"] or f"http_{s['status']}" for s in streams if s not in finished)
    ends = [s["end_s"] for s in streams if s["end_s"] is not None]
    burst_s = max(ends) if ends else None
    tokens = sum(s["tokens"] for s in finished)
    ttft = [1000 * s["first_s"] for s in finished if s["first_s"] is not None]
    return {"finished": len(finished), "errors": dict(codes), "tokens": tokens,
            "short_of_tokens": sum(1 for s in finished if s["tokens"] != TOKENS),
            "ttft_ms": pcts(ttft), "ttft_all": [round(t, 2) for t in ttft],
            "last_end_s": max((s["end_s"] for s in finished), default=None), "burst_s": burst_s,
            "tokens_per_s": tokens / burst_s if burst_s else None}


def _sim_pid(platform: Platform) -> int:
    return next(c.popen.pid for c in platform.children if c.name == "sim")


def _direct(services: Services, n: int, seed: int) -> dict:
    platform = Platform(services, f"{NAME}-{n}-direct")
    try:
        platform.start_sim(["--seed", str(seed), *SIM_ARGS])
        result = _measure(url=f"{platform.sim_url}/v1/chat/completions", headers={}, n=n, sluice={},
                          sim_pid=_sim_pid(platform))
        platform.assert_alive()
    finally:
        platform.stop()
    return result


def _spend(url: str, auth: dict, count: int) -> list[int]:
    """``count`` small requests of a workload, one after another: its statuses."""
    async def run() -> list[int]:
        client = HttpClient(url, max_connections=1)
        try:
            body = {"model": "sim-small", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}
            return [(await client.post("/v1/chat/completions", body, auth)).status for _ in range(count)]
        finally:
            await client.aclose()

    return asyncio.run(run())


def _through_sluice(services: Services, n: int, seed: int) -> dict:
    from budgets.models import UsageRecord

    services.fresh_redis()
    platform = Platform(services, f"{NAME}-{n}-sluice")
    try:
        platform.start_sim(["--seed", str(seed), *SIM_ARGS])
        pool = pool_create(slug=f"{NAME}-{n}-pool", base_url=f"{platform.sim_url}/v1", provider_tpm=500_000_000,
                           provider_rpm=10_000_000, max_concurrency=n + 64)
        chat = workload_create(pool=pool, slug=f"{NAME}-{n}-chat", workload_class="interactive",
                               reserved_tpm=200_000_000, ceiling_tpm=300_000_000, rpm=5_000_000,
                               prompt_tokens_cap=2_000, max_tokens_cap=TOKENS, max_tokens_default=TOKENS)
        over = workload_create(pool=pool, slug=f"{NAME}-{n}-over", workload_class="interactive", reserved_tpm=1_000,
                               ceiling_tpm=1_000, rpm=OVER_RPM, prompt_tokens_cap=100, max_tokens_cap=16,
                               max_tokens_default=16)
        config_push(pool)
        platform.start_sluice()
        log(f"{NAME}: N={n}: Sluice up (default settings, lanes {platform.lane_sizes})")
        over_auth = {"Authorization": f"Bearer {over.api_key}"}
        spent = _spend(platform.sluice_url, over_auth, 2)  # its one request of burst, then a refusal
        sluice = {c.name: c.popen.pid for c in platform.children if c.name != "sim"}
        if services.redis_process is not None:
            sluice["redis"] = services.redis_process.popen.pid

        def settled(streams: list[dict], sample) -> None:
            """Every admitted stream's ledger row written (or the deadline)."""
            admitted = sum(1 for s in streams if s["status"] == 200) + spent.count(200)
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while UsageRecord.objects.filter(pool_id=pool.id).count() < admitted and time.monotonic() < deadline:
                sample()
                time.sleep(SAMPLE_S)  # polling the ledger with a deadline

        result = _measure(url=f"{platform.sluice_url}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {chat.api_key}"}, n=n, sluice=sluice,
                          sim_pid=_sim_pid(platform), settled=settled,
                          probe={"url": f"{platform.sluice_url}/v1/chat/completions", "headers": over_auth,
                                 "body": _body(0, 16)})
        result["spent_statuses"] = spent
        result["lane_sizes"] = platform.lane_sizes
        result["ledger_rows"] = UsageRecord.objects.filter(pool_id=pool.id).count()
        result["ledger_statuses"] = dict(Counter(UsageRecord.objects.filter(pool_id=pool.id)
                                                 .values_list("status", flat=True)))
        platform.assert_alive()
    finally:
        platform.stop()
    return result


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    sizes = QUICK_SIZES if quick else SIZES
    runs: dict[str, dict] = {}
    try:
        for n in sizes:
            direct = _direct(services, n, seed)
            log(f"{NAME}: N={n} direct: {direct['finished']} finished, TTFT p99 {fmt(direct['ttft_ms']['p99'])} ms, "
                f"{fmt(direct['tokens_per_s'])} tokens/s")
            sluice = _through_sluice(services, n, seed)
            log(f"{NAME}: N={n} Sluice: {sluice['finished']} finished, errors {sluice['errors']}, TTFT p99 "
                f"{fmt(sluice['ttft_ms']['p99'])} ms, {fmt(sluice['tokens_per_s'])} tokens/s, peak RSS "
                f"{fmt(sluice['rss_peak_total_bytes'] / 2**20)} MiB")
            runs[str(n)] = {"direct": direct, "sluice": sluice}
    finally:
        if own:
            services.down()
    data = {"scenario": NAME, "seed": seed, "quick": quick, "sizes": list(sizes), "tokens": TOKENS,
            "sim_args": SIM_ARGS, "clock": "wall clock (simulator without time scale)", "runs": runs}
    write_result(NAME, data)
    return data


def targets(data: dict) -> list[dict]:
    """Each target: what, the measured value, the target, met or not. The
    throughput target is read at the smallest N of the run, the no-failure
    and memory ones at the largest."""
    runs = data["runs"]
    sizes = [str(n) for n in data["sizes"]]
    small, large = runs[sizes[0]], runs[sizes[-1]]
    out = []
    for n in sizes:
        s = runs[n]["sluice"]
        out.append({"what": f"streams finished through Sluice, N={n}", "value": f"{s['finished']} / {s['n']}",
                    "target": "all", "met": s["finished"] == s["n"]})
    for n in sizes:
        # Over the streams that finished: where some failed, the survivors'
        # p99 says little (they are the ones that got a worker early), so
        # the target is met only when every stream finished.
        s = runs[n]["sluice"]
        r = ratio(s["ttft_ms"]["p99"], runs[n]["direct"]["ttft_ms"]["p99"])
        out.append({"what": f"TTFT p99 / direct, N={n}",
                    "value": fmt(r, 2) + ("" if s["finished"] == s["n"] else f" (of the {s['finished']} finished)"),
                    "target": f"≤ {TARGET_TTFT_P99_RATIO}",
                    "met": r is not None and r <= TARGET_TTFT_P99_RATIO and s["finished"] == s["n"]})
    r = ratio(small["sluice"]["tokens_per_s"], small["direct"]["tokens_per_s"])
    out.append({"what": f"tokens/s / direct, N={sizes[0]}", "value": fmt(r, 2), "target": f"≥ {TARGET_TOKENS_RATIO}",
                "met": r is not None and r >= TARGET_TOKENS_RATIO})
    s = large["sluice"]
    failures = s["n"] - s["finished"]
    out.append({"what": f"failures through Sluice, N={sizes[-1]}", "value": str(failures), "target": "0",
                "met": failures == 0})
    peak = s["rss_peak_total_bytes"] or 0
    out.append({"what": f"platform peak RSS, N={sizes[-1]}", "value": f"{peak / 2**20:,.0f} MiB",
                "target": f"< {TARGET_RSS_BYTES / 1e9:g} GB", "met": peak < TARGET_RSS_BYTES})
    probes = [p for n in sizes for p in runs[n]["sluice"]["probes"]]
    # A probe the workload's bucket had refilled for (its one request per
    # 60 / OVER_RPM s, when the machine delayed the probes that long) is
    # admitted and streams behind the burst: not a refusal, listed apart.
    refused = [p for p in probes if p["status"] == 429]
    admitted = len(probes) - len(refused)
    worst = max((p["answer_ms"] for p in refused), default=None)
    out.append({"what": "refused stream answered (slowest refusal of the probes), ms"
                        + (f"; {admitted} probe(s) admitted on a refilled bucket" if admitted else ""),
                "value": fmt(worst, 1), "target": f"< {TARGET_REFUSAL_MS:g} ms, 429",
                "met": len(refused) >= PROBES and worst < TARGET_REFUSAL_MS})
    return out


def summarize(data: dict) -> str:
    def mib(value) -> str:
        return "" if value is None else f"{value / 2**20:,.0f}"

    rows = []
    for n in map(str, data["sizes"]):
        for path, label in (("direct", "direct to simulator"), ("sluice", "through Sluice")):
            r = data["runs"][n][path]
            errors = ", ".join(f"{code} {count}" for code, count in sorted(r["errors"].items())) or "none"
            rows.append([n, label, f"{r['finished']} / {r['n']}", errors, fmt(r["ttft_ms"]["p50"]),
                         fmt(r["ttft_ms"]["p99"]), fmt(r["last_end_s"], 1), fmt(r["tokens_per_s"]),
                         fmt(r["sluice_ms_per_1k_tokens"], 1) if path == "sluice" else "",
                         fmt(r["sim_ms_per_1k_tokens"], 1), mib(r["rss_peak_total_bytes"]),
                         mib(r["sim_rss_peak_bytes"])])
    lines = [
        f"N streams started at once, {data['tokens']} tokens each, simulator `{' '.join(data['sim_args'])}` on "
        "the wall clock; Sluice on its default settings, the pool's in-flight limit N + 64, budgets to spare; "
        "a fresh platform per path. TTFT and ends are from the burst's start; tokens/s = completion tokens of "
        "the finished streams / time to the last stream's end; CPU from the burst's start to the last ledger "
        "row, idle included; RSS sampled every "
        f"{SAMPLE_S} s over every process and its descendants.",
        "",
        md_table(["N", "path", "finished", "errors", "TTFT p50 ms", "TTFT p99 ms", "last end s", "tokens/s",
                  "Sluice ms CPU / 1k tokens", "simulator ms CPU / 1k tokens", "Sluice peak RSS MiB",
                  "simulator peak RSS MiB"], rows),
        "",
        md_table(["target", "measured", "target", "verdict"],
                 [[t["what"], f"**{t['value']}**", t["target"], "met" if t["met"] else "missed"]
                  for t in targets(data)]),
    ]
    for n in map(str, data["sizes"]):
        s = data["runs"][n]["sluice"]
        lines += ["", f"N={n} through Sluice (lanes {s.get('lane_sizes')}): peak RSS per process tree, MiB: "
                  + ", ".join(f"{name} {mib(v)}" for name, v in sorted(s["rss_peak_bytes"].items()))
                  + f"; their sum {mib(s['rss_sum_of_peaks_bytes'])}, the peak of the total "
                  f"{mib(s['rss_peak_total_bytes'])} (at rest before the burst {mib(s['rss_at_rest_bytes'])}). "
                  "CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["cpu_s"].items()) if v >= 0.05)
                  + f". Refused probes: "
                  + (", ".join(f"{p['status']} {p['code']} in {p['answer_ms']:.1f} ms" for p in s["probes"])
                     or "none came back")
                  + f". Ledger: {s['ledger_rows']} rows, {s['ledger_statuses']}."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import cdf_plot

    series = {}
    for n in map(str, data["sizes"]):
        series[f"N={n} direct"] = data["runs"][n]["direct"]["ttft_all"]
        series[f"N={n} through Sluice"] = data["runs"][n]["sluice"]["ttft_all"]
    path = plots_dir / "burst_ttft_cdf.png"
    cdf_plot(series, path, title="Time to first token, N streams started at once",
             xlabel="TTFT from the burst's start, wall-clock ms", log_x=True)
    return [path.name]


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
