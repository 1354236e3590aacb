"""Scenario 5, overhead and throughput (also the spine issue's first bench):
what the full gateway path adds over calling the pool directly, with a
zero-latency simulator so that nothing but the path itself is measured.

* added latency: the same paced 100 requests/s, straight to the simulator
  and through Sluice (auth, estimate, Lua admission, Celery lane, worker,
  pool call, settlement, ledger row, result hand-back), p50/p99 of each and
  the difference;
* admitted requests/s: closed-loop clients through the full path, as fast as
  it goes;
* rejections/s: a workload over its RPM hammered closed-loop; every answer is
  a 429 decided by the Lua script (the fast path).

Wall-clock numbers throughout (the simulator is not time-scaled here). Run
alone: ``python -m bench.overhead --seed 1``."""

from __future__ import annotations

import asyncio
import random
import time

from bench.common import PLOTS_DIR, fmt, log, md_table, pcts, run_standalone, write_result
from bench.http import HttpClient
from bench.load import Call, calls_to_json, closed_loop, open_loop, timed_post
from bench.platform import Platform, Services
from bench.seed import spine_setup

NAME = "overhead"
RATE = 100.0
LIGHT_RATE = 20.0  # a load one web process sustains here: the per-request cost without queueing


def _body(rng: random.Random) -> dict:
    return {"model": "sim-small", "max_tokens": 16,
            "messages": [{"role": "user", "content": f"Ping {rng.randrange(10**6)}: what is 2+2?"}]}


async def _paced(base: str, path: str, headers: dict, rate: float, duration: float, rng: random.Random,
                 kind: str) -> list[Call]:
    client = HttpClient(base, max_connections=256)
    calls: list[Call] = []
    # Warm the connection pool and the server's code paths first.
    for _ in range(20):
        await client.post(path, _body(rng), headers)
    t0 = time.monotonic()

    async def fire(i: int) -> None:
        calls.append(await timed_post(client, path, _body(rng), headers, kind, t0, timeout=30))

    await open_loop(rate, duration, fire)
    await client.aclose()
    return calls


async def _closed(base: str, headers: dict, clients: int, duration: float, rng: random.Random,
                  kind: str) -> tuple[list[Call], float]:
    client = HttpClient(base, max_connections=clients)
    calls: list[Call] = []
    t0 = time.monotonic()

    async def step(c: int, i: int) -> None:
        calls.append(await timed_post(client, "/v1/chat/completions", _body(rng), headers, kind, t0, timeout=30))

    await closed_loop(clients, duration, step)
    elapsed = time.monotonic() - t0
    await client.aclose()
    return calls, elapsed


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    rng = random.Random(seed)
    duration = 2.0 if quick else 20.0
    burst = 1.5 if quick else 10.0
    services.fresh_redis()
    platform = Platform(services, NAME)
    try:
        spine = spine_setup(platform, name=NAME, seed=seed)
        open_wl, tight_wl = spine.open, spine.tight
        log(f"{NAME}: platform up (sim zero-latency, web x1, lanes {platform.lane_sizes})")
        open_auth = {"Authorization": f"Bearer {open_wl.api_key}"}
        tight_auth = {"Authorization": f"Bearer {tight_wl.api_key}"}

        # Warm both paths first (every lane worker process's first calls open
        # its database connection, load the scripts and build its pool
        # client): the paced runs measure the steady state.
        warm_s = 0.5 if quick else 3.0
        asyncio.run(_closed(platform.sim_url, {}, 8, warm_s, rng, "warm"))
        warm, _ = asyncio.run(_closed(platform.sluice_url, open_auth, 8, warm_s, rng, "warm"))
        log(f"{NAME}: warmed with {len(warm)} calls")
        direct = asyncio.run(_paced(platform.sim_url, "/v1/chat/completions", {}, RATE, duration, rng, "direct"))
        log(f"{NAME}: direct {len(direct)} calls")
        sluice = asyncio.run(_paced(platform.sluice_url, "/v1/chat/completions", open_auth, RATE, duration, rng,
                                    "sluice"))
        log(f"{NAME}: through sluice {len(sluice)} calls")
        light_direct = asyncio.run(_paced(platform.sim_url, "/v1/chat/completions", {}, LIGHT_RATE, duration / 2,
                                          rng, "direct"))
        light = asyncio.run(_paced(platform.sluice_url, "/v1/chat/completions", open_auth, LIGHT_RATE, duration / 2,
                                   rng, "sluice"))
        log(f"{NAME}: light load {len(light)} calls at {LIGHT_RATE:.0f}/s")
        admitted, admitted_s = asyncio.run(_closed(platform.sluice_url, open_auth, 32, burst, rng, "admitted"))
        log(f"{NAME}: closed-loop admitted {len(admitted)} calls in {admitted_s:.1f}s")
        rejected, rejected_s = asyncio.run(_closed(platform.sluice_url, tight_auth, 64, burst, rng, "rejected"))
        log(f"{NAME}: fast-path {len(rejected)} calls in {rejected_s:.1f}s")
        platform.assert_alive()
    finally:
        platform.stop()
        if own:
            services.down()

    def lat_ms(calls):
        return [c.latency * 1000 for c in calls if c.ok]

    direct_ms, sluice_ms = pcts(lat_ms(direct)), pcts(lat_ms(sluice))
    queue_ms = [float(c.headers["x-sluice-queue-ms"]) for c in sluice if c.ok and "x-sluice-queue-ms" in c.headers]
    data = {
        "scenario": NAME, "seed": seed, "quick": quick, "clock": "wall clock (zero-latency simulator, no time scale)",
        "rate_per_s": RATE, "duration_s": duration,
        "direct": {"latency_ms": direct_ms, "errors": sum(not c.ok for c in direct), "n": len(direct)},
        "sluice": {"latency_ms": sluice_ms, "errors": sum(not c.ok for c in sluice), "n": len(sluice),
                   "error_codes": _codes(sluice), "lane_queue_ms": pcts(queue_ms)},
        "added_ms": {q: (sluice_ms[q] - direct_ms[q]) if sluice_ms[q] is not None and direct_ms[q] is not None
                     else None for q in ("p50", "p95", "p99")},
        "light": {"rate_per_s": LIGHT_RATE, "direct_ms": pcts(lat_ms(light_direct)), "sluice_ms": pcts(lat_ms(light)),
                  "errors": sum(not c.ok for c in light)},
        "admitted": {"clients": 32, "seconds": admitted_s, "ok": sum(c.ok for c in admitted),
                     "per_s": sum(c.ok for c in admitted) / admitted_s, "errors": _codes(admitted),
                     "latency_ms": pcts(lat_ms(admitted))},
        # Every refusal decided at the door counts (429 budget, 413 too large, 503 unavailable).
        "rejections": {"clients": 64, "seconds": rejected_s, "n429": sum(c.status == 429 for c in rejected),
                       "per_s": sum(400 <= c.status < 600 for c in rejected) / rejected_s, "codes": _codes(rejected),
                       "latency_ms": pcts([c.latency * 1000 for c in rejected if 400 <= c.status < 600])},
        "calls": {"direct": calls_to_json(direct), "sluice": calls_to_json(sluice)},
    }
    write_result(NAME, data)
    return data


def _codes(calls: list[Call]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        if not c.ok:
            key = c.code or f"http_{c.status}"
            out[key] = out.get(key, 0) + 1
    return out


def _sub(a, b):
    return None if a is None or b is None else a - b


def summarize(data: dict) -> str:
    d, s, a = data["direct"]["latency_ms"], data["sluice"]["latency_ms"], data["added_ms"]
    rows = [
        ["direct to simulator", fmt(d["p50"], 1), fmt(d["p95"], 1), fmt(d["p99"], 1), data["direct"]["n"],
         data["direct"]["errors"]],
        ["through Sluice", fmt(s["p50"], 1), fmt(s["p95"], 1), fmt(s["p99"], 1), data["sluice"]["n"],
         data["sluice"]["errors"]],
        ["**added by Sluice**", f"**{fmt(a['p50'], 1)}**", fmt(a["p95"], 1), f"**{fmt(a['p99'], 1)}**", "", ""],
    ]
    light = data.get("light")
    if light:
        ld, ls = light["direct_ms"], light["sluice_ms"]
        rows.append([f"at {light['rate_per_s']:.0f} req/s: direct / Sluice / added",
                     f"{fmt(ld['p50'], 1)} / {fmt(ls['p50'], 1)} / {fmt(_sub(ls['p50'], ld['p50']), 1)}",
                     f"{fmt(ld['p95'], 1)} / {fmt(ls['p95'], 1)} / {fmt(_sub(ls['p95'], ld['p95']), 1)}",
                     f"{fmt(ld['p99'], 1)} / {fmt(ls['p99'], 1)} / {fmt(_sub(ls['p99'], ld['p99']), 1)}",
                     ls["n"], light["errors"]])
    adm, rej = data["admitted"], dict(data["rejections"])
    rej["per_s"] = sum(rej["codes"].values()) / rej["seconds"]  # all refusals, whatever their status
    p50_ok = a["p50"] is not None and a["p50"] <= 5
    p99_ok = a["p99"] is not None and a["p99"] <= 25
    lines = [
        f"Paced at {data['rate_per_s']:.0f} requests/s for {data['duration_s']:.0f} s each, zero-latency simulator, "
        "after a few seconds of closed-loop calls on each path to warm it; wall-clock milliseconds.",
        "",
        md_table(["path", "p50 ms", "p95 ms", "p99 ms", "calls", "errors"], rows),
        "",
        md_table(["throughput", "value", "target"], [
            ["added p50", f"**{fmt(a['p50'], 1)} ms**", f"≤ 5 ms: {'met' if p50_ok else 'missed'}"],
            ["added p99", f"**{fmt(a['p99'], 1)} ms**", f"≤ 25 ms: {'met' if p99_ok else 'missed'}"],
            [f"admitted requests/s ({adm['clients']} closed-loop clients, full path)",
             f"**{fmt(adm['per_s'], 0)}**", "(report)"],
            [f"rejections/s ({rej['clients']} closed-loop clients, fast path)", f"**{fmt(rej['per_s'], 0)}**",
             f"≥ 2,000: {'met' if rej['per_s'] >= 2000 else 'missed'}"],
        ]),
        "",
        f"Sluice lane wait (x-sluice-queue-ms) p50/p99: {fmt(data['sluice']['lane_queue_ms']['p50'], 0)} / "
        f"{fmt(data['sluice']['lane_queue_ms']['p99'], 0)} ms; admitted-path latency p50/p99 under closed loop: "
        f"{fmt(adm['latency_ms']['p50'], 1)} / {fmt(adm['latency_ms']['p99'], 1)} ms; rejection latency p50/p99: "
        f"{fmt(rej['latency_ms']['p50'], 1)} / {fmt(rej['latency_ms']['p99'], 1)} ms (429s only in runs before "
        "this field counted every refusal). "
        f"Error codes through Sluice: {data['sluice']['error_codes'] or 'none'}; "
        f"rejection codes: {rej['codes']}.",
    ]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import cdf_plot

    series = {
        "direct to simulator": [c["latency"] * 1000 for c in data["calls"]["direct"] if c["status"] == 200],
        "through Sluice": [c["latency"] * 1000 for c in data["calls"]["sluice"] if c["status"] == 200],
    }
    path = plots_dir / "overhead_latency_cdf.png"
    cdf_plot(series, path, title=f"Overhead at {data['rate_per_s']:.0f} req/s (zero-latency pool)",
             xlabel="latency, wall-clock ms", log_x=True)
    return [path.name]


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
