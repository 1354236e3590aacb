"""Scenario 3, brownout: the pool's capacity halves for a while, then recovers.

The simulated provider serves 100k TPM / 3,000 RPM (per simulated minute);
from 60 s to 150 s its limits and its engine speed halve (``--schedule``:
tpm 50k, rpm 1,500, capacity_factor 0.5), then return. Sluice admits against
the configured limits (80k TPM after headroom) until it learns otherwise.
An interactive chat workload (reserved 30k TPM, lend 0) sends at its full
reservation; a batch workload (reserved 20k, ceiling 80k) offers more than
the pool can take, so before the brownout the pool is full.

Reported: upstream 429s (the simulator's counter and what callers saw) over
time, time to adapt (from the capacity drop to the last upstream 429 of the
brownout), chat goodput against its reservation during the brownout, and
time to recover (from the end of the brownout until total goodput is back
to 90% of its level before). Simulated time throughout; Sluice's capacity
and retry time constants are scaled to simulated time
(bench.platform.time_scaled_env). Run alone: ``python -m bench.brownout``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, run_standalone, write_result
from bench.http import HttpClient
from bench.load import Call, Sampler, calls_to_json, lane_depths, open_loop, timed_post
from bench.platform import Platform, Services, time_scaled_env
from bench.seed import config_push, scaled_pool, scaled_workload
from bench.workload import long_call, short_call
from budgets.admission.keys import pool_capacity as pool_capacity_key

NAME = "brownout"
SCALE = TimeScale(4.0)
POOL_TPM, POOL_RPM = 100_000, 3_000
CHAT = dict(reserved_tpm=30_000, ceiling_tpm=30_000, rpm=900)
BATCH = dict(reserved_tpm=20_000, ceiling_tpm=80_000, rpm=900)


@dataclass(frozen=True)
class Timeline:
    """The brownout's start and end and the run's length, simulated seconds."""
    start: float
    end: float
    total: float

    @property
    def schedule(self) -> list[dict]:
        """The simulator's --schedule: limits and engine speed halve, then return."""
        return [{"at_s": self.start, "tpm": POOL_TPM // 2, "rpm": POOL_RPM // 2, "capacity_factor": 0.5},
                {"at_s": self.end, "tpm": POOL_TPM, "rpm": POOL_RPM, "capacity_factor": 1.0}]


FULL = Timeline(start=60.0, end=150.0, total=240.0)
# A smoke test's size (--quick): the brownout starts before the provider's 60 s
# window is full, so its numbers say the scenario runs, not how it comes out.
QUICK = Timeline(start=25.0, end=50.0, total=75.0)
SIM_ARGS = ["--slots", "64", "--kv-cache-tokens", "131072", "--tpm", str(POOL_TPM), "--rpm", str(POOL_RPM)]
DOC_PROMPT, DOC_MAX = 1_000, 300
BIN_S = 5.0


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    timeline = QUICK if quick else FULL
    chat_est = 20 + 64
    chat_rate = CHAT["reserved_tpm"] / chat_est / 60  # full reservation, requests per simulated second
    batch_rate = 1.5 * BATCH["ceiling_tpm"] / (DOC_PROMPT + 30 + DOC_MAX) / 60
    try:
        services.fresh_redis()
        with Platform(services, NAME) as platform:
            platform.start_sim(["--time-scale", str(SCALE.factor), "--seed", str(seed), *SIM_ARGS,
                                "--schedule", json.dumps(timeline.schedule)])
            pool = scaled_pool(scale=SCALE, slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1",
                               provider_tpm=POOL_TPM, provider_rpm=POOL_RPM)
            chat = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-chat", workload_class="interactive",
                                   queue_timeout_s=30.0, prompt_tokens_cap=2_000, max_tokens_cap=256,
                                   max_tokens_default=64, **CHAT)
            batch = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-batch", workload_class="batch",
                                    queue_timeout_s=120.0, prompt_tokens_cap=2_000, max_tokens_cap=512,
                                    max_tokens_default=DOC_MAX, **BATCH)
            config_push(pool)
            platform.start_sluice(lanes={"interactive": 24, "interactive-long": 2, "batch": 24, "scheduled": 1},
                                  extra_env=time_scaled_env(SCALE.factor))
            log(f"{NAME}: chat {chat_rate:.2f} req/s sim (its reservation), batch offers {batch_rate:.2f} req/s sim; "
                f"capacity halves at {timeline.start:.0f}-{timeline.end:.0f} s of {timeline.total:.0f} s sim")
            result = asyncio.run(_drive(platform, services, pool.id, chat, batch, seed, chat_rate, batch_rate,
                                        timeline.total))
            platform.assert_alive()
    finally:
        if own:
            services.down()
    data = _analyse(result, seed, quick, timeline, chat_rate, batch_rate, chat_est)
    write_result(NAME, data)
    return data


async def _drive(platform, services, pool_id, chat, batch, seed, chat_rate, batch_rate, total_sim) -> dict:
    client = HttpClient(platform.sluice_url, max_connections=256, timeout=600)
    sim = HttpClient(platform.sim_url, max_connections=2)
    chat_calls: list[Call] = []
    batch_calls: list[Call] = []
    chat_rng, batch_rng = random.Random(seed), random.Random(seed + 1)
    chat_auth = {"Authorization": f"Bearer {chat.api_key}"}
    batch_auth = {"Authorization": f"Bearer {batch.api_key}"}
    # The schedule counts from the simulator's start or its last reset: reset now.
    (await sim.post("/admin/reset", {})).json()
    t0 = time.monotonic()

    async def probe() -> dict:
        stats = (await sim.get("/admin/stats")).json()
        capacity = services.redis.hgetall(pool_capacity_key(pool_id))
        seconds, micros = services.redis.time()
        now_ms = seconds * 1000 + micros / 1000
        factor = float(capacity.get("factor", 1.0))
        # What admission runs at (budgets/admission/admit.lua): the provider's stated limit
        # while it states one, else the factor inferred from 429s/latency.
        provider_factor = capacity.get("prov_factor")
        effective = (float(provider_factor) if provider_factor and now_ms < float(capacity.get("prov_until_ms", 0))
                     else factor)
        return {"sim_429": stats["rejected_429"], "sim_completed": stats["completed"], "sim_t": stats["sim_time_s"],
                "window_tokens": stats["window"]["tokens"], "lanes": lane_depths(services.redis),
                "capacity_factor": factor, "admission_factor": effective}

    sampler = Sampler(probe, 0.25, t0).start()

    async def fire_chat(i: int) -> None:
        chat_calls.append(await timed_post(client, "/v1/chat/completions", short_call(chat_rng).body, chat_auth,
                                           "chat", t0))

    slots = asyncio.Semaphore(96)

    async def fire_batch(i: int) -> None:
        body = long_call(batch_rng, prompt_tokens=DOC_PROMPT, max_tokens=DOC_MAX, median=200).body
        async with slots:
            batch_calls.append(await timed_post(client, "/v1/chat/completions", body, batch_auth, "batch", t0))

    duration = SCALE.real_s(total_sim)
    await asyncio.gather(
        open_loop(SCALE.real_rate(chat_rate), duration, fire_chat, poisson=True, rng=random.Random(seed + 2)),
        open_loop(SCALE.real_rate(batch_rate), duration, fire_batch, poisson=True, rng=random.Random(seed + 3)))
    samples = await sampler.stop()
    await client.aclose()
    await sim.aclose()
    return {"chat": chat_calls, "batch": batch_calls, "samples": samples}


def _bins(calls: list[Call], total_sim: float, value) -> list[float]:
    n = int(total_sim // BIN_S) + 1
    out = [0.0] * n
    for c in calls:
        i = int(c.start * SCALE.factor // BIN_S)
        if 0 <= i < n:
            out[i] += value(c)
    return out


def _analyse(result, seed, quick, timeline: Timeline, chat_rate, batch_rate, chat_est) -> dict:
    f = SCALE.factor
    brownout_start, brownout_end, total_sim = timeline.start, timeline.end, timeline.total
    chat_calls, batch_calls = result["chat"], result["batch"]
    # Sluice's own refusals (its buckets, and what the provider's headers said
    # remains) are not the provider's.
    upstream_429 = lambda c: 1.0 if c.code == "upstream_rate_limited" or (c.status == 429 and c.code not in (  # noqa: E731
        "workload_tpm", "workload_rpm", "pool_tpm", "pool_rpm", "pool_saturated", "pool_backoff", "provider_tpm",
        "provider_rpm", "pool_input_tpm", "pool_output_tpm", "workload_concurrency")) else 0.0

    def estimate(c: Call) -> float:
        return 0.0 if not c.ok or not c.usage else float(c.usage["prompt_tokens"] + 64)

    def batch_estimate(c: Call) -> float:
        return 0.0 if not c.ok or not c.usage else float(c.usage["prompt_tokens"] + DOC_MAX)

    per_min = 60.0 / BIN_S
    bins = {
        "t": [i * BIN_S for i in range(int(total_sim // BIN_S) + 1)],
        "chat_sent": _bins(chat_calls, total_sim, lambda c: 1.0),
        "chat_ok": _bins(chat_calls, total_sim, lambda c: 1.0 if c.ok else 0.0),
        "chat_goodput_tpm": [v * per_min for v in _bins(chat_calls, total_sim, estimate)],
        "batch_goodput_tpm": [v * per_min for v in _bins(batch_calls, total_sim, batch_estimate)],
        "upstream_429_seen": [a + b for a, b in zip(_bins(chat_calls, total_sim, upstream_429),
                                                    _bins(batch_calls, total_sim, upstream_429))],
    }
    # The simulator's own 429 counter, per bin (cumulative samples -> increments).
    samples = [s for s in result["samples"] if "error" not in s]
    sim_429 = [0.0] * len(bins["t"])
    prev = 0
    for s in samples:
        i = int(s["t"] * f // BIN_S)
        if 0 <= i < len(sim_429):
            sim_429[i] += max(0, s["sim_429"] - prev)
        prev = s["sim_429"]
    bins["sim_429"] = sim_429
    all_429_times = sorted([c.start * f for c in chat_calls + batch_calls if upstream_429(c)])
    in_brownout = [t for t in all_429_times if brownout_start <= t < brownout_end]
    before = [t for t in all_429_times if t < brownout_start]
    after = [t for t in all_429_times if t >= brownout_end]
    time_to_adapt = (in_brownout[-1] - brownout_start) if in_brownout else 0.0
    # Adapted: no upstream 429 reached a caller in the brownout's last two bins
    # (none at all is adapting at once, time 0).
    adapted = not in_brownout or in_brownout[-1] < brownout_end - 2 * BIN_S

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    idx = lambda lo, hi: [i for i, t in enumerate(bins["t"]) if lo <= t and t + BIN_S <= hi]  # noqa: E731
    pre = idx(20, brownout_start)
    during = idx(brownout_start, brownout_end)
    total = [a + b for a, b in zip(bins["chat_goodput_tpm"], bins["batch_goodput_tpm"])]
    pre_total = mean([total[i] for i in pre])
    # Recovered: from the first bin after the brownout from which every full
    # bin's total goodput is >= 90% of the pre-brownout mean. None: not by the end.
    # Poisson arrivals make single 5 s bins noisy: judge a 15 s moving average.
    smooth = [sum(total[max(0, i - 2):i + 1]) / len(total[max(0, i - 2):i + 1]) for i in range(len(total))]
    after_bins = [i for i, t in enumerate(bins["t"]) if t >= brownout_end + 2 * BIN_S and t + BIN_S <= total_sim]
    recover_at = None
    for k, i in enumerate(after_bins):
        if pre_total and all(smooth[j] >= 0.9 * pre_total for j in after_bins[k:]):
            recover_at = bins["t"][i] + BIN_S - brownout_end
            break
    chat_during = [bins["chat_goodput_tpm"][i] for i in during]
    chat_ok_during = sum(bins["chat_ok"][i] for i in during)
    chat_sent_during = sum(bins["chat_sent"][i] for i in during)
    chat_codes: dict[str, int] = {}
    for c in chat_calls:
        if not c.ok:
            chat_codes[c.code or f"http_{c.status}"] = chat_codes.get(c.code or f"http_{c.status}", 0) + 1
    batch_codes: dict[str, int] = {}
    for c in batch_calls:
        key = "ok" if c.ok else (c.code or f"http_{c.status}")
        batch_codes[key] = batch_codes.get(key, 0) + 1
    cap = [(s["t"] * f, s.get("capacity_factor", 1.0)) for s in samples]
    admission = [(s["t"] * f, s.get("admission_factor", s.get("capacity_factor", 1.0))) for s in samples]
    provider_refused = sum(v for t, v in zip(bins["t"], sim_429) if brownout_start <= t < brownout_end)
    # The provider's window has drained once it holds less than its halved
    # limit (before that it refuses every call, whoever sends it).
    drained_at = next((s["t"] * f for s in samples if brownout_start <= s["t"] * f < brownout_end
                       and s["window_tokens"] <= POOL_TPM // 2), None)
    after_drain = idx(drained_at + BIN_S, brownout_end) if drained_at is not None else []
    served = [bins["chat_ok"][i] / bins["chat_sent"][i] for i in after_drain if bins["chat_sent"][i]]
    chat_after_drain = [bins["chat_goodput_tpm"][i] / CHAT["reserved_tpm"] for i in after_drain]
    pre_served = [bins["chat_ok"][i] / bins["chat_sent"][i] for i in pre if bins["chat_sent"][i]]
    # Sluice back at full admission: the first sample after the provider
    # recovered from which admission runs at >= 99% of the configured rate.
    full_at = None
    for k, (t, value) in enumerate(admission):
        if t >= brownout_end and all(v >= 0.99 for tt, v in admission[k:] if tt < total_sim):
            full_at = t - brownout_end
            break
    return {
        "scenario": NAME, "seed": seed, "quick": quick, "time_scale": f, "sim_args": SIM_ARGS,
        "schedule": timeline.schedule,
        "clock": "simulated seconds; goodput in estimated tokens per simulated minute",
        "pool": {"tpm": POOL_TPM, "rpm": POOL_RPM}, "chat_cfg": CHAT, "batch_cfg": BATCH,
        "chat_rate_per_sim_s": chat_rate, "batch_offered_per_sim_s": batch_rate, "chat_estimate_tokens": chat_est,
        "brownout": [brownout_start, brownout_end], "total_sim_s": total_sim, "bin_s": BIN_S, "bins": bins,
        "upstream_429": {"before": len(before), "during": len(in_brownout), "after": len(after),
                         "sim_counter_total": samples[-1]["sim_429"] if samples else None},
        "time_to_adapt_s": time_to_adapt, "adapted": adapted,
        "chat_goodput_during": {"min_tpm": min(chat_during) if chat_during else None, "mean_tpm": mean(chat_during),
                                "min_fraction": (min(chat_during) / CHAT["reserved_tpm"]) if chat_during else None,
                                "mean_fraction": (mean(chat_during) / CHAT["reserved_tpm"]) if chat_during else None,
                                "success_rate": chat_ok_during / chat_sent_during if chat_sent_during else None},
        "total_goodput_pre_tpm": pre_total, "time_to_recover_s": recover_at,
        "chat_errors": chat_codes, "batch_outcomes": batch_codes, "capacity_factor": cap,
        "admission_factor": admission, "provider_refused_during": provider_refused,
        "provider_drained_at_s": drained_at,
        "chat_after_drain": {"min_served": min(served) if served else None,
                             "mean_served": mean(served),
                             "min_goodput_fraction": min(chat_after_drain) if chat_after_drain else None,
                             "mean_goodput_fraction": mean(chat_after_drain),
                             "pre_brownout_min_served": min(pre_served) if pre_served else None},
        "time_to_full_admission_s": full_at,
        "calls": {"chat": calls_to_json(chat_calls), "batch": calls_to_json(batch_calls)},
    }


def summarize(data: dict) -> str:
    g = data["chat_goodput_during"]
    u = data["upstream_429"]
    # No upstream 429 reached a caller during the brownout: adapted at once
    # (runs before this rule stored False for that case).
    adapted = data["adapted"] or u["during"] == 0
    adapt_ok = adapted and data["time_to_adapt_s"] <= 10
    start, end = data["brownout"]
    a = data.get("chat_after_drain") or {}
    refused = data.get("provider_refused_during")
    served_ok = a.get("min_served") is not None and a["min_served"] >= 0.9
    full_at = data.get("time_to_full_admission_s")
    drained = data.get("provider_drained_at_s")
    lines = [
        f"Provider {data['pool']['tpm']:,} TPM / {data['pool']['rpm']:,} RPM per simulated minute, halved (limits "
        f"and engine speed) from {start:.0f} s to {end:.0f} s of {data['total_sim_s']:.0f} s. Chat reserved "
        f"{data['chat_cfg']['reserved_tpm']:,} TPM (lend 0) sending its full reservation "
        f"({data['chat_rate_per_sim_s']:.2f} req/s, ~{data['chat_estimate_tokens']} tokens each); batch reserved "
        f"{data['batch_cfg']['reserved_tpm']:,}, ceiling {data['batch_cfg']['ceiling_tpm']:,}, offering "
        f"{data['batch_offered_per_sim_s']:.2f} req/s. Time scale {data['time_scale']:g}; goodput = estimated tokens "
        f"of successful requests per simulated minute, in {data['bin_s']:g} s bins.",
        "",
        md_table(["measure", "value", "target"], [
            ["upstream 429s before / during / after the brownout (seen by callers; Sluice's own provider_tpm/rpm "
             "refusals not counted)",
             f"{u['before']} / **{u['during']}** / {u['after']}", ""],
            ["upstream 429s counted by the simulator (whole run)", fmt(u["sim_counter_total"], 0), ""],
            ["time to adapt (brownout start to its last upstream 429 seen by a caller)",
             f"**{fmt(data['time_to_adapt_s'], 1)} s**" + ("" if adapted else " (429s until the end)")
             + (" (none reached a caller)" if u["during"] == 0 else ""),
             f"≤ 10 s: {'met' if adapt_ok else 'missed'}"],
            ["calls the provider refused during the brownout (the simulator's 429 counter)", f"**{fmt(refused, 0)}**",
             f"≤ 5: {'n/a' if refused is None else 'met' if refused <= 5 else 'missed'}"],
            ["provider's window drained (holds less than its halved limit) at",
             f"{fmt(drained - start, 1)} s into the brownout" if drained is not None else "never", ""],
            ["chat after the drain, worst 5 s bin: requests served / sent at its reservation",
             f"**{fmt(a.get('min_served'), 2)}** (mean {fmt(a.get('mean_served'), 2)})",
             f"≥ 0.90: {'met' if served_ok else 'missed'}"],
            ["chat after the drain, worst 5 s bin: goodput / reservation (Poisson arrivals: before the brownout "
             "the worst bin's served share was " + fmt(a.get("pre_brownout_min_served"), 2) + ")",
             fmt(a.get("min_goodput_fraction"), 2), ""],
            ["time from the provider's recovery to Sluice's full admission rate (admission factor ≥ 0.99)",
             f"**{fmt(full_at, 1)} s**" if full_at is not None else "**not by the end of the run**",
             f"≤ 10 s: {'met' if full_at is not None and full_at <= 10 else 'missed'}"],
            ["chat goodput during the brownout (drain included), worst 5 s bin / reservation",
             fmt(g['min_fraction'], 2), ""],
            ["chat goodput during the brownout, mean / reservation", fmt(g["mean_fraction"], 2), ""],
            ["chat success rate during the brownout", f"{(g['success_rate'] or 0):.1%}", ""],
            ["time to recover (total goodput, 15 s average, back to 90% of pre-brownout and staying)",
             (f"**{fmt(data['time_to_recover_s'], 0)} s**" if data["time_to_recover_s"] is not None
              else "**not by the end of the run**"), "(report)"],
        ]),
        "",
        f"Chat errors: {data['chat_errors'] or 'none'}. Batch outcomes: {data['batch_outcomes']}.",
    ]
    if refused is not None and refused > 5:
        b = data["bins"]
        per_bin = {t: n for t, n in zip(b["t"], b["sim_429"]) if start <= t < end and n}
        first = per_bin.get(start, 0)
        lines += ["", f"Why the provider still refused {refused:.0f} calls: {first:.0f} in the first "
                  f"{data['bin_s']:g} s after its limit halved (calls sent before the first answer carrying the "
                  f"new limit came back), the rest by bin: "
                  + ", ".join(f"{t:.0f} s: {n:.0f}" for t, n in per_bin.items() if t != start) + "."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import timeseries

    b = data["bins"]
    t = b["t"]
    start, end = data["brownout"]
    names = []
    lines = {"chat goodput": (t, b["chat_goodput_tpm"]), "batch goodput": (t, b["batch_goodput_tpm"])}
    path = plots_dir / "brownout_goodput.png"
    timeseries(lines, path, title="Brownout: goodput per workload (tokens per simulated minute)",
               xlabel="simulated s", ylabel="tokens / min", step=True,
               hlines={"chat reservation": data["chat_cfg"]["reserved_tpm"],
                       "provider TPM (halved in brownout)": data["pool"]["tpm"]},
               spans=[(start, end, "capacity halved")])
    names.append(path.name)
    lines = {"upstream 429s seen by callers": (t, b["upstream_429_seen"]),
             "429s counted by the simulator": (t, b["sim_429"])}
    path = plots_dir / "brownout_upstream_429.png"
    timeseries(lines, path, title=f"Brownout: upstream 429s per {data['bin_s']:g} s", xlabel="simulated s",
               ylabel="429s per bin", step=True, spans=[(start, end, "capacity halved")])
    names.append(path.name)
    return names


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
