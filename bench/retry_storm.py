"""Scenario 4, retry storm: a 60 s outage of the pool, with naive clients.

User operations arrive at 8 per simulated second (80% of the provider's
600 RPM). Each is one chat call made by a naive client: up to 3 attempts,
exponential backoff without jitter (2 s, then 4 s), any error retried,
Retry-After ignored. From 60 s to 120 s of simulated time the pool answers
503 to everything (``--schedule`` outage), then recovers.

Two runs on a fresh simulator each: the clients straight to the pool, and
the same clients through Sluice. Reported: client attempts per operation,
attempts that reached the pool per operation (the simulator's request
counter: what the pool had to absorb), operations that failed, and time to
recover after the outage (until 95% of the operations that start in a 5 s
bin succeed again). Simulated time; Sluice's retry/capacity time constants
are scaled to it. Run alone: ``python -m bench.retry_storm``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, ratio, run_standalone, write_result
from bench.http import HttpClient, TransportError
from bench.load import Sampler, open_loop
from bench.platform import Platform, Services, time_scaled_env
from bench.seed import config_push, scaled_pool, scaled_workload
from bench.workload import short_call
from budgets.admission.keys import pool_leases as pool_leases_key
from gateway.core.keys import pool_circuit as pool_circuit_key
from gateway.core.keys import pool_held as pool_held_key
from gateway.core.lanes import queue_for_lane

NAME = "retry_storm"
SCALE = TimeScale(4.0)
POOL_RPM, POOL_TPM = 600, 200_000
OPS_PER_S = 8.0
ATTEMPTS = 3
BACKOFF_S = 2.0  # simulated: 2 s, then 4 s
SIM_ARGS = ["--slots", "32", "--rpm", str(POOL_RPM), "--tpm", str(POOL_TPM)]
BIN_S = 5.0
QUEUE_TIMEOUT_S = 30.0  # the workload's: how long one attempt may be held


@dataclass(frozen=True)
class Timeline:
    """The outage's start and end and the run's length, simulated seconds."""
    outage_start: float
    outage_end: float
    total: float


FULL = Timeline(outage_start=60.0, outage_end=120.0, total=200.0)
# A smoke test's size (--quick): a shorter outage with less before and after
# it; its numbers say the scenario runs, not how it comes out.
QUICK = Timeline(outage_start=15.0, outage_end=30.0, total=45.0)


@dataclass
class Operation:
    start: float  # real seconds from t0
    attempts: list[tuple[float, int, str | None]] = field(default_factory=list)  # (start, status, code)
    end: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1][1] == 200


async def _naive_op(client: HttpClient, path: str, headers: dict, body: dict, t0: float) -> Operation:
    op = Operation(start=time.monotonic() - t0)
    for attempt in range(ATTEMPTS):
        at = time.monotonic() - t0
        try:
            response = await client.post(path, body, headers, timeout=SCALE.real_s(120))
            status, code = response.status, response.error_code
        except TransportError:
            status, code = 0, "transport"
        op.attempts.append((at, status, code))
        if status == 200:
            break
        if attempt < ATTEMPTS - 1:
            await asyncio.sleep(SCALE.real_s(BACKOFF_S * 2 ** attempt))  # no jitter, Retry-After ignored
    op.end = time.monotonic() - t0
    return op


async def _drive(base: str, sim_url: str, headers: dict, seed: int, total_sim: float, redis_client=None,
                 pool_id: int | None = None) -> tuple[list[Operation], list[dict]]:
    client = HttpClient(base, max_connections=512, timeout=600)
    sim = HttpClient(sim_url, max_connections=2)
    await sim.post("/admin/reset", {})  # the schedule (outage) counts from here
    rng = random.Random(seed)
    ops: list[Operation] = []
    t0 = time.monotonic()

    async def probe() -> dict:
        stats = (await sim.get("/admin/stats")).json()
        sample = {"sim_requests": stats["requests_total"], "sim_completed": stats["completed"],
                  "sim_429": stats["rejected_429"], "sim_running": stats["running"], "sim_queued": stats["queued"]}
        if pool_id is not None:  # Sluice's adaptive capacity factor (budgets.keys.pool_capacity)
            capacity = redis_client.hgetall(f"sluice:{{pool:{pool_id}}}:capacity")
            sample["capacity_factor"] = float(capacity.get("factor", 1.0)) if capacity else 1.0
            sample["circuit"] = redis_client.hget(pool_circuit_key(pool_id), "state") or "closed"
            # The backlog: admitted requests not yet answered (a lease each), those
            # of them held off their lane (gateway/core/protection/held.py) and still in the
            # lane's queue, and the room the gateway counts in the provider's window.
            seconds, micros = redis_client.time()
            sample["queued"] = redis_client.llen(queue_for_lane("interactive"))
            sample["held"] = redis_client.zcard(pool_held_key(pool_id))
            sample["in_flight"] = redis_client.zcount(pool_leases_key(pool_id), seconds * 1000 + micros / 1000, "+inf")
            room = (capacity or {}).get("prov_rem_req")
            sample["provider_room_req"] = float(room) if room is not None else None
        return sample

    sampler = Sampler(probe, 0.25, t0).start()

    async def fire(i: int) -> None:
        ops.append(await _naive_op(client, "/v1/chat/completions", headers, short_call(rng).body, t0))

    await open_loop(SCALE.real_rate(OPS_PER_S), SCALE.real_s(total_sim), fire, poisson=True,
                    rng=random.Random(seed + 7))
    final = await probe()
    samples = await sampler.stop()
    samples.append({**final, "t": time.monotonic() - t0})
    await client.aclose()
    await sim.aclose()
    return ops, samples


def _run(services: Services, system: str, seed: int, timeline: Timeline) -> dict:
    services.fresh_redis()
    schedule = [{"at_s": timeline.outage_start, "outage_s": timeline.outage_end - timeline.outage_start,
                 "outage_status": 503}]
    with Platform(services, f"{NAME}-{system}") as platform:
        platform.start_sim(["--time-scale", str(SCALE.factor), "--seed", str(seed), *SIM_ARGS,
                            "--schedule", json.dumps(schedule)])
        headers: dict[str, str] = {}
        base = platform.sim_url
        pool_id = None
        if system == "sluice":
            pool = scaled_pool(scale=SCALE, slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1",
                               provider_tpm=POOL_TPM, provider_rpm=POOL_RPM, headroom=0.9, burst_seconds=5.0)
            app = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-app", workload_class="interactive",
                                  reserved_tpm=100_000, ceiling_tpm=150_000, rpm=530, queue_timeout_s=QUEUE_TIMEOUT_S,
                                  prompt_tokens_cap=2_000, max_tokens_cap=256, max_tokens_default=64)
            config_push(pool)
            platform.start_sluice(lanes={"interactive": 32, "interactive-long": 2, "batch": 4, "scheduled": 1},
                                  extra_env=time_scaled_env(SCALE.factor))
            headers = {"Authorization": f"Bearer {app.api_key}"}
            base = platform.sluice_url
            pool_id = pool.id
        log(f"{NAME}: naive clients {'through Sluice' if system == 'sluice' else 'straight to the pool'}")
        ops, samples = asyncio.run(_drive(base, platform.sim_url, headers, seed, timeline.total, services.redis,
                                          pool_id))
        platform.assert_alive()
    return {"ops": ops, "samples": samples}


def _analyse_run(run: dict, timeline: Timeline) -> dict:
    f = SCALE.factor
    ops: list[Operation] = run["ops"]
    samples = [s for s in run["samples"] if "error" not in s]
    n = len(ops)
    attempts = sum(len(op.attempts) for op in ops)
    pool_requests = samples[-1]["sim_requests"] if samples else 0
    failed = sum(not op.ok for op in ops)
    outage_start, outage_end, total_sim = timeline.outage_start, timeline.outage_end, timeline.total
    bins_t = [i * BIN_S for i in range(int(total_sim // BIN_S) + 1)]
    started, succeeded, att = [0] * len(bins_t), [0] * len(bins_t), [0] * len(bins_t)
    for op in ops:
        i = int(op.start * f // BIN_S)
        if 0 <= i < len(bins_t):
            started[i] += 1
            succeeded[i] += op.ok
        for at, _, _ in op.attempts:
            j = int(at * f // BIN_S)
            if 0 <= j < len(bins_t):
                att[j] += 1
    # Pool arrivals per bin from the simulator's counter.
    pool_bins = [0] * len(bins_t)
    prev = 0
    for s in samples:
        j = int(s["t"] * f // BIN_S)
        if 0 <= j < len(bins_t):
            pool_bins[j] += max(0, s["sim_requests"] - prev)
        prev = s["sim_requests"]
    success = [succeeded[i] / started[i] if started[i] else None for i in range(len(bins_t))]
    # Recovered: from the first bin after the outage whose operations, and
    # those of every later full bin, succeed at >= 95%. None: not by the end.
    full = [i for i, t in enumerate(bins_t) if t >= outage_end and t + BIN_S <= total_sim and success[i] is not None]
    recover = None
    for k, i in enumerate(full):
        if all(success[j] >= 0.95 for j in full[k:]):
            recover = bins_t[i] - outage_end
            break
    codes: dict[str, int] = {}
    for op in ops:
        for _, status, code in op.attempts:
            if status != 200:
                codes[code or f"http_{status}"] = codes.get(code or f"http_{status}", 0) + 1
    during = [op for op in ops if outage_start <= op.start * f < outage_end]
    # Failed operations by when they started, and what refused their last attempt.
    failed_by_phase: dict[str, dict] = {}
    for phase, lo, hi in (("before", 0.0, outage_start), ("outage", outage_start, outage_end),
                          ("after", outage_end, float("inf"))):
        of_phase = [op for op in ops if lo <= op.start * f < hi]
        last: dict[str, int] = {}
        for op in of_phase:
            if not op.ok and op.attempts:
                code = op.attempts[-1][2] or f"http_{op.attempts[-1][1]}"
                last[code] = last.get(code, 0) + 1
        failed_by_phase[phase] = {"ops": len(of_phase), "failed": sum(not op.ok for op in of_phase),
                                  "last_refusal": last}
    # At the circuit's close: the backlog, what the pool took in the 30 s
    # after, and how long the gateway then counted no room in the provider's
    # window (its door refuses provider_rpm meanwhile).
    after_close = [s for s in samples if "queued" in s and s["t"] * f >= outage_end and s.get("circuit") == "closed"]
    at_close = after_close[0] if after_close else None
    took = None
    full_from = full_to = None
    if at_close:
        later = [s for s in samples if s["t"] >= at_close["t"] and (s["t"] - at_close["t"]) * f <= 30.0]
        took = later[-1]["sim_requests"] - at_close["sim_requests"] if later else None
        for s in after_close:
            if s.get("provider_room_req") is not None and s["provider_room_req"] <= 0:
                full_from = full_from if full_from is not None else s["t"] * f
                full_to = s["t"] * f
            elif full_from is not None:
                break
    backlog = {"queued": at_close["queued"], "held": at_close.get("held", 0), "in_flight": at_close["in_flight"],
               "at_s": round(at_close["t"] * f, 1),
               "pool_calls_next_30s": took, "provider_full_s": [full_from, full_to]} if at_close else None
    return {
        "backlog_at_close": backlog,
        "ops": n, "attempts": attempts, "attempts_per_op": attempts / n if n else None,
        "pool_requests": pool_requests, "pool_attempts_per_op": pool_requests / n if n else None,
        "failed_ops": failed, "failed_fraction": failed / n if n else None,
        "ops_during_outage": len(during),
        "attempts_per_op_during_outage": (sum(len(op.attempts) for op in during) / len(during)) if during else None,
        "time_to_recover_s": recover, "error_codes": codes, "failed_by_phase": failed_by_phase,
        "capacity_factor": [(round(s["t"] * f, 2), s["capacity_factor"]) for s in samples if "capacity_factor" in s],
        "circuit": [(round(s["t"] * f, 2), s["circuit"]) for s in samples if "circuit" in s],
        "circuit_closed_after_s": next((s["t"] * f - outage_end for s in samples
                                        if s["t"] * f >= outage_end and s.get("circuit") == "closed"), None),
        "circuit_opened_after_s": next((s["t"] * f - outage_start for s in samples
                                        if s["t"] * f >= outage_start and s.get("circuit") == "open"), None),
        "bins": {"t": bins_t, "ops_started": started, "ops_ok": succeeded, "client_attempts": att,
                 "pool_requests": pool_bins, "success_rate": success},
    }


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    timeline = QUICK if quick else FULL
    runs = {}
    try:
        for system in ("direct", "sluice"):
            runs[system] = _analyse_run(_run(services, system, seed, timeline), timeline)
            r = runs[system]
            log(f"{NAME}: {system}: {r['attempts_per_op']:.2f} attempts/op, {r['pool_attempts_per_op']:.2f} pool "
                f"attempts/op, {r['failed_fraction']:.1%} ops failed, recovered after {r['time_to_recover_s']} s")
    finally:
        if own:
            services.down()
    data = {"scenario": NAME, "seed": seed, "quick": quick, "time_scale": SCALE.factor, "sim_args": SIM_ARGS,
            "ops_per_s": OPS_PER_S, "attempts": ATTEMPTS, "backoff_s": BACKOFF_S,
            "outage": [timeline.outage_start, timeline.outage_end], "total_sim_s": timeline.total, "bin_s": BIN_S,
            "clock": "simulated seconds", "runs": runs}
    write_result(NAME, data)
    return data


def summarize(data: dict) -> str:
    d, s = data["runs"]["direct"], data["runs"]["sluice"]
    target_ok = s["pool_attempts_per_op"] is not None and s["pool_attempts_per_op"] <= 1.1
    failed_ratio = ratio(s["failed_fraction"], d["failed_fraction"])
    recover_gap = (s["time_to_recover_s"] - (d["time_to_recover_s"] or 0.0)
                   if s["time_to_recover_s"] is not None else None)
    rows = []
    for label, r in (("naive clients → pool", d), ("naive clients → Sluice → pool", s)):
        rows.append([label, r["ops"], fmt(r["attempts_per_op"], 2), f"**{fmt(r['pool_attempts_per_op'], 2)}**",
                     fmt(r["attempts_per_op_during_outage"], 2), f"{r['failed_fraction']:.1%}",
                     (fmt(r["time_to_recover_s"], 0) + " s") if r["time_to_recover_s"] is not None
                     else "not by the end of the run"])
    start, end = data["outage"]
    lines = [
        f"Operations arrive at {data['ops_per_s']:g}/s (Poisson) for {data['total_sim_s']:.0f} s; the provider "
        f"(`{' '.join(data['sim_args'])}`) answers 503 to everything from {start:.0f} s to {end:.0f} s. Naive "
        f"client: {data['attempts']} attempts, backoff {data['backoff_s']:g} s x 2^n without jitter, Retry-After "
        f"ignored. Time scale {data['time_scale']:g}; simulated time.",
        "",
        md_table(["path", "operations", "client attempts/op", "pool attempts/op", "client attempts/op (outage)",
                  "failed ops", "time to recover"], rows),
        "",
        md_table(["check", "value", "target"], [
            ["pool attempts per operation through Sluice", f"**{fmt(s['pool_attempts_per_op'], 2)}**",
             f"≤ 1.1: {'met' if target_ok else 'missed'}"],
            ["pool attempts per operation, direct", fmt(d["pool_attempts_per_op"], 2), ""],
            ["reduction in load on the pool (direct / Sluice)",
             fmt(ratio(d["pool_requests"], s["pool_requests"]), 2), ""],
            ["failed operations, Sluice / direct", f"**{fmt(failed_ratio, 2)}**",
             f"≤ 0.5: {'n/a' if failed_ratio is None else 'met' if failed_ratio <= 0.5 else 'missed'}"],
            ["time to recover, Sluice − direct (95% of a bin's operations succeed, and every later bin's)",
             f"**{fmt(recover_gap, 0)} s**" if recover_gap is not None else "**not by the end of the run**",
             f"≤ 5 s: {'met' if recover_gap is not None and recover_gap <= 5 else 'missed'}"],
            ["circuit breaker: opened after the outage began / closed (half-open trial succeeded) after it ended",
             f"{fmt(s.get('circuit_opened_after_s'), 1)} s / **{fmt(s.get('circuit_closed_after_s'), 1)} s**", ""],
        ]),
        "",
        f"Error codes seen by the clients: direct {d['error_codes']}; through Sluice {s['error_codes']}.",
    ]
    sb = s["bins"]
    outage_ok = sum(ok for t, ok in zip(sb["t"], sb["ops_ok"]) if start <= t < end)
    outage_started = sum(n for t, n in zip(sb["t"], sb["ops_started"]) if start <= t < end)
    after = [(t, r) for t, r in zip(sb["t"], sb["success_rate"]) if t >= end and r is not None]
    worst = min(after, key=lambda x: x[1]) if after else None
    backlog = s.get("backlog_at_close")
    if backlog:
        full_from, full_to = backlog["provider_full_s"]
        lines += ["", f"The backlog: at the circuit's close ({backlog['at_s']:.0f} s, "
                  f"{fmt(s.get('circuit_closed_after_s'), 1)} s after the provider recovered) "
                  f"{backlog['in_flight']} admitted requests were unanswered, {backlog.get('held', 0)} of them held "
                  f"off their lane (gateway/core/protection/held.py) and {backlog['queued']} on it; the pool took "
                  f"{backlog['pool_calls_next_30s']} calls in the 30 s after the close (its window holds {POOL_RPM} a "
                  f"minute, new operations need {OPS_PER_S * 60:.0f})"
                  + (f"; from {full_from:.0f} s to {full_to:.0f} s the gateway counted no room left in the "
                     f"provider's window, its door refusing new operations (provider_rpm)" if full_from is not None
                     else "; the gateway never counted the provider's window full")
                  + f". {outage_ok} of the {outage_started} operations that started during the outage succeeded; "
                  f"the worst bin after it: "
                  + (f"{worst[1]:.0%} of the operations starting at {worst[0]:.0f} s succeeded." if worst else "n/a.")]
    phases = s.get("failed_by_phase")
    if phases:
        total_sim = data["total_sim_s"]
        per_s = POOL_RPM / 60
        spare_calls = (per_s - data["ops_per_s"]) * (total_sim - end)
        # The longest a naive operation lives: each attempt held to the queue
        # timeout, plus the backoffs between them.
        lifetime = data["attempts"] * QUEUE_TIMEOUT_S + sum(data["backoff_s"] * 2 ** n
                                                             for n in range(data["attempts"] - 1))
        tail_calls = per_s * max(0.0, end + lifetime - total_sim)
        outage_ops = phases["outage"]["ops"]
        floor = max(0.0, outage_ops - spare_calls - tail_calls)
        lines += ["", "Failed operations through Sluice by when they started (what refused the last attempt): "
                  + "; ".join(f"{name} {p['failed']} of {p['ops']} {p['last_refusal'] or ''}".rstrip()
                              for name, p in phases.items()) + ".",
                  "",
                  f"What the provider's capacity allows, in numbers: its sliding window takes {POOL_RPM} calls a "
                  f"minute and new operations need {data['ops_per_s'] * 60:.0f}, so while arrivals last "
                  f"({total_sim - end:.0f} s after the outage) about {spare_calls:.0f} calls are spare for the "
                  f"{outage_ops} operations of the outage, and after arrivals stop another {tail_calls:.0f} before "
                  f"the last of them gives up ({lifetime:.0f} s after it started: {data['attempts']} attempts of at "
                  f"most the workload's {QUEUE_TIMEOUT_S:.0f} s queue timeout and the backoffs). Recovering as fast "
                  f"as direct (new work first) therefore fails at least {floor:.0f} operations of the outage, "
                  f"{ratio(floor, d['failed_ops']) or 0:.2f}x direct's failures, and only if every held operation "
                  f"were kept alive for its whole life: Sluice holds each attempt up to the queue timeout, and a "
                  f"naive client's next attempt, the same body, is held again (the queue_timeout answers above)."]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import timeseries

    start, end = data["outage"]
    names = []
    lines = {}
    for label, key in (("direct", "direct"), ("through Sluice", "sluice")):
        b = data["runs"][key]["bins"]
        per_s = [v / data["bin_s"] for v in b["pool_requests"]]
        lines[f"{label}: requests reaching the pool /s"] = (b["t"], per_s)
        lines[f"{label}: client attempts /s"] = (b["t"], [v / data["bin_s"] for v in b["client_attempts"]])
    path = plots_dir / "retry_storm_attempts.png"
    timeseries(lines, path, title="Retry storm: attempts per simulated second", xlabel="simulated s",
               ylabel="attempts / s", step=True, hlines={"user operations /s": data["ops_per_s"]},
               spans=[(start, end, "outage")])
    names.append(path.name)
    lines = {}
    for label, key in (("direct", "direct"), ("through Sluice", "sluice")):
        b = data["runs"][key]["bins"]
        pts = [(t, s) for t, s in zip(b["t"], b["success_rate"]) if s is not None]
        lines[label] = ([p[0] for p in pts], [p[1] for p in pts])
    cap = data["runs"]["sluice"].get("capacity_factor") or []
    if cap:
        lines["Sluice adaptive capacity factor"] = ([c[0] for c in cap], [c[1] for c in cap])
    path = plots_dir / "retry_storm_success.png"
    timeseries(lines, path, title="Retry storm: operations that succeed (by start time)",
               xlabel="simulated s", ylabel="success rate / capacity factor", step=True, spans=[(start, end, "outage")])
    names.append(path.name)
    return names


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
