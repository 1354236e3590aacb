"""Scenario 1, mixed short and long (the classic tail-latency case).

10 closed-loop clients send the same seeded stream to each system: 80% short
(a one-sentence question, max_tokens 64) and 20% long (a ~4,000-token
document to summarize, max_tokens 512). The simulated pool batches up to 16
sequences in a 16,384-token KV cache: three long prompts fill it, and a
fourth at the head of its FIFO waiting queue blocks every short request
behind it until a long one finishes (vLLM's scheduler without preemption).

Systems, one after the other on a fresh simulator:
* idle: the same clients sending only the short requests straight to the
  simulator (the short p99 a pool without long work gives);
* FIFO: clients straight to the simulator;
* baseline: bench/baseline_gateway.py (one priority queue, 2 workers, 5 s
  queue timeout, max_tokens clamped to 1,024);
* Sluice with its default settings (16 interactive-long workers): how many
  long requests are in a pool call at once is the adaptive lane limit
  (gateway/core/protection/concurrency.py), learned from the short requests' latency;
* Sluice with its default settings, its short requests streamed (the same
  seeded stream, ``stream: true`` with usage): reported beside the targets,
  with each short request's time to first token;
* Sluice, default settings, against a second pool profile: a bigger GPU
  (a 49,152-token KV cache, about ten long prompts, and prefill three times
  as fast, 0.03 ms a prompt token), to show the limit finds another level
  by itself. A bigger KV cache alone is not a different pool for this
  signal: each long prompt's 400 ms prefill stalls every decode step, so
  the short requests' latency bounds the long concurrency near the same
  level (3.2 vs 3.5 at ea35700).

Latencies are simulated seconds (wall clock x time scale). Run alone:
``python -m bench.mixed --seed 1``."""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, pcts, ratio, run_standalone, write_result
from bench.http import HttpClient
from bench.load import Call, Sampler, calls_to_json, closed_loop, lane_depths, timed_post, timed_stream
from bench.platform import Platform, Services
from bench.seed import config_push, scaled_pool, scaled_workload
from bench.workload import mixed_stream
from gateway.core.keys import lane_limits as lane_limits_key
from gateway.core.keys import lane_slots as lane_slots_key

NAME = "mixed"
SCALE = TimeScale(6.0)
CLIENTS = 10
SIM_ARGS = ["--slots", "16", "--kv-cache-tokens", "16384"]
LARGE_KV_SIM_ARGS = ["--slots", "16", "--kv-cache-tokens", "49152", "--prefill-ms-per-token", "0.03"]
WARMUP_SIM_S = 20.0
SYSTEMS = ("idle", "fifo", "baseline", "sluice", "sluice_stream", "sluice_large_kv")
LABELS = {"idle": "idle pool (short only, direct)", "fifo": "FIFO (direct)", "baseline": "priority baseline",
          "sluice": "Sluice (default settings)",
          "sluice_stream": "Sluice (default settings), short requests streamed",
          "sluice_large_kv": "Sluice (default settings), bigger pool (3x KV, 3x prefill)"}
LIMITED_LANE = "interactive-long"


async def _drive(base: str, path: str, headers: dict, seed: int, duration_real: float, probe,
                 long_fraction: float = 0.2, stream_short: bool = False) -> tuple[list[Call], list[dict], float]:
    client = HttpClient(base, max_connections=CLIENTS + 2, timeout=600)
    streamer = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=CLIENTS + 2))
    streams = [mixed_stream(seed, c, 5_000, long_fraction=long_fraction) for c in range(CLIENTS)]
    calls: list[Call] = []
    t0 = time.monotonic()
    sampler = Sampler(probe, 0.25, t0).start()

    async def step(c: int, i: int) -> None:
        call = streams[c][i]
        if stream_short and call.kind == "short":
            calls.append(await timed_stream(streamer, base + path, call.body, headers, call.kind, t0))
        else:
            calls.append(await timed_post(client, path, call.body, headers, call.kind, t0))

    await closed_loop(CLIENTS, duration_real, step, max_per_client=5_000)
    elapsed = time.monotonic() - t0
    samples = await sampler.stop()
    await client.aclose()
    await streamer.aclose()
    return calls, samples, elapsed


def _run_system(services: Services, system: str, seed: int, duration_sim: float) -> dict:
    services.fresh_redis()
    sim_args = LARGE_KV_SIM_ARGS if system == "sluice_large_kv" else SIM_ARGS
    seed_args = ["--time-scale", str(SCALE.factor), "--seed", str(seed), *sim_args]
    with Platform(services, f"{NAME}-{system}") as platform:
        platform.start_sim(seed_args)
        sim = HttpClient(platform.sim_url, max_connections=2)
        headers: dict[str, str] = {}
        pool = None
        if system in ("fifo", "idle"):
            base, path = platform.sim_url, "/v1/chat/completions"
        elif system == "baseline":
            platform.start_baseline(time_scale=SCALE.factor)
            base, path = platform.baseline_url, "/v1/chat/completions"
            gateway = HttpClient(platform.baseline_url, max_connections=2)
        else:
            pool = scaled_pool(scale=SCALE, slug=f"{NAME}-{system}", base_url=f"{platform.sim_url}/v1",
                               provider_tpm=5_000_000, provider_rpm=20_000)
            workload = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-{system}-chat",
                                       workload_class="interactive", reserved_tpm=3_000_000, ceiling_tpm=3_000_000,
                                       rpm=10_000, queue_timeout_s=180.0, prompt_tokens_cap=8_000,
                                       max_tokens_cap=1_024, max_tokens_default=256)
            config_push(pool)
            platform.start_sluice()
            headers = {"Authorization": f"Bearer {workload.api_key}"}
            base, path = platform.sluice_url, "/v1/chat/completions"

        async def probe() -> dict:
            stats = (await sim.get("/admin/stats")).json()
            sample = {"sim_running": stats["running"], "sim_queued": stats["queued"],
                      "sim_kv": stats["kv_tokens_in_use"]}
            if system.startswith("sluice"):
                sample["lanes"] = lane_depths(services.redis)
                sample["long_limit"] = float(services.redis.hget(lane_limits_key(pool.id), f"{LIMITED_LANE}.limit")
                                             or 0) or None
                sample["long_in_call"] = services.redis.zcard(lane_slots_key(pool.id, LIMITED_LANE))
            elif system == "baseline":
                sample["gateway_queue"] = (await gateway.get("/healthz")).json()["queue_depth"]
            return sample

        log(f"{NAME}: {LABELS[system]} for {duration_sim:.0f} simulated s ({SCALE.real_s(duration_sim):.0f} s real)")
        calls, samples, elapsed = asyncio.run(_drive(base, path, headers, seed, SCALE.real_s(duration_sim), probe,
                                                     long_fraction=0.0 if system == "idle" else 0.2,
                                                     stream_short=system == "sluice_stream"))
        platform.assert_alive()
        lane_sizes = getattr(platform, "lane_sizes", None)
    return {"calls": calls_to_json(calls), "samples": samples, "elapsed_real_s": elapsed, "lane_sizes": lane_sizes,
            "sim_args": sim_args}


def _metrics(run: dict) -> dict:
    f = SCALE.factor
    measured = [c for c in run["calls"] if c["start"] * f >= WARMUP_SIM_S]
    window_sim = run["elapsed_real_s"] * f - WARMUP_SIM_S
    out = {"window_sim_s": window_sim}
    for kind in ("short", "long"):
        of_kind = [c for c in measured if c["kind"] == kind]
        ok = [c for c in of_kind if c["status"] == 200]
        out[kind] = {**pcts([c["latency"] * f for c in ok]), "sent": len(of_kind), "ok": len(ok),
                     "error_rate": (len(of_kind) - len(ok)) / len(of_kind) if of_kind else None,
                     "errors": _codes(of_kind)}
    ok = [c for c in measured if c["status"] == 200]
    # Streamed calls: time to the first content chunk (simulated s).
    ttft = [c["extra"]["ttft"] * f for c in measured
            if c["status"] == 200 and c["kind"] == "short" and "ttft" in c.get("extra", {})]
    out["short_ttft"] = pcts(ttft) if ttft else None
    out["throughput_rps"] = len(ok) / window_sim
    out["long_output_tokens_per_s"] = sum((c["usage"] or {}).get("completion_tokens", 0) for c in ok
                                          if c["kind"] == "long") / window_sim
    limits = sorted(s["long_limit"] for s in run["samples"]
                    if s.get("long_limit") and s["t"] * f >= WARMUP_SIM_S)
    out["long_limit"] = ({"median": limits[len(limits) // 2], "min": limits[0], "max": limits[-1]}
                         if limits else None)
    out["output_tokens_per_s"] = sum((c["usage"] or {}).get("completion_tokens", 0) for c in ok) / window_sim
    out["error_rate"] = (len(measured) - len(ok)) / len(measured) if measured else None
    out["lane_wait_sim_s"] = {k: pcts([int(c["headers"]["x-sluice-queue-ms"]) / 1000 * f for c in measured
                                       if c["status"] == 200 and c["kind"] == k and "x-sluice-queue-ms" in c["headers"]])
                              for k in ("short", "long")}
    return out


def _slow_short(run: dict, *, over_s: float) -> dict:
    """Where the short requests slower than ``over_s`` (simulated) spent
    their time, medians: in the worker (the gateway's total less the lane
    wait: the pool call and the worker's own steps), in the lane, and the
    simulator's own waiting queue in the sample nearest their start."""
    f = SCALE.factor
    slow = [c for c in run["calls"] if c["kind"] == "short" and c["status"] == 200 and c["start"] * f >= WARMUP_SIM_S
            and c["latency"] * f > over_s and "x-sluice-total-ms" in c["headers"]]
    if not slow:
        return {"n": 0, "over_s": over_s}
    samples = run["samples"]

    def queued_at(t: float) -> float:
        return min(samples, key=lambda s: abs(s["t"] - t)).get("sim_queued") or 0 if samples else 0

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    lane_wait = [int(c["headers"].get("x-sluice-queue-ms", 0)) / 1000 * f for c in slow]
    pool = [int(c["headers"]["x-sluice-total-ms"]) / 1000 * f - w for c, w in zip(slow, lane_wait)]
    return {"n": len(slow), "over_s": over_s, "latency_s": median([c["latency"] * f for c in slow]),
            "pool_s": median(pool), "lane_wait_s": median(lane_wait),
            "sim_queued": median([queued_at(c["start"]) for c in slow])}


def _codes(calls: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        if c["status"] != 200:
            out[c["code"] or f"http_{c['status']}"] = out.get(c["code"] or f"http_{c['status']}", 0) + 1
    return out


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    duration_sim = 30.0 if quick else 300.0
    runs = {}
    try:
        for system in SYSTEMS:
            runs[system] = _run_system(services, system, seed, duration_sim)
            m = _metrics(runs[system])
            log(f"{NAME}: {LABELS[system]}: short p99 {fmt(m['short']['p99'], 2)} s, long p99 "
                f"{fmt(m['long']['p99'], 1)} s, {m['throughput_rps']:.2f} req/s, errors {m['error_rate']:.1%}")
    finally:
        if own:
            services.down()
    metrics = {system: _metrics(run) for system, run in runs.items()}
    if "sluice" in runs and metrics.get("idle", {}).get("short", {}).get("p99"):
        metrics["sluice"]["slow_short"] = _slow_short(runs["sluice"], over_s=1.5 * metrics["idle"]["short"]["p99"])
    data = {"scenario": NAME, "seed": seed, "quick": quick, "time_scale": SCALE.factor, "clients": CLIENTS,
            "sim_args": SIM_ARGS, "large_kv_sim_args": LARGE_KV_SIM_ARGS, "duration_sim_s": duration_sim,
            "warmup_sim_s": WARMUP_SIM_S, "metrics": metrics, "runs": runs,
            "clock": "simulated seconds (wall clock x time scale)"}
    write_result(NAME, data)
    return data


def _long_failed_for_queueing(m: dict, system: str) -> int:
    """Long requests the system failed for waiting (its own timeouts or
    refusals for being busy), where FIFO failed none."""
    errors = m[system]["long"]["errors"] or {}
    return sum(n for code, n in errors.items() if "timeout" in code or "saturated" in code or "queue" in code)


def _slots_text(limit: dict | None) -> str:
    """A learned limit as the slots it grants (its whole part), median (min–max)."""
    if not limit:
        return "—"
    return f"{math.floor(limit['median'])} ({math.floor(limit['min'])}–{math.floor(limit['max'])})"


def _verdict(value: float | None, ok) -> str:
    return "n/a" if value is None else ("met" if ok(value) else "missed")


def _stream_rows(m: dict) -> list[list[str]]:
    """The run whose short requests stream: reported beside the targets
    (which are set on the non-streamed run), against the same references."""
    streamed = m.get("sluice_stream")
    if not streamed:
        return []
    idle_p99 = m.get("idle", {}).get("short", {}).get("p99")
    p99_fifo = ratio(streamed["short"]["p99"], m["fifo"]["short"]["p99"])
    p99_idle = ratio(streamed["short"]["p99"], idle_p99)
    goodput = ratio(streamed.get("long_output_tokens_per_s"), m["fifo"].get("long_output_tokens_per_s"))
    ttft = streamed.get("short_ttft") or {}
    return [
        ["short requests streamed: short p99 (to the stream's end) / FIFO; / idle pool; long goodput / FIFO",
         f"{fmt(p99_fifo, 2)}; {fmt(p99_idle, 2)}; {fmt(goodput, 2)}",
         f"(reported; the same bounds: {_verdict(p99_fifo, lambda v: v <= 0.25)}, "
         f"{_verdict(p99_idle, lambda v: v <= 1.5)}, {_verdict(goodput, lambda v: v >= 0.9)})"],
        ["short requests streamed: time to first token p50 / p99 (simulated s)",
         f"{fmt(ttft.get('p50'), 2)} / {fmt(ttft.get('p99'), 2)}", ""],
    ]


def summarize(data: dict) -> str:
    m = data["metrics"]
    rows = []
    for system in SYSTEMS:
        if system not in m:
            continue
        s, lg = m[system]["short"], m[system]["long"]
        limit = m[system].get("long_limit")
        rows.append([LABELS[system], fmt(s["p50"], 2), fmt(s["p95"], 2), fmt(s["p99"], 2), fmt(lg["p50"], 1),
                     fmt(lg["p95"], 1), fmt(lg["p99"], 1), fmt(m[system]["throughput_rps"], 2),
                     fmt(m[system]["output_tokens_per_s"], 0), fmt(m[system].get("long_output_tokens_per_s"), 0),
                     f"{s['error_rate'] or 0:.1%}", f"{lg['error_rate'] or 0:.1%}",
                     _slots_text(limit)])
    fifo = m["fifo"]
    p99_ratio = ratio(m["sluice"]["short"]["p99"], fifo["short"]["p99"])
    idle_ratio = ratio(m["sluice"]["short"]["p99"], m.get("idle", {}).get("short", {}).get("p99"))
    long_goodput = ratio(m["sluice"].get("long_output_tokens_per_s"), fifo.get("long_output_tokens_per_s"))
    tput_ratio = ratio(m["sluice"]["output_tokens_per_s"], fifo["output_tokens_per_s"])
    long_p99_ratio = ratio(m["sluice"]["long"]["p99"], fifo["long"]["p99"])
    queue_failed = _long_failed_for_queueing(m, "sluice")
    base_ratio = ratio(m["baseline"]["short"]["p99"], fifo["short"]["p99"])
    base_tput = ratio(m["baseline"]["output_tokens_per_s"], fifo["output_tokens_per_s"])
    small, large = m["sluice"].get("long_limit"), m.get("sluice_large_kv", {}).get("long_limit")
    lines = [
        f"{data['clients']} closed-loop clients, {data['duration_sim_s']:.0f} simulated s per system (first "
        f"{data['warmup_sim_s']:.0f} s not counted), time scale {data['time_scale']:g}; simulator "
        f"`{' '.join(data['sim_args'])}` (the bigger pool: `{' '.join(data.get('large_kv_sim_args', []))}`). "
        "Sluice runs with its default settings: the interactive-long lane's threads sized by the pool, lane limit starting at "
        "SLUICE_LANE_LIMIT_INITIAL and learned from there. Latencies in simulated seconds; throughput = completed "
        "requests (and output tokens) per simulated second. Long slots = how many interactive-long calls the lane's "
        "learned concurrency limit lets into the pool at once (the limit's whole part: a limit of 3.999 is 3 "
        "slots), median (min–max) of the samples after warm-up.",
        "",
        md_table(["system", "short p50", "short p95", "short p99", "long p50", "long p95", "long p99", "req/s",
                  "out tok/s", "long out tok/s", "short err", "long err", "long slots"], rows),
        "",
        md_table(["ratio", "value", "target"], [
            ["Sluice short p99 / FIFO short p99", f"**{fmt(p99_ratio, 2)}**",
             f"≤ 0.25: {_verdict(p99_ratio, lambda v: v <= 0.25)}"],
            ["Sluice short p99 / idle pool short p99", f"**{fmt(idle_ratio, 2)}**",
             f"≤ 1.5: {_verdict(idle_ratio, lambda v: v <= 1.5)}"],
            ["Sluice long goodput / FIFO (long output tokens of completed requests per s)",
             f"**{fmt(long_goodput, 2)}**", f"≥ 0.9: {_verdict(long_goodput, lambda v: v >= 0.9)}"],
            ["Sluice long p99 / FIFO long p99", f"**{fmt(long_p99_ratio, 2)}**",
             f"≤ 1.5: {_verdict(long_p99_ratio, lambda v: v <= 1.5)}"],
            ["long requests Sluice failed for queueing", f"**{queue_failed}**",
             f"0: {'met' if queue_failed == 0 else 'missed'}"],
            ["Sluice throughput / FIFO (all output tokens)", fmt(tput_ratio, 2), ""],
            ["baseline short p99 / FIFO short p99", fmt(base_ratio, 2), ""],
            ["baseline throughput (tokens) / FIFO", fmt(base_tput, 2), ""],
            ["learned long slots: the scenario's pool / the bigger pool (3x KV cache, 3x prefill speed)",
             f"{_slots_text(small)} / {_slots_text(large)}",
             "a different level, found without a setting"],
            *_stream_rows(m),
        ]),
        "",
        "Where Sluice's time goes (simulated s, lane wait = x-sluice-queue-ms; the wait for a lane slot comes "
        "after it, inside the worker): short p50/p99 "
        f"{fmt(m['sluice']['lane_wait_sim_s']['short']['p50'], 2)}/{fmt(m['sluice']['lane_wait_sim_s']['short']['p99'], 2)}, "
        f"long p50/p99 {fmt(m['sluice']['lane_wait_sim_s']['long']['p50'], 1)}/"
        f"{fmt(m['sluice']['lane_wait_sim_s']['long']['p99'], 1)}. Errors: "
        + "; ".join(f"{LABELS[s]} {m[s]['short']['errors'] or {}} / {m[s]['long']['errors'] or {}}"
                    for s in SYSTEMS if s in m) + ".",
    ]
    misses = []
    if p99_ratio is not None and p99_ratio > 0.25 or idle_ratio is not None and idle_ratio > 1.5:
        overhead = (m["sluice"]["short"]["p50"] or 0) - (m.get("idle", {}).get("short", {}).get("p50") or 0)
        slow = m["sluice"].get("slow_short") or {}
        where = ""
        if slow.get("n"):
            where = (f"; the {slow['n']} short requests above 1.5x the idle p99 ({fmt(slow['over_s'], 2)} s) spent a "
                     f"median {fmt(slow['pool_s'], 2)} s of their {fmt(slow['latency_s'], 2)} s in the worker (its pool call and "
                     f"its own steps; lane wait {fmt(slow['lane_wait_s'], 2)} s, the pool's waiting queue "
                     f"{fmt(slow['sim_queued'], 0)} requests when they started): slowed while the pool served them, "
                     "beside the long requests in its batch (their prefill, the longer decode step of a fuller "
                     "batch), not waiting in Sluice or in the pool's queue")
        misses.append(
            f"short p99 {fmt(m['sluice']['short']['p99'], 2)} s against {fmt(fifo['short']['p99'], 2)} s FIFO and "
            f"{fmt(m.get('idle', {}).get('short', {}).get('p99'), 2)} s on the idle pool, at {_slots_text(small)} "
            f"long slots{where}; the gateway adds {fmt(overhead, 2)} s at the median (Sluice short p50 minus the "
            "idle pool's: its real overhead times the time scale)")
    if long_goodput is not None and long_goodput < 0.9:
        misses.append(f"long goodput {fmt(long_goodput, 2)} of FIFO's: the limit holds long requests back while "
                      "short ones are slow")
    if misses:
        lines += ["", "Why a target is missed: " + "; ".join(misses) + "."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import multi_cdf, timeseries

    f = data["time_scale"]
    warm = data["warmup_sim_s"]
    panels = {}
    for kind in ("short", "long"):
        panels[f"{kind} requests"] = {
            LABELS[s]: [c["latency"] * f for c in run["calls"]
                        if c["kind"] == kind and c["status"] == 200 and c["start"] * f >= warm]
            for s, run in data["runs"].items()}
    names = []
    path = plots_dir / "mixed_latency_cdf.png"
    multi_cdf(panels, path, title="Mixed short/long: latency CDF per class", xlabel="latency, simulated s")
    names.append(path.name)
    # Queue depth: Sluice's lanes and the pool's own waiting queue, per system.
    lines = {}
    for system, run in data["runs"].items():
        samples = [s for s in run["samples"] if "error" not in s]
        ts = [s["t"] * f for s in samples]
        lines[f"{LABELS[system]}: pool waiting queue"] = (ts, [s["sim_queued"] for s in samples])
        if system == "sluice":
            for lane in ("interactive", "interactive-long"):
                lines[f"Sluice lane {lane}"] = (ts, [s["lanes"].get(lane, 0) for s in samples])
        if system.startswith("sluice"):
            lines[f"{LABELS[system]}: long limit"] = (ts, [s.get("long_limit") or 0 for s in samples])
        if system == "baseline":
            lines["baseline gateway queue"] = (ts, [s["gateway_queue"] for s in samples])
    path = plots_dir / "mixed_queue_depth.png"
    timeseries(lines, path, title="Mixed short/long: queue depth (requests waiting)", xlabel="simulated s",
               ylabel="requests waiting", step=True)
    names.append(path.name)
    return names


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
