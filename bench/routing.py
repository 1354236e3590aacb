"""Scenario 12, routing across pools: spill-over, fail-over and replicas
(issue 32; docs/architecture.md, "Routing across pools").

Three parts on one Sluice, each pool its own simulator process:

1. Spill-over. A primary pool whose provider allows 40k TPM (admission
   budget 32k after the 0.8 headroom) and an overflow pool priced higher
   (its own ModelPrice). One workload holds the whole primary budget as its
   primary slice and a 32k slice on the overflow (rank 1), and offers 1.5x
   the primary's budget (~170-token chats, Poisson). Targets: no 429 reaches
   a caller; the primary serves >= 90% of its admission budget (only the
   excess spills); each pool's ledger cost equals its ledger tokens times
   that pool's price, computed here from the prices the scenario set.
2. Fail-over. A primary and an overflow pool; the primary answers 503 for
   60 s (its simulator's ``--schedule`` outage), then recovers, under 8
   short chats per second. Targets: the callers are served by the overflow
   within 5 s of the outage's start, <= 1.1 pool attempts per operation
   (both simulators' request counters / operations), and back on the
   primary within 5 s of its recovery (the first answer naming the primary).
   Sluice's circuit breaker and prober run with their defaults
   (SLUICE_CIRCUIT_FAILURES, SLUICE_CIRCUIT_OPEN_S scaled to simulated time).
3. Replicas. Short chats on one pool at 0.8x its admission budget, then on
   two equal pools (rank 0 both, each its own simulator of the same size) at
   1.6x one pool's budget. Target: the short requests' latency p99 (they are
   not streamed) on the two within 1.2x of the one pool's.

Simulated time throughout (time scale 2); Sluice's time constants are
scaled to it (bench.platform.time_scaled_env). Run alone:
``python -m bench.routing``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from decimal import Decimal

from bench.common import PLOTS_DIR, TimeScale, fmt, log, md_table, pcts, run_standalone, write_result
from bench.http import HttpClient
from bench.load import Call, Sampler, calls_to_json, open_loop, timed_post
from bench.platform import Platform, Services, time_scaled_env
from bench.seed import config_push, pool_price_set, scaled_pool, scaled_slice_add, scaled_workload
from bench.workload import short_call

NAME = "routing"
SCALE = TimeScale(2.0)
MODEL = "sim-small"
HEADROOM = 0.8

# 1. Spill-over: ~170-token chats (max_tokens 256, output median 150).
SPILL_PRIMARY_TPM, SPILL_PRIMARY_RPM = 40_000, 2_000
SPILL_OVERFLOW_TPM, SPILL_OVERFLOW_RPM = 120_000, 3_000
SPILL_BUDGET = HEADROOM * SPILL_PRIMARY_TPM  # the primary's admission budget, TPM
SPILL_OFFERED = 1.5
SPILL_MAX_TOKENS, SPILL_MEDIAN = 256, 150
# The model's general price (bench.seed.pool_create) serves the primary; the
# overflow has a price of its own, as a pay-as-you-go provider would.
PRIMARY_PRICE = (Decimal("0.15"), Decimal("0.60"))
OVERFLOW_PRICE = (Decimal("0.50"), Decimal("2.00"))

# 2. Fail-over: short chats (max_tokens 64, output median 40).
FAILOVER_OPS_PER_S = 8.0
FAILOVER_POOL_TPM, FAILOVER_POOL_RPM = 100_000, 3_000

# 3. Replicas: each pool's simulator holds 8 sequences at once, so one
# pool's admission budget of short chats keeps about 60% of them busy.
REPLICA_TPM, REPLICA_RPM = 20_000, 2_000
REPLICA_BUDGET = HEADROOM * REPLICA_TPM
REPLICA_SIM_ARGS = ["--slots", "8", "--tpm", str(REPLICA_TPM), "--rpm", str(REPLICA_RPM)]

SHORT_MAX_TOKENS, SHORT_MEDIAN = 64, 40
BIN_S = 5.0
TARGETS = {"spill_primary_fraction": 0.90, "failover_switch_s": 5.0, "failover_attempts_per_op": 1.1,
           "failover_back_s": 5.0, "replica_p99_ratio": 1.2}


@dataclass(frozen=True)
class Sizes:
    """Each part's length, simulated seconds."""
    spill_s: float
    spill_warm_s: float  # the primary's share is judged after this (its bucket's burst spent)
    outage_start_s: float
    outage_s: float
    failover_s: float
    replica_s: float
    replica_warm_s: float


FULL = Sizes(spill_s=150.0, spill_warm_s=30.0, outage_start_s=30.0, outage_s=60.0, failover_s=130.0,
             replica_s=90.0, replica_warm_s=10.0)
# A smoke test's size (--quick): its numbers say the scenario runs, not how it comes out.
QUICK = Sizes(spill_s=50.0, spill_warm_s=20.0, outage_start_s=10.0, outage_s=15.0, failover_s=40.0,
              replica_s=30.0, replica_warm_s=5.0)


def mean_call_tokens(*, max_tokens: int, median: float, seed: int) -> float:
    """The mean actual tokens (prompt + output) of the chats a part sends,
    from the same generator: what its offered rate is sized by."""
    import llm_tokens

    rng = random.Random(seed + 99)
    total, n = 0, 2_000
    for _ in range(n):
        body = short_call(rng, max_tokens=max_tokens, median=median).body
        total += llm_tokens.count_chat_tokens(body["messages"], "cl100k_base") + min(body["sim"]["output_tokens"],
                                                                                     max_tokens)
    return total / n


def main(seed: int = 1, quick: bool = False, services: Services | None = None) -> dict:
    own = services is None
    services = services or Services().up()
    sizes = QUICK if quick else FULL
    spill_tokens = mean_call_tokens(max_tokens=SPILL_MAX_TOKENS, median=SPILL_MEDIAN, seed=seed)
    short_tokens = mean_call_tokens(max_tokens=SHORT_MAX_TOKENS, median=SHORT_MEDIAN, seed=seed)
    rates = {"spill": SPILL_OFFERED * SPILL_BUDGET / spill_tokens / 60,
             "failover": FAILOVER_OPS_PER_S,
             "solo": 0.8 * REPLICA_BUDGET / short_tokens / 60,
             "replicas": 1.6 * REPLICA_BUDGET / short_tokens / 60}
    outage = [{"at_s": sizes.outage_start_s, "outage_s": sizes.outage_s, "outage_status": 503}]
    common = ["--time-scale", str(SCALE.factor), "--seed", str(seed)]
    try:
        services.fresh_redis()
        with Platform(services, NAME) as platform:
            sims = {
                "spill-primary": platform.start_named_sim("spill-primary", [
                    *common, "--slots", "32", "--tpm", str(SPILL_PRIMARY_TPM), "--rpm", str(SPILL_PRIMARY_RPM)]),
                "overflow": platform.start_named_sim("overflow", [
                    *common, "--slots", "64", "--tpm", str(SPILL_OVERFLOW_TPM), "--rpm", str(SPILL_OVERFLOW_RPM)]),
                "fo-primary": platform.start_named_sim("fo-primary", [
                    *common, "--slots", "32", "--tpm", str(FAILOVER_POOL_TPM), "--rpm", str(FAILOVER_POOL_RPM),
                    "--schedule", json.dumps(outage)]),
                "replica-a": platform.start_named_sim("replica-a", [*common, *REPLICA_SIM_ARGS]),
                "replica-b": platform.start_named_sim("replica-b", [*common, *REPLICA_SIM_ARGS]),
            }
            seeded = _seed(sims)
            platform.start_sluice(lanes={"interactive": 48, "interactive-long": 2, "batch": 2, "scheduled": 1},
                                  extra_env=time_scaled_env(SCALE.factor))
            log(f"{NAME}: spill {rates['spill']:.2f} req/s sim ({SPILL_OFFERED}x the primary's budget); fail-over "
                f"{rates['failover']:.1f} ops/s, outage {sizes.outage_start_s:.0f}-"
                f"{sizes.outage_start_s + sizes.outage_s:.0f} s; replicas {rates['solo']:.2f} / "
                f"{rates['replicas']:.2f} req/s sim")
            spill = asyncio.run(_drive(
                platform, seeded["spill"], rates["spill"], sizes.spill_s, seed,
                sims=[sims["spill-primary"], sims["overflow"]], max_tokens=SPILL_MAX_TOKENS, median=SPILL_MEDIAN))
            spill["ledger"] = _ledger_wait(seeded["spill"].workload_id, spill["calls"])
            platform.assert_alive()
            failover = asyncio.run(_drive(
                platform, seeded["failover"], rates["failover"], sizes.failover_s, seed + 1,
                sims=[sims["fo-primary"], sims["overflow"]]))
            failover["ledger"] = _ledger_wait(seeded["failover"].workload_id, failover["calls"])
            platform.assert_alive()
            solo = asyncio.run(_drive(platform, seeded["solo"], rates["solo"], sizes.replica_s, seed + 2,
                                      sims=[sims["replica-a"]]))
            replicas = asyncio.run(_drive(platform, seeded["replicas"], rates["replicas"], sizes.replica_s, seed + 3,
                                          sims=[sims["replica-a"], sims["replica-b"]]))
            replicas["ledger"] = _ledger_wait(seeded["replicas"].workload_id, replicas["calls"])
            platform.assert_alive()
    finally:
        if own:
            services.down()
    data = _analyse(seed=seed, quick=quick, sizes=sizes, rates=rates, seeded=seeded, spill=spill, failover=failover,
                    solo=solo, replicas=replicas, spill_tokens=spill_tokens, short_tokens=short_tokens)
    write_result(NAME, data)
    return data


@dataclass(frozen=True)
class Part:
    """One part's workload: its key and the slugs of its route's pools."""
    workload_id: int
    api_key: str
    pools: dict[str, tuple[int, str]]  # role -> (pool id, slug)


def _seed(sims: dict[str, str]) -> dict[str, Part]:
    def pool(slug: str, sim: str, tpm: int, rpm: int, max_concurrency: int = 1024):
        return scaled_pool(scale=SCALE, slug=f"{NAME}-{slug}", base_url=f"{sims[sim]}/v1", provider_tpm=tpm,
                           provider_rpm=rpm, headroom=HEADROOM, max_concurrency=max_concurrency)

    def workload(slug: str, on, *, reserved_tpm: float, rpm: float, max_tokens: int):
        return scaled_workload(scale=SCALE, pool=on, slug=f"{NAME}-{slug}", workload_class="interactive",
                               reserved_tpm=round(reserved_tpm), ceiling_tpm=round(reserved_tpm), rpm=round(rpm),
                               queue_timeout_s=30.0, prompt_tokens_cap=1_000, max_tokens_cap=max_tokens,
                               max_tokens_default=max_tokens)

    parts: dict[str, Part] = {}
    primary = pool("spill-primary", "spill-primary", SPILL_PRIMARY_TPM, SPILL_PRIMARY_RPM)
    overflow = pool("spill-overflow", "overflow", SPILL_OVERFLOW_TPM, SPILL_OVERFLOW_RPM)
    pool_price_set(pool=overflow, model=MODEL, input_per_million=str(OVERFLOW_PRICE[0]),
                   output_per_million=str(OVERFLOW_PRICE[1]))
    # The primary slice is the primary's whole admission budget; the overflow
    # slice has room for twice the excess offered.
    spill = workload("spill", primary, reserved_tpm=SPILL_BUDGET, rpm=HEADROOM * SPILL_PRIMARY_RPM,
                     max_tokens=SPILL_MAX_TOKENS)
    scaled_slice_add(scale=SCALE, workload_id=spill.workload_id, pool=overflow, rank=1,
                     reserved_tpm=round(SPILL_BUDGET), ceiling_tpm=round(SPILL_BUDGET), rpm=1_200)
    parts["spill"] = Part(spill.workload_id, spill.api_key,
                          {"primary": (primary.id, primary.slug), "overflow": (overflow.id, overflow.slug)})

    fo_primary = pool("failover-primary", "fo-primary", FAILOVER_POOL_TPM, FAILOVER_POOL_RPM)
    fo_overflow = pool("failover-overflow", "overflow", SPILL_OVERFLOW_TPM, SPILL_OVERFLOW_RPM)
    fo = workload("failover", fo_primary, reserved_tpm=40_000, rpm=1_200, max_tokens=SHORT_MAX_TOKENS)
    scaled_slice_add(scale=SCALE, workload_id=fo.workload_id, pool=fo_overflow, rank=1, reserved_tpm=40_000,
                     ceiling_tpm=40_000, rpm=1_200)
    parts["failover"] = Part(fo.workload_id, fo.api_key, {"primary": (fo_primary.id, fo_primary.slug),
                                                           "overflow": (fo_overflow.id, fo_overflow.slug)})

    # The lone pool and replica a are the same simulator, used one after the other.
    solo_pool = pool("solo", "replica-a", REPLICA_TPM, REPLICA_RPM, max_concurrency=16)
    replica_a = pool("replica-a", "replica-a", REPLICA_TPM, REPLICA_RPM, max_concurrency=16)
    replica_b = pool("replica-b", "replica-b", REPLICA_TPM, REPLICA_RPM, max_concurrency=16)
    solo = workload("solo", solo_pool, reserved_tpm=REPLICA_BUDGET, rpm=HEADROOM * REPLICA_RPM,
                    max_tokens=SHORT_MAX_TOKENS)
    parts["solo"] = Part(solo.workload_id, solo.api_key, {"solo": (solo_pool.id, solo_pool.slug)})
    pair = workload("replicas", replica_a, reserved_tpm=REPLICA_BUDGET, rpm=HEADROOM * REPLICA_RPM,
                    max_tokens=SHORT_MAX_TOKENS)
    scaled_slice_add(scale=SCALE, workload_id=pair.workload_id, pool=replica_b, rank=0,
                     reserved_tpm=round(REPLICA_BUDGET), ceiling_tpm=round(REPLICA_BUDGET),
                     rpm=round(HEADROOM * REPLICA_RPM))
    parts["replicas"] = Part(pair.workload_id, pair.api_key, {"replica-a": (replica_a.id, replica_a.slug),
                                                              "replica-b": (replica_b.id, replica_b.slug)})
    for seeded_pool in (primary, overflow, fo_primary, fo_overflow, solo_pool, replica_a, replica_b):
        config_push(seeded_pool)
    return parts


async def _drive(platform, part: Part, rate: float, total_sim: float, seed: int, *, sims: list[str],
                 max_tokens: int = SHORT_MAX_TOKENS, median: float = SHORT_MEDIAN) -> dict:
    """Offer ``rate`` chats per simulated second for ``total_sim`` simulated
    seconds (Poisson), sampling every simulator's counters meanwhile."""
    client = HttpClient(platform.sluice_url, max_connections=256, timeout=600)
    sim_clients = [HttpClient(url, max_connections=2) for url in sims]
    calls: list[Call] = []
    rng = random.Random(seed)
    auth = {"Authorization": f"Bearer {part.api_key}"}
    # A simulator's schedule (the outage) counts from its last reset: now.
    for sim in sim_clients:
        await sim.post("/admin/reset", {})
    t0, t0_wall = time.monotonic(), time.time()

    async def probe() -> dict:
        stats = [(await sim.get("/admin/stats")).json() for sim in sim_clients]
        return {"requests": [s["requests_total"] for s in stats], "by_status": [s["by_status"] for s in stats],
                "running": [s["running"] for s in stats], "queued": [s["queued"] for s in stats]}

    sampler = Sampler(probe, 0.25, t0).start()

    async def fire(i: int) -> None:
        body = short_call(rng, max_tokens=max_tokens, median=median).body
        calls.append(await timed_post(client, "/v1/chat/completions", body, auth, "chat", t0))

    await open_loop(SCALE.real_rate(rate), SCALE.real_s(total_sim), fire, poisson=True,
                    rng=random.Random(seed + 7))
    samples = await sampler.stop()
    final = [(await sim.get("/admin/stats")).json() for sim in sim_clients]
    await client.aclose()
    for sim in sim_clients:
        await sim.aclose()
    return {"calls": calls, "samples": samples, "sim_final": final, "t0_wall": t0_wall,
            "wall_s": time.monotonic() - t0}


def _ledger_wait(workload_id: int, calls: list[Call], timeout_s: float = 60.0) -> list[dict]:
    """The workload's ledger rows, once every answered call has one (the
    worker writes its row as it settles, just after the answer). Polls with
    a deadline; what is there by then is what is judged."""
    from budgets.models import UsageRecord

    expected = sum(1 for c in calls if c.headers.get("x-request-id") and c.status not in (429, 0))
    deadline = time.monotonic() + timeout_s
    rows = UsageRecord.objects.filter(workload_id=workload_id)
    while rows.count() < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return [{**row, "created_at": row["created_at"].timestamp(), "cost": str(row["cost"])}
            for row in rows.order_by("created_at").values(
                "request_id", "created_at", "pool_id", "status", "overflow", "failed_over", "actual_input_tokens",
                "actual_output_tokens", "cost", "attempts")]


# --- analysis -----------------------------------------------------------------------------


def _codes(calls: list[Call]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        key = "ok" if c.ok else (c.code or f"http_{c.status}")
        out[key] = out.get(key, 0) + 1
    return out


def _served_by(calls: list[Call]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in calls:
        if c.ok:
            pool = c.headers.get("x-sluice-pool", "?")
            out[pool] = out.get(pool, 0) + 1
    return out


def _tokens(usage: dict | None) -> int:
    return int(usage["prompt_tokens"] + usage["completion_tokens"]) if usage else 0


def _analyse_spill(run: dict, part: Part, sizes: Sizes, rate: float, mean_tokens: float) -> dict:
    f = SCALE.factor
    calls, rows = run["calls"], run["ledger"]
    primary_id, primary_slug = part.pools["primary"]
    overflow_id, overflow_slug = part.pools["overflow"]
    refused_429 = sum(1 for c in calls if c.status == 429)
    end_sim = sizes.spill_s
    window_min = (end_sim - sizes.spill_warm_s) / 60.0

    def sim_at(row) -> float:
        return (row["created_at"] - run["t0_wall"]) * f

    def tokens(row) -> int:
        return row["actual_input_tokens"] + row["actual_output_tokens"]

    per_pool = {}
    for role, (pool_id, slug), price in (("primary", part.pools["primary"], PRIMARY_PRICE),
                                         ("overflow", part.pools["overflow"], OVERFLOW_PRICE)):
        mine = [r for r in rows if r["pool_id"] == pool_id]
        tokens_in = sum(r["actual_input_tokens"] for r in mine)
        tokens_out = sum(r["actual_output_tokens"] for r in mine)
        ledger_cost = sum((Decimal(r["cost"]) for r in mine), Decimal(0))
        expected_cost = (tokens_in * price[0] + tokens_out * price[1]) / Decimal(1_000_000)
        steady = sum(tokens(r) for r in mine if sizes.spill_warm_s <= sim_at(r) < end_sim)
        client_tokens = sum(_tokens(c.usage) for c in calls if c.ok and c.headers.get("x-sluice-pool") == slug)
        per_pool[role] = {
            "pool_id": pool_id, "slug": slug, "rows": len(mine), "input_tokens": tokens_in,
            "output_tokens": tokens_out, "price_per_million": [str(price[0]), str(price[1])],
            "ledger_cost": str(ledger_cost), "expected_cost": str(expected_cost),
            "cost_exact": ledger_cost == expected_cost, "client_tokens": client_tokens,
            "overflow_rows": sum(1 for r in mine if r["overflow"]), "failed_over_rows": sum(1 for r in mine
                                                                                           if r["failed_over"]),
            "steady_tpm": steady / window_min,
        }
    # Sim counters: what each simulated provider itself refused (429) and served.
    sim_status = [s.get("by_status", {}) for s in run["sim_final"]]
    offered_tokens = sum(_tokens(c.usage) for c in calls if c.ok)
    bins_n = int(end_sim // BIN_S) + 1
    bins = {"t": [i * BIN_S for i in range(bins_n)], "primary_tpm": [0.0] * bins_n, "overflow_tpm": [0.0] * bins_n}
    for r in rows:
        i = int(sim_at(r) // BIN_S)
        if 0 <= i < bins_n:
            key = "primary_tpm" if r["pool_id"] == primary_id else "overflow_tpm"
            bins[key][i] += tokens(r) * 60.0 / BIN_S
    fraction = per_pool["primary"]["steady_tpm"] / SPILL_BUDGET
    return {
        "rate_per_sim_s": rate, "mean_call_tokens": mean_tokens, "offered_tpm": rate * mean_tokens * 60,
        "served_tpm_all": offered_tokens / (end_sim / 60.0), "budget_tpm": SPILL_BUDGET,
        "primary_provider_tpm": SPILL_PRIMARY_TPM, "calls": len(calls), "codes": _codes(calls),
        "served_by": _served_by(calls), "caller_429s": refused_429,
        "sim_by_status": {"primary": sim_status[0], "overflow": sim_status[1]},
        "pools": per_pool, "primary_fraction": fraction, "steady_window_s": [sizes.spill_warm_s, end_sim],
        "bins": bins, "overflow_slug": overflow_slug, "primary_slug": primary_slug,
        "met": {"no_429": refused_429 == 0, "primary_share": fraction >= TARGETS["spill_primary_fraction"],
                "cost_exact": all(p["cost_exact"] for p in per_pool.values())},
    }


def _analyse_failover(run: dict, part: Part, sizes: Sizes) -> dict:
    f = SCALE.factor
    calls = run["calls"]
    _, primary_slug = part.pools["primary"]
    _, overflow_slug = part.pools["overflow"]
    start, end = sizes.outage_start_s, sizes.outage_start_s + sizes.outage_s

    def began(c: Call) -> float:
        return c.start * f

    def answered(c: Call) -> float:
        return (c.start + c.latency) * f

    during = [c for c in calls if start <= began(c) < end]
    before = [c for c in calls if began(c) < start]
    after = [c for c in calls if began(c) >= end]
    on_overflow = sorted(answered(c) for c in calls if c.ok and c.headers.get("x-sluice-pool") == overflow_slug
                         and answered(c) >= start)
    first_overflow = on_overflow[0] - start if on_overflow else None
    unserved = [answered(c) - start for c in during if not (c.ok and c.headers.get("x-sluice-pool") == overflow_slug)]
    # From this moment on, every call of the outage was answered by the overflow.
    switch = max([first_overflow] + unserved) if first_overflow is not None else None
    on_primary = sorted(answered(c) for c in calls if c.ok and c.headers.get("x-sluice-pool") == primary_slug
                        and answered(c) >= end)
    back = on_primary[0] - end if on_primary else None
    settled_after = [c for c in after if began(c) >= end + TARGETS["failover_back_s"]]
    after_on_primary = sum(1 for c in settled_after if c.ok and c.headers.get("x-sluice-pool") == primary_slug)
    # Pool attempts: both simulators' request counters (what the pools had to absorb).
    samples = [s for s in run["samples"] if "error" not in s]
    final = [s["requests_total"] for s in run["sim_final"]]
    attempts_total = sum(final)

    def counters_at(sim_t: float) -> list[int]:
        taken = [s for s in samples if s["t"] * f <= sim_t]
        return taken[-1]["requests"] if taken else [0] * len(final)

    in_outage = [b - a for a, b in zip(counters_at(start), counters_at(end))]
    ledger = run["ledger"]
    ledger_attempts = sum(r["attempts"] for r in ledger)
    latency_before = [c.latency * f for c in before if c.ok]
    latency_during = [c.latency * f for c in during if c.ok]
    bins_n = int(sizes.failover_s // BIN_S) + 1
    bins = {"t": [i * BIN_S for i in range(bins_n)], "primary": [0] * bins_n, "overflow": [0] * bins_n,
            "failed": [0] * bins_n}
    for c in calls:
        i = int(answered(c) // BIN_S)
        if 0 <= i < bins_n:
            pool = c.headers.get("x-sluice-pool")
            key = "failed" if not c.ok else "primary" if pool == primary_slug else "overflow"
            bins[key][i] += 1
    ops = len(calls)
    per_op = attempts_total / ops if ops else None
    return {
        "ops": ops, "ops_per_sim_s": FAILOVER_OPS_PER_S, "outage": [start, end], "codes": _codes(calls),
        "served_by": _served_by(calls), "failed_during": sum(1 for c in during if not c.ok),
        "failed_total": sum(1 for c in calls if not c.ok),
        "first_overflow_answer_s": first_overflow, "switch_s": switch, "back_on_primary_s": back,
        "after_on_primary": [after_on_primary, len(settled_after)],
        "sim_requests": final, "pool_attempts_per_op": per_op,
        "outage_ops": len(during), "outage_sim_requests": in_outage,
        "outage_attempts_per_op": sum(in_outage) / len(during) if during else None,
        "ledger_rows": len(ledger), "ledger_attempts_per_row": ledger_attempts / len(ledger) if ledger else None,
        "ledger_failed_over": sum(1 for r in ledger if r["failed_over"]),
        "latency_before": pcts(latency_before), "latency_during": pcts(latency_during),
        "latency_during_max": max(latency_during) if latency_during else None,
        "bins": bins, "primary_slug": primary_slug, "overflow_slug": overflow_slug,
        "met": {"switch": switch is not None and switch <= TARGETS["failover_switch_s"]
                and not any(not c.ok for c in during),
                "attempts": per_op is not None and per_op <= TARGETS["failover_attempts_per_op"],
                "back": back is not None and back <= TARGETS["failover_back_s"]},
    }


def _analyse_replicas(solo: dict, replicas: dict, part: Part, sizes: Sizes, rates: dict) -> dict:
    f = SCALE.factor

    def latencies(run: dict) -> list[float]:
        return [c.latency * f for c in run["calls"] if c.ok and c.start * f >= sizes.replica_warm_s]

    one, two = pcts(latencies(solo)), pcts(latencies(replicas))
    ratio = two["p99"] / one["p99"] if one["p99"] and two["p99"] else None
    return {
        "rates_per_sim_s": {"solo": rates["solo"], "replicas": rates["replicas"]}, "budget_tpm": REPLICA_BUDGET,
        "sim_args": REPLICA_SIM_ARGS, "solo": {"latency": one, "codes": _codes(solo["calls"]),
                                               "served_by": _served_by(solo["calls"])},
        "replicas": {"latency": two, "codes": _codes(replicas["calls"]), "served_by": _served_by(replicas["calls"])},
        "p99_ratio": ratio, "met": {"p99": ratio is not None and ratio <= TARGETS["replica_p99_ratio"]},
    }


def _analyse(*, seed, quick, sizes: Sizes, rates, seeded, spill, failover, solo, replicas, spill_tokens,
             short_tokens) -> dict:
    return {
        "scenario": NAME, "seed": seed, "quick": quick, "time_scale": SCALE.factor, "sizes": sizes.__dict__,
        "clock": "simulated seconds; rates per simulated minute", "targets": TARGETS,
        "mean_short_call_tokens": short_tokens,
        "spill": _analyse_spill(spill, seeded["spill"], sizes, rates["spill"], spill_tokens),
        "failover": _analyse_failover(failover, seeded["failover"], sizes),
        "replicas": _analyse_replicas(solo, replicas, seeded["replicas"], sizes, rates),
        "calls": {"spill": calls_to_json(spill["calls"]), "failover": calls_to_json(failover["calls"]),
                  "solo": calls_to_json(solo["calls"]), "replicas": calls_to_json(replicas["calls"])},
        "failover_samples": failover["samples"],
    }


# --- report -------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def targets(data: dict) -> list[dict]:
    """Every target of the scenario with its measured value (the summary table's row)."""
    s, fo, r = data["spill"], data["failover"], data["replicas"]
    costs = "; ".join(f"{p['slug']} {p['ledger_cost']} = {p['expected_cost']}" for p in s["pools"].values())
    return [
        {"what": "spill-over: callers' 429s", "value": str(s["caller_429s"]), "target": "0",
         "met": s["met"]["no_429"]},
        {"what": "spill-over: primary served / its admission budget (steady)", "value": fmt(s["primary_fraction"], 2),
         "target": f"≥ {TARGETS['spill_primary_fraction']:.2f}", "met": s["met"]["primary_share"]},
        {"what": "spill-over: ledger cost per pool = tokens x that pool's price", "value": costs, "target": "exact",
         "met": s["met"]["cost_exact"]},
        {"what": "fail-over: served by the overflow from (after the outage's start)",
         "value": "never" if fo["switch_s"] is None else f"{fo['switch_s']:.1f} s", "target": "≤ 5 s",
         "met": fo["met"]["switch"]},
        {"what": "fail-over: pool attempts per operation",
         "value": f"{fmt(fo['pool_attempts_per_op'], 3)} (in the outage {fmt(fo['outage_attempts_per_op'], 2)})",
         "target": f"≤ {TARGETS['failover_attempts_per_op']}", "met": fo["met"]["attempts"]},
        {"what": "fail-over: back on the primary after its recovery",
         "value": "never" if fo["back_on_primary_s"] is None else f"{fo['back_on_primary_s']:.1f} s",
         "target": "≤ 5 s", "met": fo["met"]["back"]},
        {"what": "replicas: short p99 on two pools at 1.6x / one pool at 0.8x", "value": fmt(r["p99_ratio"], 2),
         "target": f"≤ {TARGETS['replica_p99_ratio']}", "met": r["met"]["p99"]},
    ]


def summarize(data: dict) -> str:
    s, fo, r = data["spill"], data["failover"], data["replicas"]
    pp, po = s["pools"]["primary"], s["pools"]["overflow"]
    lines = [
        f"Time scale {data['time_scale']:g}; simulated seconds and rates per simulated minute throughout.",
        "",
        "**Spill-over.** Primary pool: provider "
        f"{s['primary_provider_tpm']:,} TPM, admission budget {s['budget_tpm']:,.0f} TPM, all of it the workload's "
        f"primary slice; an overflow slice of {s['budget_tpm']:,.0f} TPM on a second pool (own simulator, price "
        f"{po['price_per_million'][0]} / {po['price_per_million'][1]} per million in/out against the primary's "
        f"{pp['price_per_million'][0]} / {pp['price_per_million'][1]}). Offered "
        f"{s['rate_per_sim_s']:.2f} chats/s of ~{s['mean_call_tokens']:.0f} tokens = {s['offered_tpm']:,.0f} TPM "
        f"({s['offered_tpm'] / s['budget_tpm']:.2f}x the budget) for {s['steady_window_s'][1]:.0f} s; the "
        f"primary's share is judged from {s['steady_window_s'][0]:.0f} s (its bucket's 15 s burst spent).",
        "",
        md_table(["pool", "answers", "ledger rows", "TPM served (steady)", "input / output tokens", "ledger cost",
                  "tokens x price", "tokens seen by callers"], [
            [p["slug"], s["served_by"].get(p["slug"], 0), p["rows"], f"{p['steady_tpm']:,.0f}",
             f"{p['input_tokens']:,} / {p['output_tokens']:,}", p["ledger_cost"], p["expected_cost"],
             f"{p['client_tokens']:,}"] for p in (pp, po)]),
        "",
        f"Callers' outcomes: {s['codes']}. The simulators' own answers: primary {s['sim_by_status']['primary']}, "
        f"overflow {s['sim_by_status']['overflow']}.",
        "",
        f"**Fail-over.** {fo['ops']} operations at {fo['ops_per_sim_s']:g}/s; the primary answers 503 from "
        f"{fo['outage'][0]:.0f} s to {fo['outage'][1]:.0f} s. Answers by pool: {fo['served_by']}; outcomes "
        f"{fo['codes']}.",
        "",
        md_table(["measure", "value"], [
            ["first answer from the overflow after the outage's start", f"{fmt(fo['first_overflow_answer_s'], 2)} s"],
            ["every call of the outage answered by the overflow from", f"{fmt(fo['switch_s'], 2)} s"],
            ["calls started in the outage that failed", fo["failed_during"]],
            ["latency p50 / p99 / max of calls started in the outage (before it: p50 / p99)",
             f"{fmt(fo['latency_during']['p50'], 2)} / {fmt(fo['latency_during']['p99'], 2)} / "
             f"{fmt(fo['latency_during_max'], 2)} s ({fmt(fo['latency_before']['p50'], 2)} / "
             f"{fmt(fo['latency_before']['p99'], 2)} s)"],
            ["pool attempts (both simulators' request counters) / operations, whole run",
             f"{sum(fo['sim_requests'])} / {fo['ops']} = {fmt(fo['pool_attempts_per_op'], 3)}"],
            ["the same within the outage", f"{sum(fo['outage_sim_requests'])} / {fo['outage_ops']} = "
                                           f"{fmt(fo['outage_attempts_per_op'], 3)}"],
            ["ledger attempts per row; rows failed over", f"{fmt(fo['ledger_attempts_per_row'], 3)}; "
                                                          f"{fo['ledger_failed_over']}"],
            ["first answer from the primary after its recovery", f"{fmt(fo['back_on_primary_s'], 2)} s"],
            [f"calls from {TARGETS['failover_back_s']:g} s after the recovery answered by the primary",
             f"{fo['after_on_primary'][0]} / {fo['after_on_primary'][1]}"],
        ]),
        "",
        f"**Replicas.** Short chats (max_tokens 64), pools of {r['budget_tpm']:,.0f} TPM admission budget each, "
        f"each simulator `{' '.join(r['sim_args'])}`: one pool at 0.8x ({r['rates_per_sim_s']['solo']:.2f}/s), "
        f"then two equal pools (rank 0 both) at 1.6x ({r['rates_per_sim_s']['replicas']:.2f}/s). Latency of "
        "unstreamed short requests, after the first seconds.",
        "",
        md_table(["run", "p50", "p95", "p99", "n", "answers by pool", "outcomes"], [
            [name, fmt(v["latency"]["p50"], 2), fmt(v["latency"]["p95"], 2), fmt(v["latency"]["p99"], 2),
             v["latency"]["n"], v["served_by"], v["codes"]]
            for name, v in (("one pool, 0.8x", r["solo"]), ("two replicas, 1.6x", r["replicas"]))]),
        "",
        md_table(["target", "measured", "target value", "verdict"],
                 [[t["what"], f"**{t['value']}**", t["target"], _verdict(t["met"])] for t in targets(data)]),
    ]
    return "\n".join(lines)


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import timeseries

    names = []
    s = data["spill"]
    b = s["bins"]
    path = plots_dir / "routing_spill.png"
    timeseries({f"primary ({s['primary_slug']})": (b["t"], b["primary_tpm"]),
                f"overflow ({s['overflow_slug']})": (b["t"], b["overflow_tpm"])}, path,
               title="Routing: spill-over, tokens served per pool (per simulated minute)", xlabel="simulated s",
               ylabel="tokens / min", step=True, hlines={"primary admission budget": s["budget_tpm"]})
    names.append(path.name)
    fo = data["failover"]
    b = fo["bins"]
    start, end = fo["outage"]
    path = plots_dir / "routing_failover.png"
    timeseries({"answered by the primary": (b["t"], b["primary"]), "answered by the overflow": (b["t"], b["overflow"]),
                "failed": (b["t"], b["failed"])}, path,
               title=f"Routing: fail-over, answers per {BIN_S:g} s by pool", xlabel="simulated s",
               ylabel="answers per bin", step=True, spans=[(start, end, "primary answers 503")])
    names.append(path.name)
    return names


if __name__ == "__main__":
    run_standalone(NAME, main, summarize, plot, __doc__.split("\n")[0])
