"""Scenario 6, budget accuracy: 4 gateway processes (uvicorn --workers 4),
many concurrent clients, one workload, far more demand than budget.

The workload's budget is 60,000 tokens per *wall-clock* minute with 1 s of
burst (the gateway's token buckets run on the wall clock, so this scenario
uses no time scale at all; the simulator answers at once). Every request asks
for exactly max_tokens output tokens (``sim.output_tokens``), so what
admission debits (the estimate) is what the pool uses: no refund blurs the
count. The ledger's admission timestamps (Redis clock) give the admitted
tokens in every sliding window; a token bucket of rate r and capacity b
admits at most b + r x W in any window W, so the check is the largest excess
over that bound, for windows of 60 s (the budget) and of 1 s and 10 s (more
windows, same guarantee). Target: never above by more than one request.
Run alone: ``python -m bench.accuracy``."""

from __future__ import annotations

import asyncio
import random
import time

from bench.common import PLOTS_DIR, fmt, log, md_table, run_standalone, write_result
from bench.http import HttpClient
from bench.load import closed_loop, timed_post
from bench.platform import Platform, Services
from bench.seed import config_push, ledger_rows, pool_create, workload_create
from bench.windows import sliding_max, sliding_series

NAME = "accuracy"
BUDGET_TPM = 60_000
BURST_S = 1.0
WEB_PROCESSES = 4
CLIENTS = 64
MAX_TOKENS = 100


def _body(rng: random.Random) -> dict:
    return {"model": "sim-small", "max_tokens": MAX_TOKENS, "sim": {"output_tokens": MAX_TOKENS},
            "messages": [{"role": "user", "content": f"Summarize ticket #{rng.randrange(10**6)} in one line."}]}


async def _hammer(base: str, key: str, duration: float, seed: int) -> dict:
    client = HttpClient(base, max_connections=CLIENTS)
    headers = {"Authorization": f"Bearer {key}"}
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    t0 = time.monotonic()

    async def step(c: int, i: int) -> None:
        call = await timed_post(client, "/v1/chat/completions", _body(rng), headers, "hammer", t0, timeout=30)
        key = "ok" if call.ok else (call.code or f"http_{call.status}")
        counts[key] = counts.get(key, 0) + 1

    await closed_loop(CLIENTS, duration, step)
    elapsed = time.monotonic() - t0
    await client.aclose()
    return {"counts": counts, "elapsed_s": elapsed}


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    duration = 8.0 if quick else 100.0
    try:
        services.fresh_redis()
        with Platform(services, NAME) as platform:
            platform.start_sim(["--zero-latency", "--seed", str(seed)])
            pool = pool_create(slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1", provider_tpm=10_000_000,
                               provider_rpm=1_000_000, burst_seconds=BURST_S)
            workload = workload_create(pool=pool, slug=f"{NAME}-wl", workload_class="interactive",
                                       reserved_tpm=BUDGET_TPM, ceiling_tpm=BUDGET_TPM, rpm=100_000,
                                       prompt_tokens_cap=200, max_tokens_cap=MAX_TOKENS,
                                       max_tokens_default=MAX_TOKENS, queue_timeout_s=10.0)
            config_push(pool)
            platform.start_sluice(web_workers=WEB_PROCESSES,
                                  lanes={"interactive": 16, "interactive-long": 1, "batch": 2, "scheduled": 1})
            log(f"{NAME}: {WEB_PROCESSES} web processes, {CLIENTS} clients, {duration:.0f} s against "
                f"{BUDGET_TPM:,} tokens/min (burst {BURST_S:g} s)")
            t0_epoch = time.time()
            hammer = asyncio.run(_hammer(platform.sluice_url, workload.api_key, duration, seed))
            platform.assert_alive()
            time.sleep(1.0)
            rows = [r for r in ledger_rows(pool_id=pool.id) if r["workload_id"] == workload.workload_id]
    finally:
        if own:
            services.down()
    admitted = [(r["created_at"] - t0_epoch, r["estimated_input_tokens"] + r["estimated_output_tokens"])
                for r in rows if r["status"] != "queue_timeout"]
    used = [(r["created_at"] - t0_epoch, r["actual_input_tokens"] + r["actual_output_tokens"]) for r in rows]
    sizes = [k for _, k in admitted]
    request_tokens = max(sizes) if sizes else 0
    rate_per_s = BUDGET_TPM / 60.0
    cap = BUDGET_TPM * BURST_S / 60.0
    windows = {}
    for w in (1.0, 10.0, 60.0):
        worst = sliding_max(admitted, w)
        bound = cap + rate_per_s * w
        windows[str(int(w))] = {"max_admitted": worst, "bound": bound, "excess_tokens": worst - bound,
                                "excess_requests": (worst - bound) / request_tokens if request_tokens else None}
    steady = [(t, k) for t, k in admitted if t >= 0]
    xs, ys = sliding_series(steady, 60.0, step=1.0, end=hammer["elapsed_s"])
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    data = {
        "scenario": NAME, "seed": seed, "quick": quick, "clock": "wall clock (no time scale; budget per real minute)",
        "budget_tpm": BUDGET_TPM, "burst_s": BURST_S, "bucket_capacity": cap, "web_processes": WEB_PROCESSES,
        "clients": CLIENTS, "duration_s": hammer["elapsed_s"], "request_tokens": request_tokens,
        "client_outcomes": hammer["counts"], "ledger_statuses": statuses, "admitted_requests": len(admitted),
        "admitted_tokens": sum(sizes), "estimate_equals_actual": sum(k for _, k in used) == sum(sizes),
        "windows": windows, "series": {"t": xs, "tokens_60s": ys},
        "attempts_per_s": sum(hammer["counts"].values()) / hammer["elapsed_s"],
    }
    write_result(NAME, data)
    return data


def summarize(data: dict) -> str:
    rows = []
    for w, v in data["windows"].items():
        rows.append([f"{w} s", fmt(v["max_admitted"], 0), fmt(v["bound"], 0), fmt(v["excess_tokens"], 0),
                     f"**{fmt(v['excess_requests'], 2)}**"])
    worst = max((v["excess_requests"] or 0) for v in data["windows"].values())
    lines = [
        f"{data['web_processes']} uvicorn web processes, {data['clients']} concurrent closed-loop clients for "
        f"{data['duration_s']:.0f} s (wall clock) against one workload budgeted at {data['budget_tpm']:,} tokens per "
        f"minute, burst {data['burst_s']:g} s (bucket capacity {data['bucket_capacity']:,.0f} tokens); every "
        f"request is exactly {data['request_tokens']} tokens (estimate = actual: "
        f"{data['estimate_equals_actual']}). {data['attempts_per_s']:,.0f} attempts/s; outcomes "
        f"{data['client_outcomes']}; ledger {data['ledger_statuses']}.",
        "",
        md_table(["window", "max admitted tokens", "bucket bound (cap + rate x W)", "excess tokens",
                  "excess in requests"], rows),
        "",
        md_table(["check", "value", "target"], [
            ["worst excess over the budget, any window", f"**{fmt(worst, 2)} requests**",
             f"≤ 1 request: {'met' if worst <= 1 else 'missed'}"],
        ]),
    ]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import timeseries

    path = plots_dir / "accuracy_tokens_per_minute.png"
    timeseries({"admitted tokens in trailing 60 s (ledger)": (data["series"]["t"], data["series"]["tokens_60s"])},
               path, title=f"Budget accuracy: {data['web_processes']} gateway processes, {data['clients']} clients",
               xlabel="wall-clock s", ylabel="tokens per 60 s",
               hlines={"budget (rate x 60 s)": data["budget_tpm"],
                       "bucket bound (budget + burst)": data["windows"]["60"]["bound"]})
    return [path.name]


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
