"""Scenario 7, streaming: what the full gateway path adds to a streamed
completion's time to first token (TTFT) and to the gap between its chunks,
over streaming straight from the simulator, in the same run.

New streams arrive paced at 20 per second, each asking for 32 tokens, first
straight to the simulator, then through Sluice (auth, estimate, Lua
admission, Celery lane, worker streaming from the pool and XADDing each
chunk to the request's Redis Stream, the web process's blocking XREAD and
its server-sent events). The simulator runs on the wall clock (no time
scale) with its default engine, so chunks come one decode step apart, as
from a GPU server. Per stream: TTFT = request sent -> first content chunk
read; inter-chunk = time between consecutive content chunks. Added = Sluice's
percentile minus the direct one. The two paths take turns in blocks of 5 s
(direct, Sluice, direct, ...; each block's streams all end before the next
block starts, so the paths never share the machine): this two-core machine's
speed drifts over a minute (the simulator's own direct TTFT p50 moved by
2.6 ms between runs of the same code), and a drift between one path's 20 s
and the other's would be read as the gateway's. Run alone:
``python -m bench.streaming --seed 1``.

The engine is the simulator's ``a100-llama3-8b`` calibration (256 slots, a
12 ms decode step: inference_sim/config.py, docs/calibration.md), which
serves the offered load without a queue of its own, so the difference is
what the gateway adds. The simulator's demo engine (16 slots, a 28 ms step
at full batch) is over capacity at this rate: 20 streams/s x ~0.9 s is 18
streams against 16 slots, its waiting queue grows for the whole run (direct
TTFT p50 1.5 s, p99 3 s in the run before this change), and the difference
of two such growing queues is not the gateway's latency."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from bench.common import PLOTS_DIR, fmt, log, md_table, pcts, run_standalone, write_result
from bench.load import open_loop, stream_refusal_code
from bench.platform import Platform, Services
from bench.seed import config_push, ledger_rows, pool_create, workload_create

NAME = "streaming"
RATE = 20.0  # new streams per second
TOKENS = 32
SIM_ARGS = ["--profile", "a100-llama3-8b"]
TARGETS = {"ttft_p50": 5.0, "ttft_p99": 25.0, "gap_p99": 5.0}
BLOCKS = 4  # turns per path


def _body(rng: random.Random) -> dict:
    return {"model": "sim-small", "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True},
            "sim": {"output_tokens": TOKENS},
            "messages": [{"role": "user", "content": f"Stream {rng.randrange(10**6)}: count to thirty-two."}]}


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    started = time.monotonic()
    arrivals: list[float] = []
    status, code = 0, ""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            status = response.status_code
            if status != 200:
                code = await stream_refusal_code(response)
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        code = str(chunk["error"].get("code") or "stream_error")
                        break
                    choices = chunk.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        arrivals.append(time.monotonic())
    except httpx.HTTPError as exc:
        code = f"transport: {type(exc).__name__}"
    ok = status == 200 and not code and len(arrivals) == TOKENS
    return {"ok": ok, "status": status, "code": code or ("" if ok else "short_stream"),
            "ttft_ms": (arrivals[0] - started) * 1000 if arrivals else None,
            "gaps_ms": [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]}


async def _paced(paths: list[tuple[str, dict]], duration: float, rng: random.Random) -> list[list[dict]]:
    """Each path's streams, ``duration`` seconds of them at RATE, the paths
    taking turns in BLOCKS blocks each (one client per path)."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    clients = [httpx.AsyncClient(timeout=60, limits=limits) for _ in paths]
    results: list[list[dict]] = [[] for _ in paths]
    try:
        for client, (url, headers) in zip(clients, paths):
            for _ in range(10):  # warm the connections and the server's code paths
                await _one(client, url, _body(rng), headers)
        for _ in range(BLOCKS):
            for client, (url, headers), got in zip(clients, paths, results):
                async def fire(i: int, client=client, url=url, headers=headers, got=got) -> None:
                    got.append(await _one(client, url, _body(rng), headers))

                await open_loop(RATE, duration / BLOCKS, fire)
    finally:
        for client in clients:
            await client.aclose()
    return results


def _stats(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    codes: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            codes[r["code"]] = codes.get(r["code"], 0) + 1
    return {"n": len(results), "errors": len(results) - len(ok), "codes": codes,
            "ttft_ms": pcts([r["ttft_ms"] for r in ok]),
            "gap_ms": pcts([g for r in ok for g in r["gaps_ms"]]),
            "ttft_all": [round(r["ttft_ms"], 3) for r in ok]}


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value or "none"] = out.get(value or "none", 0) + 1
    return out


def _settled_rows(pool_id: int, *, expected: int, timeout_s: float = 30.0) -> list[dict]:
    """The pool's ledger rows, once every stream's row is written."""
    from budgets.models import UsageRecord

    deadline = time.monotonic() + timeout_s
    while len(rows := ledger_rows(pool_id=pool_id)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    sources = dict(UsageRecord.objects.filter(pool_id=pool_id).values_list("request_id", "usage_source"))
    return [{**row, "usage_source": sources.get(row["request_id"], "")} for row in rows]


def _sub(a, b):
    return None if a is None or b is None else a - b


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    rng = random.Random(seed)
    duration = 3.0 if quick else 20.0
    services.fresh_redis()
    platform = Platform(services, NAME)
    try:
        platform.start_sim(["--seed", str(seed), *SIM_ARGS])
        pool = pool_create(slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1", provider_tpm=50_000_000,
                           provider_rpm=2_000_000)
        workload = workload_create(pool=pool, slug=f"{NAME}-chat", workload_class="interactive",
                                   reserved_tpm=20_000_000, ceiling_tpm=30_000_000, rpm=1_000_000,
                                   prompt_tokens_cap=2_000, max_tokens_cap=256, max_tokens_default=TOKENS)
        config_push(pool)
        platform.start_sluice()
        log(f"{NAME}: platform up (sim wall clock, web x1, lanes {platform.lane_sizes})")
        auth = {"Authorization": f"Bearer {workload.api_key}"}
        direct, sluice = asyncio.run(_paced([(f"{platform.sim_url}/v1/chat/completions", {}),
                                             (f"{platform.sluice_url}/v1/chat/completions", auth)], duration, rng))
        log(f"{NAME}: {len(direct)} streams direct, {len(sluice)} through sluice, in turns of {BLOCKS} blocks each")
        platform.assert_alive()
        rows = _settled_rows(pool.id, expected=len(sluice) + 10)
    finally:
        platform.stop()
        if own:
            services.down()
    d, s = _stats(direct), _stats(sluice)
    data = {
        "scenario": NAME, "seed": seed, "quick": quick, "clock": "wall clock (simulator without time scale)",
        "rate_per_s": RATE, "tokens": TOKENS, "duration_s": duration, "blocks": BLOCKS, "sim_args": SIM_ARGS,
        "direct": d, "sluice": s,
        "added_ms": {"ttft_p50": _sub(s["ttft_ms"]["p50"], d["ttft_ms"]["p50"]),
                     "ttft_p99": _sub(s["ttft_ms"]["p99"], d["ttft_ms"]["p99"]),
                     "gap_p50": _sub(s["gap_ms"]["p50"], d["gap_ms"]["p50"]),
                     "gap_p99": _sub(s["gap_ms"]["p99"], d["gap_ms"]["p99"])},
        # From the ledger: how long streams waited for a lane worker (a
        # stream holds its worker thread for its whole duration), and where
        # their charged usage came from.
        "ledger": {"rows": len(rows), "lane_wait_ms": pcts([r["queue_wait_ms"] for r in rows]),
                   "upstream_ms": pcts([r["upstream_ms"] for r in rows]),
                   "statuses": _count(r["status"] for r in rows),
                   "usage_sources": _count(r["usage_source"] for r in rows)},
    }
    write_result(NAME, data)
    return data


def summarize(data: dict) -> str:
    d, s, a = data["direct"], data["sluice"], data["added_ms"]

    def row(name, x):
        return [name, fmt(x["ttft_ms"]["p50"], 1), fmt(x["ttft_ms"]["p99"], 1), fmt(x["gap_ms"]["p50"], 1),
                fmt(x["gap_ms"]["p99"], 1), x["n"], x["errors"]]

    def verdict(value, target):
        return f"≤ {target:.0f} ms: {'met' if value is not None and value <= target else 'missed'}"

    lines = [
        f"New streams paced at {data['rate_per_s']:.0f}/s for {data['duration_s']:.0f} s each, {data['tokens']} tokens "
        f"per stream, simulator on the wall clock (`{' '.join(data.get('sim_args') or [])}`); the paths take turns in "
        f"{data.get('blocks', 1)} blocks each; milliseconds.",
        "",
        md_table(["path", "TTFT p50", "TTFT p99", "inter-chunk p50", "inter-chunk p99", "streams", "errors"], [
            row("direct to simulator", d), row("through Sluice", s),
            ["**added by Sluice**", f"**{fmt(a['ttft_p50'], 1)}**", f"**{fmt(a['ttft_p99'], 1)}**",
             fmt(a["gap_p50"], 1), f"**{fmt(a['gap_p99'], 1)}**", "", ""],
        ]),
        "",
        md_table(["added", "value", "target"], [
            ["TTFT p50", f"**{fmt(a['ttft_p50'], 1)} ms**", verdict(a["ttft_p50"], TARGETS["ttft_p50"])],
            ["TTFT p99", f"**{fmt(a['ttft_p99'], 1)} ms**", verdict(a["ttft_p99"], TARGETS["ttft_p99"])],
            ["inter-chunk p99", f"**{fmt(a['gap_p99'], 1)} ms**", verdict(a["gap_p99"], TARGETS["gap_p99"])],
        ]),
        "",
        f"Errors direct: {d['codes'] or 'none'}; through Sluice: {s['codes'] or 'none'}.",
    ]
    ledger = data.get("ledger")
    if ledger:
        lines += ["", f"From the ledger ({ledger['rows']} streams): lane wait p50/p99 "
                  f"{fmt(ledger['lane_wait_ms']['p50'], 0)} / {fmt(ledger['lane_wait_ms']['p99'], 0)} ms, "
                  f"pool time p50/p99 {fmt(ledger['upstream_ms']['p50'], 0)} / "
                  f"{fmt(ledger['upstream_ms']['p99'], 0)} ms; statuses {ledger['statuses']}; "
                  f"usage from {ledger['usage_sources']}."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import cdf_plot

    series = {"direct to simulator": data["direct"]["ttft_all"], "through Sluice": data["sluice"]["ttft_all"]}
    path = plots_dir / "streaming_ttft_cdf.png"
    cdf_plot(series, path, title=f"Time to first token at {data['rate_per_s']:.0f} new streams/s",
             xlabel="TTFT, wall-clock ms", log_x=True)
    return [path.name]


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
