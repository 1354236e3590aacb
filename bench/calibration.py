"""Calibration of inference_sim against published concurrency sweeps.

1. The engine model in virtual time (inference_sim.virtual: the server's own
   admission and step arithmetic, no sleeping) swept over concurrency with
   fixed prompt/output lengths, as `vllm bench serve --max-concurrency` and
   NVIDIA's genai-perf/AIPerf do, for each --profile, next to the published
   points it was fitted to (docs/calibration.md lists the sources).
2. The HTTP server itself, time-scaled, at a few concurrency levels: does the
   running simulator deliver what the model predicts (event-loop overhead,
   timer granularity and time scaling included)?

Run alone: ``python -m bench.calibration``."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from inference_sim.config import PROFILES, SimConfig
from inference_sim.virtual import sweep

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, run_standalone, write_result
from bench.http import HttpClient
from bench.load import closed_loop
from bench.platform import Platform, Services

NAME = "calibration"

# NVIDIA NIM LLM benchmarking guide, "Performance" page (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance):
# Llama-3.3-70b-instruct, NIM 1.8.0, 2 x H100 80G, fp8 TP2, 5000 input / 500 output tokens.
NIM_70B = {"prompt": 5000, "output": 500, "profile": "h100x2-llama3-70b", "points": [
    # concurrency, TTFT ms, ITL ms, throughput tokens/s
    (1, 406.77, 18.58, 51.67), (5, 546.7, 21.83, 218.48), (25, 688.69, 38.75, 623.4), (50, 834.51, 59.73, 814.37),
    (100, 7996.25, 92.91, 917.26), (150, 34794.22, 92.86, 920.9), (200, 61680.22, 93.06, 920.54),
    (250, 88605.32, 93.2, 920.12)]}
# Same page, Llama-3.1-8b-instruct, NIM 1.3.0 (hardware and lengths as stated there): the shape only.
NIM_8B_SHAPE = [(1, 8.98, 4.37, 227.44), (5, 15.31, 5.19, 971.34), (25, 21.08, 6.02, 4100.33),
                (50, 50.68, 7.19, 6745.78), (100, 209.66, 8.62, 10369.56), (150, 398.54, 12.49, 10383.16),
                (200, 501.44, 17.76, 9884.77)]
# vLLM throughput-latency sweep, Llama-3.1-8B-Instruct bf16 on one A100 40GB, 1024 input / 128 output
# (johnmusgrave.com/p/vllm-throughput-latency-sweep-on): ~75 tok/s at concurrency 1, 6.6x that at 8.
A100_8B = {"prompt": 1024, "output": 128, "profile": "a100-llama3-8b", "points": [(1, 75.0), (8, 75.0 * 6.6)]}

HTTP_SCALE = TimeScale(10.0)
HTTP_LEVELS = (1, 4, 16)
HTTP_PROMPT, HTTP_OUTPUT = 256, 128


def _virtual() -> dict:
    cfg_70b = SimConfig(**PROFILES["h100x2-llama3-70b"])
    conc_70b = [p[0] for p in NIM_70B["points"]]
    sim_70b = sweep(cfg_70b, conc_70b, NIM_70B["prompt"], NIM_70B["output"], duration_s=900, warmup_s=120)
    cfg_8b = SimConfig(**PROFILES["a100-llama3-8b"])
    sim_8b = sweep(cfg_8b, [1, 2, 4, 8, 16, 32, 64], A100_8B["prompt"], A100_8B["output"], duration_s=300,
                   warmup_s=30)
    demo = sweep(SimConfig(), [1, 2, 4, 8, 16, 24, 32, 48], 256, 128, duration_s=300, warmup_s=30)
    return {"h100x2-llama3-70b": [dataclasses.asdict(p) for p in sim_70b],
            "a100-llama3-8b": [dataclasses.asdict(p) for p in sim_8b],
            "demo": [dataclasses.asdict(p) for p in demo]}


async def _http_level(base: str, concurrency: int, duration_real: float) -> dict:
    client = HttpClient(base, max_connections=concurrency)
    tokens = 0
    done = 0
    body = {"model": "sim-small", "max_tokens": HTTP_OUTPUT, "sim": {"output_tokens": HTTP_OUTPUT},
            # 'hello' repeated: one token per word in cl100k_base, plus the chat overhead
            "messages": [{"role": "user", "content": " ".join(["hello"] * (HTTP_PROMPT - 8))}]}
    # Count what completes after a warm-up instant, over the time since it:
    # in steady state the requests cut at either end cancel out.
    warm_until = time.monotonic() + min(1.0, duration_real / 4)

    async def step(c: int, i: int) -> None:
        nonlocal tokens, done
        response = await client.post("/v1/chat/completions", body)
        if response.status == 200 and time.monotonic() >= warm_until:
            tokens += response.json()["usage"]["completion_tokens"]
            done += 1

    await closed_loop(concurrency, duration_real, step)
    elapsed = time.monotonic() - warm_until
    await client.aclose()
    return {"concurrency": concurrency, "requests": done,
            "output_tokens_per_sim_s": tokens / HTTP_SCALE.sim_s(elapsed) if elapsed > 0 else None}


def _http(services: Services, seed: int, quick: bool) -> list[dict]:
    duration = 1.5 if quick else 6.0
    with Platform(services, NAME) as platform:
        platform.start_sim(["--time-scale", str(HTTP_SCALE.factor), "--seed", str(seed)])
        measured = [asyncio.run(_http_level(platform.sim_url, c, duration)) for c in HTTP_LEVELS]
        platform.assert_alive()
    model = {p.concurrency: p for p in sweep(SimConfig(), list(HTTP_LEVELS), HTTP_PROMPT, HTTP_OUTPUT,
                                              duration_s=300, warmup_s=30)}
    for m in measured:
        m["model_output_tokens_per_s"] = model[m["concurrency"]].output_tokens_per_s
    return measured


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    t = time.monotonic()
    virtual = _virtual()
    log(f"{NAME}: virtual-time sweeps in {time.monotonic() - t:.1f} s")
    own = services is None
    services = services or Services().up()
    try:
        http = _http(services, seed, quick)
    finally:
        if own:
            services.down()
    log(f"{NAME}: HTTP check at time scale {HTTP_SCALE.factor:g}: " + ", ".join(
        f"C={m['concurrency']} {m['output_tokens_per_sim_s']:.0f} vs model "
        f"{m['model_output_tokens_per_s']:.0f} tok/s" for m in http))
    data = {"scenario": NAME, "seed": seed, "quick": quick, "virtual": virtual, "http": http,
            "profiles": PROFILES, "published": {"nim_70b": NIM_70B, "nim_8b_shape": NIM_8B_SHAPE, "a100_8b": A100_8B},
            "http_scale": HTTP_SCALE.factor, "http_lengths": [HTTP_PROMPT, HTTP_OUTPUT],
            "clock": "simulated seconds (virtual time; the HTTP check converts wall clock x time scale)"}
    write_result(NAME, data)
    return data


def summarize(data: dict) -> str:
    sim = {p["concurrency"]: p for p in data["virtual"]["h100x2-llama3-70b"]}
    rows = []
    for c, ttft, itl, tput in data["published"]["nim_70b"]["points"]:
        s = sim.get(c)
        rows.append([c, fmt(tput, 0), fmt(s and s["output_tokens_per_s"], 0), fmt(itl, 1), fmt(s and s["itl_ms_mean"], 1),
                     fmt(ttft, 0), fmt(s and s["ttft_ms_mean"], 0)])
    s8 = {p["concurrency"]: p for p in data["virtual"]["a100-llama3-8b"]}
    a100 = data["published"]["a100_8b"]["points"]
    http_rows = [[m["concurrency"], fmt(m["model_output_tokens_per_s"], 0), fmt(m["output_tokens_per_sim_s"], 0),
                  f"{(m['output_tokens_per_sim_s'] / m['model_output_tokens_per_s'] - 1):+.1%}"
                  if m["output_tokens_per_sim_s"] and m["model_output_tokens_per_s"] else "n/a"]
                 for m in data["http"]]
    demo = data["virtual"]["demo"]
    lines = [
        "Engine model in virtual time against NVIDIA's published NIM sweep for Llama-3.3-70B fp8 on 2 x H100 "
        "(5,000 prompt / 500 output tokens), profile `h100x2-llama3-70b`:",
        "",
        md_table(["concurrency", "published tok/s", "sim tok/s", "published ITL ms", "sim ITL ms",
                  "published TTFT ms", "sim TTFT ms"], rows),
        "",
        f"Profile `a100-llama3-8b` (1,024/128): sim {fmt(s8[1]['output_tokens_per_s'], 0)} tok/s at concurrency 1 "
        f"(published ~{a100[0][1]:.0f}), {fmt(s8[8]['output_tokens_per_s'], 0)} at 8 (published ~{a100[1][1]:.0f}, "
        f"i.e. **{s8[8]['output_tokens_per_s'] / s8[1]['output_tokens_per_s']:.1f}x** vs 6.6x), "
        f"{fmt(s8[64]['output_tokens_per_s'], 0)} at 64.",
        "",
        "The `demo` profile (the bench scenarios' engine: 16 slots, 20 ms + 0.5 ms/sequence steps) at 256/128: "
        + ", ".join(f"C={p['concurrency']}: {p['output_tokens_per_s']:.0f} tok/s, ITL {p['itl_ms_mean']:.0f} ms, "
                    f"TTFT {p['ttft_ms_mean']:.0f} ms" for p in demo if p["concurrency"] in (1, 8, 16, 32, 48)) + ".",
        "",
        f"The running HTTP simulator (demo profile, time scale {data['http_scale']:g}, "
        f"{data['http_lengths'][0]}/{data['http_lengths'][1]} tokens) against the model, output tokens per "
        "simulated second:",
        "",
        md_table(["concurrency", "model", "HTTP server", "difference"], http_rows),
    ]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import DPI

    pub = data["published"]["nim_70b"]["points"]
    sim = data["virtual"]["h100x2-llama3-70b"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = [("output tokens/s", 3, "output_tokens_per_s"), ("ITL, ms", 2, "itl_ms_mean"),
              ("TTFT, ms (log)", 1, "ttft_ms_mean")]
    for ax, (label, col, key) in zip(axes, panels):
        ax.plot([p[0] for p in pub], [p[col] for p in pub], "o-", label="NIM published (70B fp8, 2xH100)")
        ax.plot([p["concurrency"] for p in sim], [p[key] for p in sim], "s--", label="inference_sim model")
        ax.set_xlabel("concurrent requests")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        if "log" in label:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("Calibration: 5,000 prompt / 500 output tokens, throughput and latency against concurrency")
    fig.tight_layout()
    path = plots_dir / "calibration_70b.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    shapes = {
        "NIM 8B (published)": [(p[0], p[3], p[2]) for p in NIM_8B_SHAPE],
        "NIM 70B (published)": [(p[0], p[3], p[2]) for p in pub],
        "sim a100-llama3-8b": [(p["concurrency"], p["output_tokens_per_s"], p["itl_ms_mean"])
                               for p in data["virtual"]["a100-llama3-8b"]],
        "sim h100x2-llama3-70b": [(p["concurrency"], p["output_tokens_per_s"], p["itl_ms_mean"]) for p in sim],
        "sim demo (bench)": [(p["concurrency"], p["output_tokens_per_s"], p["itl_ms_mean"])
                             for p in data["virtual"]["demo"]],
    }
    for label, pts in shapes.items():
        style = "o-" if "published" in label else "s--"
        axes[0].plot([p[0] for p in pts], [p[1] / pts[0][1] for p in pts], style, label=label, ms=3)
        axes[1].plot([p[0] for p in pts], [p[2] / pts[0][2] for p in pts], style, label=label, ms=3)
    for ax, title in zip(axes, ("throughput / throughput at concurrency 1", "ITL / ITL at concurrency 1")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Shape: near-linear throughput gain, then a plateau; ITL flat, then rising")
    fig.tight_layout()
    path2 = plots_dir / "calibration_shape.png"
    fig.savefig(path2, dpi=DPI)
    plt.close(fig)
    return [path.name, path2.name]


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
