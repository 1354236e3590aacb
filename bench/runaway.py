"""Scenario 2, runaway batch (the bulkhead).

An interactive chat workload (reserved 40k TPM, strictly protected: lend 0)
sends short questions at 50% of its reservation, first alone, then while a
batch workload (reserved 20k, ceiling 40k TPM) re-summarizes 50,000
documents, offering 50x its reservation. One timeline: chat alone for the
first phase, chat + batch for the second.

Reported: chat p50/p95/p99 alone and under the flood (simulated seconds),
chat rejections by reason, the batch workload's admitted tokens in every
sliding 60 s window against its ceiling (from the ledger), queue depth per
lane. Rates are per simulated minute, times in simulated seconds. Run alone:
``python -m bench.runaway --seed 1``."""

from __future__ import annotations

import asyncio
import random
import time

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, pcts, ratio, run_standalone, write_result
from bench.http import HttpClient
from bench.load import Call, Sampler, calls_to_json, lane_depths, open_loop, timed_post
from bench.platform import Platform, Services
from bench.seed import config_push, ledger_rows, scaled_pool, scaled_workload
from bench.windows import sliding_max, sliding_series
from bench.workload import long_call, short_call

NAME = "runaway"
SCALE = TimeScale(4.0)
POOL_TPM, POOL_RPM = 120_000, 3_000
CHAT = dict(reserved_tpm=40_000, ceiling_tpm=40_000, rpm=1_000)
BATCH = dict(reserved_tpm=20_000, ceiling_tpm=40_000, rpm=600)
BURST_SIM_S = 15.0
DOC_PROMPT_TOKENS, DOC_MAX_TOKENS = 2_500, 500
SIM_ARGS = ["--slots", "32", "--tpm", str(POOL_TPM), "--rpm", str(POOL_RPM)]
BATCH_IN_FLIGHT = 64
REJECT_CODES = ("workload_tpm", "workload_rpm", "pool_tpm", "pool_rpm", "pool_saturated", "workload_concurrency",
                "request_too_large")


def _chat_estimate(seed: int) -> float:
    import llm_tokens

    rng = random.Random(seed)
    calls = [short_call(rng) for _ in range(200)]
    prompt = sum(llm_tokens.count_chat_tokens(c.body["messages"], "cl100k_base") for c in calls) / len(calls)
    return prompt + 64


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    solo_sim, flood_sim = (16.0, 24.0) if quick else (100.0, 140.0)
    chat_est = _chat_estimate(seed)
    chat_rate_sim = 0.5 * CHAT["reserved_tpm"] / chat_est / 60  # requests per simulated second
    doc_est = DOC_PROMPT_TOKENS + 30 + DOC_MAX_TOKENS
    batch_rate_sim = 50 * BATCH["reserved_tpm"] / doc_est / 60
    try:
        services.fresh_redis()
        with Platform(services, NAME) as platform:
            platform.start_sim(["--time-scale", str(SCALE.factor), "--seed", str(seed), *SIM_ARGS])
            pool = scaled_pool(scale=SCALE, slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1",
                               provider_tpm=POOL_TPM, provider_rpm=POOL_RPM, burst_seconds=BURST_SIM_S)
            chat = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-chat", workload_class="interactive",
                                   queue_timeout_s=30.0, prompt_tokens_cap=2_000, max_tokens_cap=256,
                                   max_tokens_default=64, **CHAT)
            batch = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-resummarize", workload_class="batch",
                                    queue_timeout_s=120.0, prompt_tokens_cap=4_000, max_tokens_cap=1_024,
                                    max_tokens_default=500, **BATCH)
            config_push(pool)
            platform.start_sluice(lanes={"interactive": 16, "interactive-long": 4, "batch": 16, "scheduled": 1})
            log(f"{NAME}: chat at {chat_rate_sim:.2f} req/s sim (~{chat_est:.0f} tokens each, 50% of reservation); "
                f"batch offers {batch_rate_sim:.2f} req/s sim (~{doc_est} tokens each, 50x its reservation) after "
                f"{solo_sim:.0f} s sim")
            result = asyncio.run(_drive(platform, services, chat, batch, seed, chat_rate_sim, batch_rate_sim,
                                        solo_sim, flood_sim))
            platform.assert_alive()
            time.sleep(1.0)  # let the last ledger rows land
            rows = ledger_rows(pool_id=pool.id)
    finally:
        if own:
            services.down()
    data = _analyse(result, rows, chat, batch, seed, quick, solo_sim, flood_sim, chat_rate_sim, batch_rate_sim)
    write_result(NAME, data)
    return data


async def _drive(platform, services, chat, batch, seed, chat_rate_sim, batch_rate_sim, solo_sim, flood_sim) -> dict:
    client = HttpClient(platform.sluice_url, max_connections=256, timeout=600)
    sim = HttpClient(platform.sim_url, max_connections=2)
    chat_calls: list[Call] = []
    batch_calls: list[Call] = []
    chat_rng, batch_rng = random.Random(seed), random.Random(seed + 1)
    chat_auth = {"Authorization": f"Bearer {chat.api_key}"}
    batch_auth = {"Authorization": f"Bearer {batch.api_key}"}
    t0 = time.monotonic()
    t0_epoch = time.time()

    async def probe() -> dict:
        stats = (await sim.get("/admin/stats")).json()
        return {"lanes": lane_depths(services.redis), "sim_running": stats["running"], "sim_queued": stats["queued"],
                "sim_429": stats["rejected_429"]}

    sampler = Sampler(probe, 0.25, t0).start()

    async def fire_chat(i: int) -> None:
        chat_calls.append(await timed_post(client, "/v1/chat/completions", short_call(chat_rng).body, chat_auth,
                                           "chat", t0))

    slots = asyncio.Semaphore(BATCH_IN_FLIGHT)

    async def fire_batch(i: int) -> None:
        body = long_call(batch_rng, prompt_tokens=DOC_PROMPT_TOKENS, max_tokens=DOC_MAX_TOKENS, median=250).body
        async with slots:
            batch_calls.append(await timed_post(client, "/v1/chat/completions", body, batch_auth, "batch", t0))

    async def flood() -> None:
        await asyncio.sleep(SCALE.real_s(solo_sim))
        await open_loop(SCALE.real_rate(batch_rate_sim), SCALE.real_s(flood_sim), fire_batch, poisson=True,
                        rng=random.Random(seed + 2))

    chat_task = open_loop(SCALE.real_rate(chat_rate_sim), SCALE.real_s(solo_sim + flood_sim), fire_chat,
                          poisson=True, rng=random.Random(seed + 3))
    await asyncio.gather(chat_task, flood())
    samples = await sampler.stop()
    await client.aclose()
    await sim.aclose()
    return {"chat": chat_calls, "batch": batch_calls, "samples": samples, "t0_epoch": t0_epoch}


def _analyse(result, rows, chat, batch, seed, quick, solo_sim, flood_sim, chat_rate_sim, batch_rate_sim) -> dict:
    f = SCALE.factor
    warm = 10.0
    chat_calls = result["chat"]

    def phase(lo, hi):
        calls = [c for c in chat_calls if lo <= c.start * f < hi]
        ok = [c.latency * f for c in calls if c.ok]
        rejected = {}
        for c in calls:
            if not c.ok:
                rejected[c.code or f"http_{c.status}"] = rejected.get(c.code or f"http_{c.status}", 0) + 1
        budget_rejections = sum(n for code, n in rejected.items() if code in REJECT_CODES)
        return {**pcts(ok), "sent": len(calls), "ok": len(ok), "errors": rejected,
                "budget_rejections": budget_rejections}

    solo = phase(warm, solo_sim)
    flood = phase(solo_sim + warm, solo_sim + flood_sim)
    batch_codes: dict[str, int] = {}
    for c in result["batch"]:
        key = "ok" if c.ok else (c.code or f"http_{c.status}")
        batch_codes[key] = batch_codes.get(key, 0) + 1

    t0 = result["t0_epoch"]

    def sim_t(row):
        return (row["created_at"] - t0) * f

    windows = {}
    for label, wid in (("chat", chat.workload_id), ("batch", batch.workload_id)):
        mine = [r for r in rows if r["workload_id"] == wid]
        admitted = [(sim_t(r), r["estimated_input_tokens"] + r["estimated_output_tokens"]) for r in mine
                    if r["status"] != "queue_timeout"]
        used = [(sim_t(r), r["actual_input_tokens"] + r["actual_output_tokens"]) for r in mine]
        windows[label] = {
            "max_admitted_estimate": sliding_max(admitted, 60.0),
            "max_used_actual": sliding_max(used, 60.0),
            "series_used": sliding_series(used, 60.0, step=2.0, end=solo_sim + flood_sim),
            "series_admitted": sliding_series(admitted, 60.0, step=2.0, end=solo_sim + flood_sim),
            "rows": len(mine), "lanes": sorted({r["lane"] for r in mine}),
        }
    data = {
        "scenario": NAME, "seed": seed, "quick": quick, "time_scale": f, "sim_args": SIM_ARGS,
        "clock": "simulated seconds; rates per simulated minute (gateway buckets configured x time scale)",
        "pool": {"tpm": POOL_TPM, "rpm": POOL_RPM, "headroom": 0.8, "burst_s": BURST_SIM_S},
        "chat_cfg": CHAT, "batch_cfg": BATCH, "solo_sim_s": solo_sim, "flood_sim_s": flood_sim,
        "chat_rate_per_sim_s": chat_rate_sim, "batch_offered_per_sim_s": batch_rate_sim,
        "chat": {"solo": solo, "flood": flood, "p99_change": ratio(flood["p99"], solo["p99"])},
        "batch": {"sent": len(result["batch"]), "outcomes": batch_codes},
        "windows": windows,
        "calls": {"chat": calls_to_json(chat_calls), "batch": calls_to_json(result["batch"])},
        "samples": result["samples"],
    }
    return data


def summarize(data: dict) -> str:
    solo, flood = data["chat"]["solo"], data["chat"]["flood"]
    change = data["chat"]["p99_change"]
    ceiling = data["batch_cfg"]["ceiling_tpm"]
    burst_bound = ceiling * (1 + data["pool"]["burst_s"] / 60)
    bw = data["windows"]["batch"]
    rows = [
        ["chat alone", fmt(solo["p50"], 2), fmt(solo["p95"], 2), fmt(solo["p99"], 2), solo["sent"], solo["ok"],
         solo["budget_rejections"], solo["errors"] or "none"],
        ["chat + runaway batch", fmt(flood["p50"], 2), fmt(flood["p95"], 2), fmt(flood["p99"], 2), flood["sent"],
         flood["ok"], flood["budget_rejections"], flood["errors"] or "none"],
    ]
    p99_ok = change is not None and change <= 1.10
    rej_ok = flood["budget_rejections"] == 0 and solo["budget_rejections"] == 0
    lines = [
        f"Pool {data['pool']['tpm']:,} TPM / {data['pool']['rpm']:,} RPM (simulated minute; headroom 0.8, burst "
        f"{data['pool']['burst_s']:g} s). Chat reserved {data['chat_cfg']['reserved_tpm']:,} TPM (lend 0), sending "
        f"{data['chat_rate_per_sim_s']:.2f} req/s = 50% of it; batch reserved {data['batch_cfg']['reserved_tpm']:,}, "
        f"ceiling {ceiling:,} TPM, offering {data['batch_offered_per_sim_s']:.2f} req/s = 50x its reservation "
        f"from {data['solo_sim_s']:.0f} s on. Time scale {data['time_scale']:g}; latencies in simulated seconds.",
        "",
        md_table(["phase", "chat p50", "chat p95", "chat p99", "sent", "ok", "budget rejections", "errors"], rows),
        "",
        md_table(["check", "value", "target"], [
            ["chat p99 under flood / alone", f"**{fmt(change, 2)}**", f"≤ 1.10: {'met' if p99_ok else 'missed'}"],
            ["chat budget rejections", f"**{solo['budget_rejections'] + flood['budget_rejections']}**",
             f"0: {'met' if rej_ok else 'missed'}"],
            ["batch max tokens used in any 60 s window (ledger, actual)", f"**{fmt(bw['max_used_actual'], 0)}**",
             f"≤ ceiling {ceiling:,}: {'met' if bw['max_used_actual'] <= ceiling else 'missed'}"],
            ["batch max tokens admitted in any 60 s window (estimates)", fmt(bw["max_admitted_estimate"], 0),
             f"bucket bound ceiling x (1 + burst/60) = {burst_bound:,.0f}"],
        ]),
        "",
        f"Batch outcomes: {data['batch']['outcomes']} of {data['batch']['sent']} sent. Batch ran on lanes "
        f"{bw['lanes']}, chat on {data['windows']['chat']['lanes']}.",
    ]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import cdf_plot, stacked_bars, timeseries

    f = data["time_scale"]
    names = []
    solo_end = data["solo_sim_s"]
    calls = data["calls"]["chat"]
    series = {"chat alone": [c["latency"] * f for c in calls if c["status"] == 200 and 10 <= c["start"] * f < solo_end],
              "chat + runaway batch": [c["latency"] * f for c in calls
                                       if c["status"] == 200 and c["start"] * f >= solo_end + 10]}
    path = plots_dir / "runaway_chat_latency_cdf.png"
    cdf_plot(series, path, title="Runaway batch: chat latency CDF", xlabel="latency, simulated s")
    names.append(path.name)

    lines = {}
    for label in ("chat", "batch"):
        xs, ys = data["windows"][label]["series_used"]
        lines[f"{label}: tokens used in trailing 60 s"] = (xs, ys)
    hl = {"chat reserved": data["chat_cfg"]["reserved_tpm"], "batch ceiling": data["batch_cfg"]["ceiling_tpm"],
          "batch reserved": data["batch_cfg"]["reserved_tpm"]}
    path = plots_dir / "runaway_tokens_per_minute.png"
    timeseries(lines, path, title="Runaway batch: tokens per minute against budget (ledger)",
               xlabel="simulated s", ylabel="tokens per 60 s window", hlines=hl,
               spans=[(solo_end, solo_end + data["flood_sim_s"], "batch flood")])
    names.append(path.name)

    samples = [s for s in data["samples"] if "error" not in s]
    ts = [s["t"] * f for s in samples]
    lines = {f"lane {lane}": (ts, [s["lanes"].get(lane, 0) for s in samples])
             for lane in ("interactive", "interactive-long", "batch")}
    lines["pool waiting queue"] = (ts, [s["sim_queued"] for s in samples])
    path = plots_dir / "runaway_queue_depth.png"
    timeseries(lines, path, title="Runaway batch: queue depth per lane", xlabel="simulated s",
               ylabel="requests waiting", step=True)
    names.append(path.name)

    cats, stacks = ["chat", "batch"], {}
    for i, label in enumerate(cats):
        for c in data["calls"][label]:
            if c["status"] != 200:
                code = c["code"] or f"http_{c['status']}"
                stacks.setdefault(code, [0, 0])[i] += 1
    path = plots_dir / "runaway_rejections.png"
    stacked_bars(cats, stacks or {"none": [0, 0]}, path, title="Runaway batch: rejections by reason",
                 ylabel="requests")
    names.append(path.name)
    return names


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
