"""The cost of the request path (issues 9 and 33), one bill for the whole
platform: CPU time of every process the platform starts (web, every lane
worker process, the pacer, beat, and Redis when the bench started it) read
from /proc around a fixed number of requests, beside the simulator's own CPU
for the same number of direct calls in the same run.

The headline CPU per request includes the platform's idle CPU: a phase's
figure is all the CPU those processes used from its first request to a
fixed tail after its last answer, divided by its requests. Idle work
(heartbeats, beat, pacer and worker polls) is part of what a request costs
the host, and more of it when each call waits on a slow pool; the figure
with the idle rate taken off over the phase's wall time is kept as a
secondary column (``net_ms_per_request``).

* idle: the processes' CPU per second with no traffic over one minute (one
  period of beat's minute entries), reported on its own (as % of one core;
  target under 2 %);
* admitted: N non-streamed chat requests through the full path (CLIENTS
  closed-loop clients), once against the zero-latency simulator and once
  with each pool call taking POOL_LATENCY_MS (the simulator's per-request
  ``sim.latency_ms``: an asyncio sleep, no CPU);
* refused: N requests of a workload over its RPM (the fast path, 429s),
  with the same two bodies;
* direct: N requests straight to the simulator at each latency (its CPU
  per call: the work a request costs without Sluice);
* streamed: N/4 streamed requests through the full path (``stream`` with
  usage, STREAM_TOKENS tokens each: the chunks relayed through Redis and
  the web process), and as many straight to the simulator (its CPU per
  stream). Reported beside the targets, which are for non-streamed calls.

The machine's speed is stated with the figures: the seconds it takes for
10 million pure-Python additions (bench.common.machine_speed), and the
targets scaled by it (they are for a machine doing it in about 0.9 s).

With ``BENCH_PROFILE=1`` (or ``--profile`` alone) py-spy records the web
process and the interactive lane worker during the admitted and streamed
phases and the web process during the refused phase (``py-spy record --format raw``; root
or ptrace rights), and the result lists each one's top functions by
self-time and by inclusive time (bench/out/profile/*.txt keeps the raw
stacks). bench/PROFILE.md is the written-up profile that RESULTS.md
links to.

Run alone: ``python -m bench.cost --seed 1 [--profile]``."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import (OUT_DIR, PLOTS_DIR, fmt, log, machine_speed, md_table, pcts, ratio, run_standalone,
                          speed_line, speed_scaled, write_result)
from bench.http import HttpClient
from bench.load import timed_post, timed_stream
from bench.platform import Platform, Services
from bench.procs import CpuMeter, delta
from bench.seed import spine_setup

NAME = "cost"
CLIENTS = 10
PROFILE_DIR = OUT_DIR / "profile"
TARGET_ADMITTED_MS = 4.0
TARGET_REFUSED_MS = 0.5
TARGET_IDLE_CORE_PCT = 2.0
POOL_LATENCY_MS = 50  # the slow pool's time per call (the simulator sleeps it: no CPU)
STREAM_TOKENS = 16
TAIL_S = 0.25  # after a phase's last answer: what the workers finish after it (its ledger rows)


def _body(rng: random.Random, latency_ms: float = 0) -> dict:
    body = {"model": "sim-small", "max_tokens": 16,
            "messages": [{"role": "user", "content": f"Ping {rng.randrange(10**6)}: what is 2+2?"}]}
    if latency_ms:
        body["sim"] = {"latency_ms": latency_ms}
    return body


async def _fixed(base: str, headers: dict, n: int, rng: random.Random, kind: str,
                 latency_ms: float = 0) -> tuple[list, float]:
    """n requests over CLIENTS closed-loop clients; (calls, wall seconds).
    A kind that starts with "streamed" streams them; ``latency_ms`` is the
    simulator's sleep per call."""
    streamed = kind.startswith("streamed")
    client = HttpClient(base, max_connections=CLIENTS)
    streams = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=CLIENTS)) if streamed else None
    calls: list = []
    left = [n]
    t0 = time.monotonic()

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            if streams is not None:
                body = {**_body(rng), "max_tokens": STREAM_TOKENS, "sim": {"output_tokens": STREAM_TOKENS}}
                calls.append(await timed_stream(streams, f"{base}/v1/chat/completions", body, headers, kind, t0))
            else:
                calls.append(await timed_post(client, "/v1/chat/completions", _body(rng, latency_ms), headers, kind, t0,
                                              timeout=30))

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    elapsed = time.monotonic() - t0
    await client.aclose()
    if streams is not None:
        await streams.aclose()
    return calls, elapsed


class Profiler:
    """py-spy record of some processes while a phase runs."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("py-spy", path=os.path.dirname(sys.executable)) is not None
        self.running: list[tuple[str, subprocess.Popen]] = []

    def start(self, phase: str, targets: dict[str, int]) -> None:
        if not self.enabled:
            return
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
        exe = shutil.which("py-spy", path=os.path.dirname(sys.executable))
        for name, pid in targets.items():
            name = f"{phase}-{name}"
            out = PROFILE_DIR / f"{name}.txt"
            self.running.append((name, subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250", "--nonblocking", "--gil",
                 "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # py-spy attaches before the phase starts (its startup is not the phase's)

    def stop(self) -> dict[str, dict]:
        out = {}
        for name, proc in self.running:
            proc.send_signal(2)  # SIGINT: py-spy writes what it has
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            out[name] = profile_summary(PROFILE_DIR / f"{name}.txt")
        self.running.clear()
        return out


def _frame(frame: str) -> str:
    # raw frames read "function (<file>:<line>)"; keep the function and a short file name
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(where).parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    elif "lib" in parts:
        parts = parts[parts.index("lib") + 1:]
    else:
        parts = parts[-3:]
    return f"{name} ({'/'.join(parts)})"


IDLE_LEAVES = ("wait (threading.py)", "select (selectors.py)", "_worker (concurrent/futures/thread.py)",
               "poll (selectors.py)", "acquire", "sleep")


def profile_summary(path: Path, top: int = 15) -> dict:
    """Top functions by self and inclusive samples, over the samples where
    the process was on a CPU (py-spy's idle frames dropped)."""
    self_time: Counter = Counter()
    inclusive: Counter = Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {"samples": 0, "self": [], "inclusive": []}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        if not frames or any(frames[-1].startswith(idle) for idle in IDLE_LEAVES):
            continue
        n = int(count)
        total += n
        self_time[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    pct = (lambda c: round(100.0 * c / total, 1)) if total else (lambda c: 0.0)
    return {"samples": total, "self": [(f, pct(c)) for f, c in self_time.most_common(top)],
            "inclusive": [(f, pct(c)) for f, c in inclusive.most_common(top * 2)]}


def _commandstats(client, n: int) -> list[dict]:
    """Redis's own count of each command over a phase (INFO commandstats,
    reset before it), per request: which calls the path makes, and the
    server time each costs. The INFO call itself is left out."""
    rows = []
    for name, stat in client.info("commandstats").items():
        command = name.removeprefix("cmdstat_")
        calls = stat["calls"] - (1 if command == "info" else 0)
        if calls <= 0 or command == "config":
            continue
        rows.append({"command": command, "calls_per_request": calls / n, "usec_per_call": stat["usec_per_call"],
                     "usec_per_request": stat["usec"] / n})
    return sorted(rows, key=lambda row: -row["usec_per_request"])


def main(seed: int = 1, quick: bool = False, services: Services | None = None, profile: bool | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    profile = bool(os.environ.get("BENCH_PROFILE")) if profile is None else profile
    rng = random.Random(seed)
    speed = machine_speed()
    log(f"{NAME}: {speed_line(speed)}")
    n = 200 if quick else 2_000
    services.fresh_redis()
    platform = Platform(services, NAME)
    profiler = Profiler(profile)
    profiles: dict[str, dict] = {}
    try:
        spine = spine_setup(platform, name=NAME, seed=seed)
        open_wl, tight_wl = spine.open, spine.tight
        roots = {c.name: c.popen.pid for c in platform.children if c.name != "sim"}
        if services.redis_process is not None:
            roots["redis"] = services.redis_process.popen.pid
        meter = CpuMeter(roots)
        own_redis = services.redis_process is not None  # an external Redis's stats are not ours to reset
        sim = CpuMeter({"sim": next(c.popen.pid for c in platform.children if c.name == "sim")})
        open_auth = {"Authorization": f"Bearer {open_wl.api_key}"}
        tight_auth = {"Authorization": f"Bearer {tight_wl.api_key}"}
        # Warm every code path (imports, connection pools, cached contexts).
        asyncio.run(_fixed(platform.sluice_url, open_auth, 50, rng, "warm"))
        asyncio.run(_fixed(platform.sluice_url, tight_auth, 50, rng, "warm"))
        asyncio.run(_fixed(platform.sim_url, {}, 50, rng, "warm"))
        asyncio.run(_fixed(platform.sluice_url, open_auth, 20, rng, "streamed-warm"))

        # /proc counts CPU in ticks of 10 ms, per process: over 60 s each of the
        # nine processes' idle reads within about 0.17 ms per s of CPU. 60 s is
        # one whole period of beat's minute entries (the rollup, the spend
        # reconcile, the spike check), so the window holds each of them once:
        # a 30 s window held them or not, and read their cost twice or not at all.
        idle_s = 2.0 if quick else 60.0
        before = meter.read()
        time.sleep(idle_s)  # measuring the idle cost over a fixed span, not waiting on anything
        idle = {k: v / idle_s for k, v in delta(meter.read(), before).items()}
        log(f"{NAME}: idle {100 * sum(idle.values()):.2f} % of one core")

        def phase(base: str, auth: dict, kind: str, targets: dict[str, int], count: int = n,
                  latency_ms: float = 0) -> dict:
            profiler.start(kind, targets)
            if own_redis:
                services.redis.config_resetstat()
            before, sim_before = meter.read(), sim.read()
            calls, wall = asyncio.run(_fixed(base, auth, count, rng, kind, latency_ms))
            # A worker writes the ledger row and counts the departure after
            # it publishes the answer: the last answers' rows land in this
            # fixed tail, counted in the phase with the idle CPU of its span.
            time.sleep(TAIL_S)
            after, sim_after = meter.read(), sim.read()
            commands = _commandstats(services.redis, len(calls)) if own_redis else []
            profiles.update(profiler.stop())
            cpu = delta(after, before)
            net = {k: max(0.0, v - idle[k] * (wall + TAIL_S)) for k, v in cpu.items()}
            return {"n": len(calls), "wall_s": wall, "pool_latency_ms": latency_ms,
                    "statuses": dict(Counter(c.status for c in calls)),
                    "latency_ms": pcts([1000 * c.latency for c in calls]),
                    "cpu_s": cpu, "net_cpu_s": net,
                    # the headline: every CPU second of the phase, idle included
                    "ms_per_request": 1000 * sum(cpu.values()) / len(calls),
                    "net_ms_per_request": 1000 * sum(net.values()) / len(calls),
                    "sim_ms_per_request": 1000 * delta(sim_after, sim_before)["sim"] / len(calls),
                    "redis_commands": commands}

        admitted = phase(platform.sluice_url, open_auth, "admitted",
                         {"web": roots["web"], "worker": roots["worker-interactive"]})
        log(f"{NAME}: admitted {admitted['ms_per_request']:.2f} ms CPU per request")
        refused = phase(platform.sluice_url, tight_auth, "refused", {"web": roots["web"]})
        log(f"{NAME}: refused {refused['ms_per_request']:.2f} ms CPU per request")
        direct = phase(platform.sim_url, {}, "direct", {})
        log(f"{NAME}: direct: simulator {direct['sim_ms_per_request']:.2f} ms CPU per request")
        slow = {"admitted": phase(platform.sluice_url, open_auth, "admitted-slow",
                                  {"web": roots["web"], "worker": roots["worker-interactive"]},
                                  latency_ms=POOL_LATENCY_MS),
                "refused": phase(platform.sluice_url, tight_auth, "refused-slow", {}, latency_ms=POOL_LATENCY_MS),
                "direct": phase(platform.sim_url, {}, "direct-slow", {}, latency_ms=POOL_LATENCY_MS)}
        log(f"{NAME}: {POOL_LATENCY_MS} ms pool: admitted {slow['admitted']['ms_per_request']:.2f}, refused "
            f"{slow['refused']['ms_per_request']:.2f} ms CPU per request")
        streamed = phase(platform.sluice_url, open_auth, "streamed",
                         {"web": roots["web"], "worker": roots["worker-interactive"]}, count=n // 4)
        log(f"{NAME}: streamed {streamed['ms_per_request']:.2f} ms CPU per stream")
        streamed_direct = phase(platform.sim_url, {}, "streamed-direct", {}, count=n // 4)
        platform.assert_alive()
    finally:
        platform.stop()
        if own:
            services.down()
    data = {"scenario": NAME, "seed": seed, "quick": quick, "requests_per_phase": n, "clients": CLIENTS,
            "redis_counted": services.redis_process is not None, "idle_cpu_per_s": idle, "idle_s": idle_s,
            "idle_core_pct": 100 * sum(idle.values()), "speed": speed, "pool_latency_ms": POOL_LATENCY_MS,
            "admitted": admitted, "refused": refused, "direct": direct, "slow_pool": slow, "streamed": streamed,
            "streamed_direct": streamed_direct, "stream_tokens": STREAM_TOKENS, "profiles": profiles}
    write_result(NAME, data)
    return data


def verdict(value: float | None, target: float, scaled: float) -> str:
    """Against the nominal target and the one scaled to this machine's
    speed (stricter than nominal on a machine faster than the reference)."""
    if value is None:
        return "n/a"
    if value <= target and value <= scaled:
        return "met"
    if value <= scaled:
        return "met at this machine's speed, missed nominally"
    if value <= target:
        return "met nominally, missed at this machine's speed"
    return "missed"


def headline(data: dict) -> dict:
    """The figures the targets are about (the summary table's row)."""
    speed_s = data["speed"]["wall_s"]
    slow = data.get("slow_pool") or {}
    admitted = max(data["admitted"]["ms_per_request"], (slow.get("admitted") or {}).get("ms_per_request", 0))
    refused = max(data["refused"]["ms_per_request"], (slow.get("refused") or {}).get("ms_per_request", 0))
    return {"admitted": admitted, "refused": refused, "idle_core_pct": data["idle_core_pct"],
            "admitted_verdict": verdict(admitted, TARGET_ADMITTED_MS, speed_scaled(TARGET_ADMITTED_MS, speed_s)),
            "refused_verdict": verdict(refused, TARGET_REFUSED_MS, speed_scaled(TARGET_REFUSED_MS, speed_s)),
            "idle_verdict": "met" if data["idle_core_pct"] < TARGET_IDLE_CORE_PCT else "missed"}


def summarize(data: dict) -> str:
    a, r, d = data["admitted"], data["refused"], data["direct"]
    slow = data.get("slow_pool") or {}
    sa, sr, sd_ = slow.get("admitted"), slow.get("refused"), slow.get("direct")
    latency = data.get("pool_latency_ms", POOL_LATENCY_MS)
    speed_s = data["speed"]["wall_s"]
    procs = sorted(a["cpu_s"])

    def per(phase: dict | None, p: str, key: str = "cpu_s", digits: int = 2) -> str:
        return fmt(1000 * phase[key][p] / phase["n"], digits) if phase else "n/a"

    def total(phase: dict | None, key: str = "ms_per_request", digits: int = 2) -> str:
        return fmt(phase[key], digits) if phase else "n/a"

    rows = [[p, per(a, p), per(sa, p), per(r, p, digits=3), per(sr, p, digits=3),
             fmt(data["idle_cpu_per_s"][p] * 1000, 1)] for p in procs]
    rows.append(["**all Sluice processes, idle included**", f"**{total(a)}**", f"**{total(sa)}**",
                 f"**{total(r, digits=3)}**", f"**{total(sr, digits=3)}**",
                 f"**{fmt(sum(data['idle_cpu_per_s'].values()) * 1000, 1)}**"])
    rows.append(["all Sluice processes, idle subtracted", total(a, "net_ms_per_request"),
                 total(sa, "net_ms_per_request"), total(r, "net_ms_per_request", 3),
                 total(sr, "net_ms_per_request", 3), ""])
    rows.append(["simulator, direct call (same run, same latency)", total(d, "sim_ms_per_request"),
                 total(sd_, "sim_ms_per_request"), "", "", ""])
    web_refusals_per_s = r["n"] / max(1e-9, r["cpu_s"].get("web", 0.0))
    redis_note = "counted (started by the bench)" if data["redis_counted"] else "not counted (external, shared)"
    h = headline(data)
    scaled_a, scaled_r = speed_scaled(TARGET_ADMITTED_MS, speed_s), speed_scaled(TARGET_REFUSED_MS, speed_s)
    lines = [
        f"Machine: {speed_line(data['speed'])}.",
        "",
        f"{data['requests_per_phase']} requests per phase, {data['clients']} closed-loop clients, against the "
        f"zero-latency simulator and against one whose every call takes {latency} ms; CPU time (user + system) "
        "from /proc of each process tree over the phase (first request to a fixed tail after the last answer), "
        f"idle CPU included. Redis {redis_note}; PostgreSQL and the load generator not counted.",
        "",
        md_table(["process", "ms CPU per admitted request, 0 ms pool", f"… {latency} ms pool",
                  "ms CPU per refusal, 0 ms pool", f"… {latency} ms pool", "idle ms CPU per s"], rows),
        "",
        f"Idle, the whole platform with no traffic, over {fmt(data.get('idle_s', 30), 0)} s: "
        f"**{fmt(data['idle_core_pct'], 2)} % of one core** "
        f"(target < {TARGET_IDLE_CORE_PCT:g} %: {h['idle_verdict']}).",
        "",
        md_table(["target (scaled to this machine's speed)", "0 ms pool", f"{latency} ms pool", "verdict"], [
            [f"≤ {TARGET_ADMITTED_MS:g} ms ({fmt(scaled_a, 2)} ms) CPU per admitted request",
             f"**{total(a)} ms** ({fmt(ratio(a['ms_per_request'], d['sim_ms_per_request']), 1)}× the simulator's "
             "per direct call)",
             f"**{total(sa)} ms**" + (f" ({fmt(ratio(sa['ms_per_request'], sd_['sim_ms_per_request']), 1)}×)"
                                      if sa and sd_ else ""),
             h["admitted_verdict"]],
            [f"≤ {TARGET_REFUSED_MS:g} ms ({fmt(scaled_r, 3)} ms) CPU per refusal",
             f"**{total(r, digits=3)} ms** (one web process's CPU refuses {fmt(web_refusals_per_s, 0)} per s)",
             f"**{total(sr, digits=3)} ms**", h["refused_verdict"]],
        ]),
        "",
        f"Statuses: admitted {a['statuses']}, refused {r['statuses']}, direct {d['statuses']}; wall time "
        f"{a['wall_s']:.1f} / {r['wall_s']:.1f} / {d['wall_s']:.1f} s.",
    ]
    if sa and sr and sd_:
        lines += ["", f"With the {latency} ms pool: admitted {sa['statuses']} (p50 "
                  f"{fmt(sa['latency_ms']['p50'], 1)} ms), refused {sr['statuses']}, direct {sd_['statuses']} (p50 "
                  f"{fmt(sd_['latency_ms']['p50'], 1)} ms); wall time {sa['wall_s']:.1f} / {sr['wall_s']:.1f} / "
                  f"{sd_['wall_s']:.1f} s."]
    s, sd = data.get("streamed"), data.get("streamed_direct")
    if s and sd:
        lines += ["", f"Streamed (not a target: reported beside them): {s['n']} streams of {data['stream_tokens']} "
                  f"tokens with usage, {data['clients']} closed-loop clients. CPU per stream, all Sluice processes, "
                  f"idle included: **{fmt(s['ms_per_request'], 2)} ms** ("
                  + ", ".join(f"{p} {fmt(1000 * v / s['n'], 2)}" for p, v in sorted(s["cpu_s"].items())
                              if 1000 * v / s["n"] >= 0.01)
                  + f"); the simulator's own per direct stream {fmt(sd['sim_ms_per_request'], 2)} ms. Statuses "
                  f"{s['statuses']} / {sd['statuses']}; wall time {s['wall_s']:.1f} / {sd['wall_s']:.1f} s."]
    commands = a.get("redis_commands") or []
    if commands:
        lines += ["", "Redis's own count of its commands in the admitted phase (INFO commandstats), per request:", "",
                  md_table(["command", "calls per request", "µs per call", "µs per request"],
                           [[f"`{c['command']}`", fmt(c["calls_per_request"], 2), fmt(c["usec_per_call"], 1),
                             fmt(c["usec_per_request"], 1)] for c in commands[:12]])]
    for name, prof in (data.get("profiles") or {}).items():
        if not prof.get("samples"):
            continue
        lines += ["", f"py-spy, {name} ({prof['samples']} on-CPU samples), top self-time:", "",
                  md_table(["function", "% self"], [[f"`{f}`", p] for f, p in prof["self"][:10]])]
    # The written-up profile and its history live in one place, linked, not copied.
    lines += ["", "Where the CPU goes and what was changed for it, round by round: [PROFILE.md](PROFILE.md)."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    return []


if __name__ == "__main__":
    if "--profile" in sys.argv:
        sys.argv.remove("--profile")
        os.environ["BENCH_PROFILE"] = "1"
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
