"""Scenario 13, the Batch API in idle capacity (issue 34, item 6).

One pool, one run. An interactive chat workload (reserved 40k TPM, lend 0)
sends short questions at 60% of its reservation (by estimate), first alone,
then while a batch workload submits a 5,000-line batch through OpenAI's
Batch API with the official SDK (``files.create`` + ``batches.create``,
polling ``batches.retrieve``, then ``files.content`` of the output file).
The chat keeps going until the batch ends.

Targets:

1. Chat's short p99 beside the batch within 1.10x of chat alone (the same
   run: chat alone first), and no chat request refused beside the batch
   (a refused one has no latency: the p99 alone would hide it).
2. The batch finishes in the time the idle capacity allows: the larger of
   two bounds (``idle_bound``). The token bound, from the pool's budget and
   chat's load: admission lets the pool take ``P = headroom x provider TPM``
   tokens a minute; chat uses ``C`` of it (measured from its ledger rows
   while the batch ran); a batch line is admitted only from what is left,
   and never past its workload's ceiling, so the batch's token rate is at
   most ``min(ceiling, P - C)``, and likewise for requests: 60 x max(batch
   tokens / idle TPM, lines / idle RPM) seconds. The share bound, from the
   places the feed lets batch lines hold: ``K = floor(max_concurrency x
   SLUICE_BATCH_POOL_SHARE)`` lines at once on the pool, so the batch takes
   at least the pool's service time of its lines (their ledger rows'
   ``upstream_ms``, simulated) over K. The target is the batch's time from
   creation to ``completed`` within 1.20x of the larger (its start-up, the
   last lines' tail and the feed's gaps between a line's end and the next
   one's start cost some of it).
3. The batch's tokens equal the ledger's: the usage summed over the output
   file's lines equals the actual tokens of the ledger rows of the batch's
   lines (gateway Job rows with this batch id carry their request ids), one
   row per line.

Simulated time (time scale 4); Sluice's time constants scaled to it. Run
alone: ``python -m bench.batch --seed 1 [--lines 500] [--pool-share 0.2]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass

from bench.common import (PLOTS_DIR, TimeScale, fmt, log, md_table, pcts, ratio, report_paths, write_result)
from bench.http import HttpClient
from bench.load import Call, Sampler, calls_to_json, lane_depths, open_loop, timed_post
from bench.platform import Platform, Services, time_scaled_env
from bench.seed import config_push, scaled_pool, scaled_workload
from bench.workload import long_call, short_call
from inference_sim.config import SimConfig

NAME = "batch"
SCALE = TimeScale(4.0)
MODEL = "sim-small"
# The pool, per simulated minute; its simulator holds POOL_SLOTS sequences at once.
POOL_TPM, POOL_RPM, HEADROOM, BURST_SIM_S, POOL_SLOTS = 150_000, 6_000, 0.8, 15.0, 32
POOL_BUDGET_TPM, POOL_BUDGET_RPM = HEADROOM * POOL_TPM, HEADROOM * POOL_RPM
SIM_ARGS = ["--slots", str(POOL_SLOTS), "--tpm", str(POOL_TPM), "--rpm", str(POOL_RPM)]
CHAT = dict(reserved_tpm=40_000, ceiling_tpm=40_000, rpm=1_500)
CHAT_LOAD = 0.6  # of its reservation, by estimate
CHAT_MAX_TOKENS = 64
# The batch's ceiling is the whole pool budget: only chat's load bounds its
# tokens. Request rates are reserved too, so its RPM is what chat's leaves.
BATCH = dict(reserved_tpm=10_000, ceiling_tpm=round(POOL_BUDGET_TPM), rpm=round(POOL_BUDGET_RPM) - CHAT["rpm"])
# A line: summarize a ~150-token passage (output median 60 tokens, at most 96).
LINE_PROMPT_TOKENS, LINE_MAX_TOKENS, LINE_MEDIAN = 150, 96, 60
FULL_LINES, QUICK_LINES = 5_000, 300
FINAL = ("completed", "failed", "expired", "cancelled")
POLL_REAL_S = 0.25
TARGETS = {"chat_p99_ratio": 1.10, "batch_time_ratio": 1.20, "chat_refused": 0}


@dataclass(frozen=True)
class Sizes:
    lines: int
    solo_s: float  # chat alone, simulated seconds
    warm_s: float  # chat's first seconds, left out of its percentiles


def sizes_for(*, quick: bool, lines: int | None) -> Sizes:
    return Sizes(lines=lines or (QUICK_LINES if quick else FULL_LINES), solo_s=40.0 if quick else 200.0,
                 warm_s=5.0 if quick else 10.0)


# --- the bound --------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleBound:
    """How fast the batch can go in what chat leaves of the pool (rates per
    simulated minute) and in the places its share gives it, and the time
    that allows for its tokens and lines."""

    pool_tpm: float  # the pool's admission budget: headroom x provider TPM
    pool_rpm: float
    chat_tpm: float  # chat's actual use while the batch ran
    chat_rpm: float
    batch_ceiling_tpm: float
    batch_rpm: float
    batch_tokens: int
    batch_lines: int
    batch_service_s: float = 0.0  # the pool's service time of the batch's lines, summed (simulated s)
    share_places: int = 0  # lines the batch share lets the pool hold at once (0: not share-limited)

    @property
    def idle_tpm(self) -> float:
        return min(self.batch_ceiling_tpm, self.pool_tpm - self.chat_tpm)

    @property
    def idle_rpm(self) -> float:
        return min(self.batch_rpm, self.pool_rpm - self.chat_rpm)

    @property
    def budget_seconds(self) -> float:
        """The batch's shortest time in the pool budget chat leaves: its
        tokens, or its lines, at the idle rate."""
        if self.idle_tpm <= 0 or self.idle_rpm <= 0:
            return float("inf")
        return 60.0 * max(self.batch_tokens / self.idle_tpm, self.batch_lines / self.idle_rpm)

    @property
    def share_seconds(self) -> float:
        """The batch's shortest time in its share of places: its lines'
        service time run K at once."""
        return self.batch_service_s / self.share_places if self.share_places > 0 else 0.0

    @property
    def seconds(self) -> float:
        return max(self.budget_seconds, self.share_seconds)

    @property
    def binding(self) -> str:
        if self.idle_tpm <= 0 or self.idle_rpm <= 0:
            return "no idle capacity"
        if self.share_seconds > self.budget_seconds:
            return "share of places"
        return "tokens" if self.batch_tokens / self.idle_tpm >= self.batch_lines / self.idle_rpm else "requests"


def share_places(share: float, max_concurrency: int = POOL_SLOTS) -> int:
    """K: the feed's bound on a pool's batch lines (at least one)."""
    return max(1, math.floor(max_concurrency * share))


# --- the batch's lines ------------------------------------------------------------------


def batch_lines(*, seed: int, count: int) -> list[dict]:
    """The input file's lines in OpenAI's format, each a short summary with
    its output length drawn here (the simulator's per-request override), so
    every run of a seed asks for the same tokens."""
    rng = random.Random(seed + 50)
    lines = []
    for i in range(count):
        body = long_call(rng, model=MODEL, prompt_tokens=LINE_PROMPT_TOKENS, max_tokens=LINE_MAX_TOKENS,
                         median=LINE_MEDIAN).body
        lines.append({"custom_id": f"line-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()


def output_read(text: str) -> dict:
    """The output (or error) file's lines: how many, which custom ids, their
    status codes, request ids and summed usage."""
    custom_ids, request_ids, statuses = [], [], {}
    prompt = completion = 0
    for raw in text.splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        custom_ids.append(line.get("custom_id"))
        response = line.get("response") or {}
        status = str(response.get("status_code", "none"))
        statuses[status] = statuses.get(status, 0) + 1
        if response.get("request_id"):
            request_ids.append(response["request_id"])
        usage = (response.get("body") or {}).get("usage") or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        completion += int(usage.get("completion_tokens") or 0)
    return {"lines": len(custom_ids), "custom_ids": custom_ids, "request_ids": request_ids, "statuses": statuses,
            "prompt_tokens": prompt, "completion_tokens": completion, "tokens": prompt + completion}


# --- the run ----------------------------------------------------------------------------


def main(seed: int = 1, quick: bool = False, services: Services | None = None, lines: int | None = None,
         lines_in_flight: int | None = None, pool_share: float | None = None) -> dict:
    """``lines_in_flight`` and ``pool_share``: SLUICE_BATCH_LINES_IN_FLIGHT
    and SLUICE_BATCH_POOL_SHARE for this run (None: the environment's, else
    the setting's default)."""
    own = services is None
    services = services or Services().up()
    sizes = sizes_for(quick=quick, lines=lines)
    chat_rate = CHAT_LOAD * CHAT["reserved_tpm"] / _chat_estimate(seed) / 60  # per simulated second
    the_lines = batch_lines(seed=seed, count=sizes.lines)
    expected = _expected_bound(the_lines, chat_rate, seed)
    # A generous limit: the run stops waiting for the batch at 5x its bound.
    limit_sim = max(300.0, 5 * expected.seconds)
    try:
        services.fresh_redis()
        with Platform(services, NAME) as platform:
            platform.start_sim(["--time-scale", str(SCALE.factor), "--seed", str(seed), *SIM_ARGS])
            pool, chat, batch = _seed(platform)
            env = time_scaled_env(SCALE.factor)
            if lines_in_flight is not None:
                env["SLUICE_BATCH_LINES_IN_FLIGHT"] = str(lines_in_flight)
            if pool_share is not None:
                env["SLUICE_BATCH_POOL_SHARE"] = str(pool_share)
            platform.start_sluice(extra_env=env)
            share = _share_run_with({**platform.env, **env})
            log(f"{NAME}: chat {chat_rate:.2f} req/s sim alone for {sizes.solo_s:.0f} s, then a {sizes.lines:,}-line "
                f"batch (~{expected.batch_tokens:,} tokens, bound ~{expected.seconds:.0f} s sim at "
                f"{expected.idle_tpm:,.0f} TPM idle)")
            run = asyncio.run(_drive(platform, services, chat, batch, the_lines, sizes, seed, chat_rate, limit_sim))
            platform.assert_alive()
            run["ledger"] = _ledger(batch_id=run["batch"]["id"], workload_ids=(chat.workload_id, batch.workload_id),
                                    expected_lines=run["batch"]["counts"].get("completed", 0))
    finally:
        if own:
            services.down()
    data = _analyse(run, sizes=sizes, seed=seed, quick=quick, chat=chat, batch=batch, chat_rate=chat_rate,
                    expected=expected, pool_id=pool.id, pool_share=share)
    data["lines_in_flight"] = lines_in_flight  # None: the setting's default
    write_result(NAME, data)
    return data


def _share_run_with(env: dict[str, str]) -> float:
    """SLUICE_BATCH_POOL_SHARE as the platform's processes read it: their
    environment, else the setting's default."""
    from django.conf import settings

    raw = env.get("SLUICE_BATCH_POOL_SHARE", "").strip()
    return float(raw) if raw else float(settings.SLUICE_BATCH_POOL_SHARE)


def _chat_estimate(seed: int) -> float:
    """Chat's mean admission estimate (prompt + max_tokens): what its offered
    rate is sized by."""
    import llm_tokens

    rng = random.Random(seed)
    calls = [short_call(rng, max_tokens=CHAT_MAX_TOKENS) for _ in range(200)]
    return sum(llm_tokens.count_chat_tokens(c.body["messages"], "cl100k_base") for c in calls) / len(calls) \
        + CHAT_MAX_TOKENS


def _line_tokens(line: dict) -> int:
    import llm_tokens

    body = line["body"]
    return llm_tokens.count_chat_tokens(body["messages"], "cl100k_base") + min(body["sim"]["output_tokens"],
                                                                               body["max_tokens"])


def _expected_bound(lines: list[dict], chat_rate: float, seed: int) -> IdleBound:
    """The bound before the run, from the lines' own token counts and chat's
    planned rate (its actual tokens: prompt + drawn output)."""
    import llm_tokens

    rng = random.Random(seed)
    calls = [short_call(rng, max_tokens=CHAT_MAX_TOKENS).body for _ in range(200)]
    chat_tokens = sum(llm_tokens.count_chat_tokens(b["messages"], "cl100k_base")
                      + min(b["sim"]["output_tokens"], CHAT_MAX_TOKENS) for b in calls) / len(calls)
    return IdleBound(pool_tpm=POOL_BUDGET_TPM, pool_rpm=POOL_BUDGET_RPM, chat_tpm=chat_rate * 60 * chat_tokens,
                     chat_rpm=chat_rate * 60, batch_ceiling_tpm=BATCH["ceiling_tpm"], batch_rpm=BATCH["rpm"],
                     batch_tokens=sum(_line_tokens(line) for line in lines), batch_lines=len(lines))


def _seed(platform):
    pool = scaled_pool(scale=SCALE, slug=f"{NAME}-pool", base_url=f"{platform.sim_url}/v1", provider_tpm=POOL_TPM,
                       provider_rpm=POOL_RPM, headroom=HEADROOM, burst_seconds=BURST_SIM_S,
                       max_concurrency=POOL_SLOTS)
    chat = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-chat", workload_class="interactive",
                           queue_timeout_s=30.0, prompt_tokens_cap=1_000, max_tokens_cap=CHAT_MAX_TOKENS,
                           max_tokens_default=CHAT_MAX_TOKENS, **CHAT)
    batch = scaled_workload(scale=SCALE, pool=pool, slug=f"{NAME}-summarizer", workload_class="batch",
                            queue_timeout_s=120.0, prompt_tokens_cap=2_000, max_tokens_cap=LINE_MAX_TOKENS,
                            max_tokens_default=LINE_MAX_TOKENS, **BATCH)
    config_push(pool)
    return pool, chat, batch


async def _drive(platform, services, chat, batch, lines: list[dict], sizes: Sizes, seed: int, chat_rate: float,
                 limit_sim: float) -> dict:
    """Chat alone for ``sizes.solo_s``, then the batch beside it; chat stops
    when the batch reaches a final status (or the limit passes). The SDK
    and the file's bytes are made before chat starts: the client shares the
    chat's event loop, and a second of its CPU there would read as chat's
    latency."""
    from openai import AsyncOpenAI

    sdk = AsyncOpenAI(base_url=f"{platform.sluice_url}/v1", api_key=batch.api_key, max_retries=0, timeout=300)
    payload = jsonl(lines)
    client = HttpClient(platform.sluice_url, max_connections=256, timeout=600)
    sim = HttpClient(platform.sim_url, max_connections=2)
    chat_calls: list[Call] = []
    chat_rng = random.Random(seed + 1)
    auth = {"Authorization": f"Bearer {chat.api_key}"}
    t0, t0_epoch = time.monotonic(), time.time()
    stop = asyncio.Event()

    async def probe() -> dict:
        stats = (await sim.get("/admin/stats")).json()
        return {"lanes": lane_depths(services.redis), "sim_running": stats["running"], "sim_queued": stats["queued"]}

    async def fire(i: int) -> None:
        body = short_call(chat_rng, max_tokens=CHAT_MAX_TOKENS).body
        chat_calls.append(await timed_post(client, "/v1/chat/completions", body, auth, "chat", t0))

    sampler = Sampler(probe, 0.5, t0).start()
    chat_task = asyncio.create_task(open_loop(SCALE.real_rate(chat_rate), SCALE.real_s(sizes.solo_s + limit_sim),
                                              fire, poisson=True, rng=random.Random(seed + 2), stop=stop))
    try:
        await asyncio.sleep(SCALE.real_s(sizes.solo_s))
        batch_run = await _batch_run(sdk, lines, payload, t0, SCALE.real_s(limit_sim))
    finally:
        stop.set()
        await chat_task
        samples = await sampler.stop()
        await client.aclose()
        await sim.aclose()
    return {"chat": chat_calls, "batch": batch_run, "samples": samples, "t0_epoch": t0_epoch}


async def _batch_run(sdk, lines: list[dict], payload: bytes, t0: float, limit_real_s: float) -> dict:
    """Upload ``payload`` (the lines as JSONL), create, poll to a final
    status and read the output, as a service would with the official SDK
    (``sdk``: an ``AsyncOpenAI``). Times are real seconds from t0."""
    uploaded_at = time.monotonic() - t0
    upload = await sdk.files.create(file=("in.jsonl", payload), purpose="batch")
    created = await sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    created_at = time.monotonic() - t0
    progress = []
    deadline = time.monotonic() + limit_real_s
    current = created
    while current.status not in FINAL and time.monotonic() < deadline:
        await asyncio.sleep(POLL_REAL_S)
        current = await sdk.batches.retrieve(created.id)
        counts = current.request_counts
        progress.append({"t": time.monotonic() - t0, "status": current.status,
                         "completed": counts.completed if counts else 0, "failed": counts.failed if counts else 0})
    ended_at = time.monotonic() - t0
    output = (await sdk.files.content(current.output_file_id)).text if current.output_file_id else ""
    errors = (await sdk.files.content(current.error_file_id)).text if current.error_file_id else ""
    await sdk.close()
    counts = current.request_counts
    return {
        "id": created.id, "input_file_id": upload.id, "status": current.status, "timed_out": current.status not in FINAL,
        "counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed} if counts else {},
        "uploaded_at": uploaded_at, "created_at": created_at, "ended_at": ended_at, "progress": progress,
        "server_times": {name: getattr(current, name, None) for name in (
            "created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")},
        "errors": current.errors.model_dump() if current.errors else None,
        "output": output_read(output), "error_file": output_read(errors),
        "input_custom_ids": [line["custom_id"] for line in lines],
    }


def _ledger(*, batch_id: str, workload_ids: tuple[int, int], expected_lines: int, timeout_s: float = 60.0) -> dict:
    """The batch's ledger rows (the request ids its lines' Job rows carry)
    and both workloads' rows, once the batch's rows are all in (polled with
    a deadline)."""
    from budgets.models import UsageRecord
    from gateway.models import Job

    deadline = time.monotonic() + timeout_s
    while True:
        request_ids = list(Job.objects.filter(batch_id=batch_id).exclude(request_id="")
                           .values_list("request_id", flat=True))
        rows = UsageRecord.objects.filter(request_id__in=request_ids)
        if rows.filter(status="ok").count() >= expected_lines or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    fields = ("request_id", "created_at", "workload_id", "lane", "status", "borrowed", "actual_input_tokens",
              "actual_output_tokens", "upstream_ms", "total_ms", "endpoint")

    def plain(queryset) -> list[dict]:
        return [{**r, "created_at": r["created_at"].timestamp()} for r in queryset.order_by("created_at").values(*fields)]

    return {"job_request_ids": len(request_ids), "batch_rows": plain(rows),
            "workload_rows": {str(wid): plain(UsageRecord.objects.filter(workload_id=wid)) for wid in workload_ids}}


# --- analysis ---------------------------------------------------------------------------


def _tokens(row: dict) -> int:
    return row["actual_input_tokens"] + row["actual_output_tokens"]


def _analyse(run: dict, *, sizes: Sizes, seed: int, quick: bool, chat, batch, chat_rate: float,
             expected: IdleBound, pool_id: int, pool_share: float = 0.25) -> dict:
    f = SCALE.factor
    b = run["batch"]
    ledger = run["ledger"]
    t0_epoch = run["t0_epoch"]
    # The batch's span, simulated seconds from t0: created (the SDK's answer)
    # to its final status as polled; its lines ran from the first admission.
    created_s, ended_s = b["created_at"] * f, b["ended_at"] * f
    batch_rows = ledger["batch_rows"]
    chat_rows = ledger["workload_rows"][str(chat.workload_id)]
    during = [r for r in chat_rows if created_s <= (r["created_at"] - t0_epoch) * f < ended_s]
    span_min = max(ended_s - created_s, 1e-9) / 60.0
    chat_tpm = sum(_tokens(r) for r in during) / span_min
    chat_rpm = len(during) / span_min
    batch_tokens = sum(_tokens(r) for r in batch_rows)
    bound = IdleBound(pool_tpm=POOL_BUDGET_TPM, pool_rpm=POOL_BUDGET_RPM, chat_tpm=chat_tpm, chat_rpm=chat_rpm,
                      batch_ceiling_tpm=BATCH["ceiling_tpm"], batch_rpm=BATCH["rpm"], batch_tokens=batch_tokens,
                      batch_lines=len(b["input_custom_ids"]),
                      batch_service_s=sum(r["upstream_ms"] for r in batch_rows) / 1000.0 * f,
                      share_places=share_places(pool_share))
    took = ended_s - created_s
    phases = dict(warm_s=sizes.warm_s, uploaded_s=b["uploaded_at"] * f, ended_s=ended_s)
    solo = _chat_phase(run["chat"], "alone", **phases)
    beside = _chat_phase(run["chat"], "beside", **phases)
    out, err = b["output"], b["error_file"]
    batch_workload_rows = ledger["workload_rows"][str(batch.workload_id)]
    answered = sorted(out["custom_ids"] + err["custom_ids"])
    checks = {
        "completed": b["status"] == "completed" and b["counts"].get("completed") == sizes.lines,
        "every_line_once": answered == sorted(b["input_custom_ids"]),
        "tokens_equal": out["tokens"] == batch_tokens and batch_tokens > 0,
        "one_row_per_line": sum(1 for r in batch_rows if r["status"] == "ok") == out["statuses"].get("200", 0),
        "batch_lane": {r["lane"] for r in batch_rows} <= {"batch"},
    }
    p99_ratio = ratio(beside["p99"], solo["p99"])
    engine = _engine_load(run["samples"], solo=(sizes.warm_s, sizes.solo_s), beside=(created_s, ended_s),
                          prefill_tokens_per_s=(out["prompt_tokens"] / took if took > 0 else 0.0))
    time_ratio = took / bound.seconds if bound.seconds not in (0, float("inf")) else None
    return {
        "scenario": NAME, "seed": seed, "quick": quick, "time_scale": f, "sizes": asdict(sizes),
        "clock": "simulated seconds; rates per simulated minute (gateway buckets configured x time scale)",
        "pool": {"tpm": POOL_TPM, "rpm": POOL_RPM, "headroom": HEADROOM, "burst_s": BURST_SIM_S, "slots": POOL_SLOTS,
                 "budget_tpm": POOL_BUDGET_TPM, "budget_rpm": POOL_BUDGET_RPM},
        "chat_cfg": CHAT, "chat_load": CHAT_LOAD, "chat_rate_per_sim_s": chat_rate, "batch_cfg": BATCH,
        "line": {"prompt_tokens": LINE_PROMPT_TOKENS, "max_tokens": LINE_MAX_TOKENS, "output_median": LINE_MEDIAN},
        "targets": TARGETS,
        "chat": {"solo": solo, "beside": beside, "p99_ratio": p99_ratio},
        "batch": {"id": b["id"], "status": b["status"], "timed_out": b["timed_out"], "counts": b["counts"],
                  "errors": b["errors"], "uploaded_s": b["uploaded_at"] * f, "created_s": created_s, "ended_s": ended_s,
                  "took_s": took,
                  "upload_s": (b["created_at"] - b["uploaded_at"]) * f, "server_times": b["server_times"],
                  "first_admission_s": min(((r["created_at"] - t0_epoch) * f for r in batch_rows), default=None),
                  "output": {k: v for k, v in out.items() if k not in ("custom_ids", "request_ids")},
                  "error_file": {k: v for k, v in err.items() if k not in ("custom_ids", "request_ids")}},
        "pool_share": pool_share,
        "bound": {**asdict(bound), "idle_tpm": bound.idle_tpm, "idle_rpm": bound.idle_rpm,
                  "budget_seconds": bound.budget_seconds, "share_seconds": bound.share_seconds,
                  "seconds": bound.seconds, "binding": bound.binding},
        "expected_bound": {**asdict(expected), "idle_tpm": expected.idle_tpm, "seconds": expected.seconds},
        "time_ratio": time_ratio,
        "engine": engine,
        "ledger": {"job_request_ids": ledger["job_request_ids"], "batch_rows": len(batch_rows),
                   "batch_rows_ok": sum(1 for r in batch_rows if r["status"] == "ok"), "batch_tokens": batch_tokens,
                   "batch_workload_rows": len(batch_workload_rows),
                   "batch_workload_tokens": sum(_tokens(r) for r in batch_workload_rows),
                   "lanes": sorted({r["lane"] for r in batch_rows}),
                   "endpoints": sorted({r["endpoint"] for r in batch_rows}),
                   "output_request_ids_in_ledger": len(set(out["request_ids"])
                                                       & {r["request_id"] for r in batch_rows})},
        "checks": checks,
        "met": {"chat_p99": p99_ratio is not None and p99_ratio <= TARGETS["chat_p99_ratio"],
                "chat_refused": sum(beside["errors"].values()) <= TARGETS["chat_refused"],
                "batch_time": time_ratio is not None and time_ratio <= TARGETS["batch_time_ratio"]
                and checks["completed"],
                "tokens": checks["tokens_equal"] and checks["one_row_per_line"] and checks["every_line_once"]},
        "progress": b["progress"],
        "batch_rows_at": [[round((r["created_at"] - t0_epoch) * f, 3), _tokens(r)] for r in batch_rows],
        "chat_rows_at": [[round((r["created_at"] - t0_epoch) * f, 3), _tokens(r)] for r in chat_rows],
        "calls": {"chat": calls_to_json(run["chat"])},
        "samples": run["samples"],
    }


def _engine_load(samples: list[dict], *, solo: tuple[float, float], beside: tuple[float, float],
                 prefill_tokens_per_s: float) -> dict:
    """What the simulated GPU did to chat's time per token, from its
    sequences running at once (sampled) and its own cost model: a decode
    step takes ``decode_base_ms + decode_per_seq_ms x running``, and each
    prompt's prefill stalls the steps for ``prefill_ms_per_token`` a token.
    The modelled ratio is how much slower a chat token was beside the batch;
    ``room_for_1_10`` the sequences beyond chat alone's that keep the step
    within 1.10x (where a scheduler aiming at the target would hold it)."""
    engine = SimConfig()
    f = SCALE.factor

    def mean_running(lo: float, hi: float) -> float | None:
        running = [s["sim_running"] for s in samples if "error" not in s and lo <= s["t"] * f < hi]
        return sum(running) / len(running) if running else None

    alone, with_batch = mean_running(*solo), mean_running(*beside)
    if alone is None or with_batch is None:
        return {"running_alone": alone, "running_beside": with_batch}

    def step_ms(running: float) -> float:
        return engine.decode_base_ms + engine.decode_per_seq_ms * running

    prefill_share = prefill_tokens_per_s * engine.prefill_ms_per_token / 1000.0
    return {
        "running_alone": alone, "running_beside": with_batch, "decode_base_ms": engine.decode_base_ms,
        "decode_per_seq_ms": engine.decode_per_seq_ms, "prefill_ms_per_token": engine.prefill_ms_per_token,
        "batch_prefill_share": prefill_share,
        "modelled_token_time_ratio": step_ms(with_batch) / step_ms(alone) * (1 + prefill_share),
        "room_for_1_10": 0.10 * step_ms(alone) / engine.decode_per_seq_ms,
    }


def chat_phase_of(start_s: float, latency_s: float, *, warm_s: float, uploaded_s: float, ended_s: float) -> str | None:
    """Which phase a chat call (simulated s) measures: "alone" if it ended
    before the batch's upload began, "beside" if it was still running then
    or started before the batch's final status, else none (the warm-up, or
    after the batch). The upload and the file's validation are the batch's
    load too: a call they slow is not chat alone."""
    if start_s < warm_s or start_s >= ended_s:
        return None
    return "alone" if start_s + latency_s < uploaded_s else "beside"


def _chat_phase(calls: list[Call], phase: str, **phases: float) -> dict:
    """Chat's answered latencies (simulated s) of the calls of ``phase``
    (``chat_phase_of``), with what did not succeed by code."""
    f = SCALE.factor
    mine = [c for c in calls if chat_phase_of(c.start * f, c.latency * f, **phases) == phase]
    errors: dict[str, int] = {}
    for c in mine:
        if not c.ok:
            errors[c.code or f"http_{c.status}"] = errors.get(c.code or f"http_{c.status}", 0) + 1
    return {**pcts([c.latency * f for c in mine if c.ok]), "sent": len(mine), "errors": errors}


# --- report -----------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def targets(data: dict) -> list[dict]:
    """Every target with its measured value (the summary table's row)."""
    bound, led, out = data["bound"], data["ledger"], data["batch"]["output"]
    took = data["batch"]["took_s"]
    return [
        {"what": "chat short p99 beside the batch / alone", "value": fmt(data["chat"]["p99_ratio"], 2),
         "target": f"≤ {TARGETS['chat_p99_ratio']:.2f}", "met": data["met"]["chat_p99"]},
        {"what": "chat requests not answered beside the batch",
         "value": f"{sum(data['chat']['beside']['errors'].values())} of {data['chat']['beside']['sent']}"
                  + (f" {data['chat']['beside']['errors']}" if data["chat"]["beside"]["errors"] else ""),
         "target": str(TARGETS["chat_refused"]), "met": data["met"]["chat_refused"]},
        {"what": "batch time / idle-capacity bound",
         "value": f"{fmt(data['time_ratio'], 2)} ({took:,.0f} s / {bound['seconds']:,.0f} s, {bound['binding']} "
                  f"bind; {data['batch']['status']})",
         "target": f"≤ {TARGETS['batch_time_ratio']:.2f}", "met": data["met"]["batch_time"]},
        {"what": "output file tokens = ledger tokens (rows)",
         "value": f"{out['tokens']:,} = {led['batch_tokens']:,} ({led['batch_rows_ok']:,} rows, "
                  f"{out['lines']:,} lines)", "target": "exact", "met": data["met"]["tokens"]},
    ]


def summarize(data: dict) -> str:
    pool, bound, b = data["pool"], data["bound"], data["batch"]
    solo, beside = data["chat"]["solo"], data["chat"]["beside"]
    led = data["ledger"]
    lines = [
        f"Pool {pool['tpm']:,} TPM / {pool['rpm']:,} RPM per simulated minute (admission budget "
        f"{pool['budget_tpm']:,.0f} TPM at headroom {pool['headroom']:g}; burst {pool['burst_s']:g} s; simulator "
        f"`{' '.join(SIM_ARGS)}`, pool in-flight limit {pool['slots']}). Chat reserved "
        f"{data['chat_cfg']['reserved_tpm']:,} TPM (lend 0), offered {data['chat_rate_per_sim_s']:.2f} short "
        f"requests/s ({data['chat_load']:.0%} of its reservation by estimate). The batch workload: reserved "
        f"{data['batch_cfg']['reserved_tpm']:,}, ceiling {data['batch_cfg']['ceiling_tpm']:,} TPM; "
        f"{data['sizes']['lines']:,} lines (~{data['line']['prompt_tokens']} prompt tokens, output median "
        f"{data['line']['output_median']}, max_tokens {data['line']['max_tokens']}), submitted with the official "
        f"`openai` SDK after {data['sizes']['solo_s']:.0f} s of chat alone. Time scale {data['time_scale']:g}.",
        "",
        md_table(["phase", "chat p50", "chat p95", "chat p99", "answered", "sent", "not answered"], [
            [name, fmt(p["p50"], 3), fmt(p["p95"], 3), fmt(p["p99"], 3), p["n"], p["sent"], p["errors"] or "none"]
            for name, p in (("chat alone", solo), ("chat beside the batch", beside))]),
        "",
        "**The bound.** Admission lets the pool take its budget P a minute; chat used C of it while the batch "
        "ran (its ledger rows); the batch can take at most min(its ceiling, P - C) tokens and min(its RPM, "
        "P_rpm - chat's RPM) requests a minute, so it needs at least 60 x max(tokens / idle TPM, lines / idle RPM) "
        "seconds (the budget bound). The feed holds at most K = floor(pool in-flight limit x "
        "SLUICE_BATCH_POOL_SHARE) batch lines on the pool at once, so it also needs its lines' service time "
        "(ledger upstream_ms) over K (the share bound). The bound is the larger:",
        "",
        md_table(["measure", "value"], [
            ["pool budget P (TPM / RPM)", f"{bound['pool_tpm']:,.0f} / {bound['pool_rpm']:,.0f}"],
            ["chat's use C beside the batch (TPM / RPM, actual)", f"{bound['chat_tpm']:,.0f} / {bound['chat_rpm']:,.1f}"],
            ["idle for the batch (TPM / RPM)", f"{bound['idle_tpm']:,.0f} / {bound['idle_rpm']:,.0f}"],
            ["batch tokens (ledger, actual) / lines", f"{bound['batch_tokens']:,} / {bound['batch_lines']:,}"],
            ["budget bound", f"{bound['budget_seconds']:,.0f} s"],
            ["share bound: service time of the lines / K",
             f"{bound['share_seconds']:,.0f} s ({bound['batch_service_s']:,.0f} s / {bound['share_places']}, share "
             f"{data['pool_share']:g})"],
            ["bound", f"**{bound['seconds']:,.0f} s** ({bound['binding']} bind)"],
            ["batch created → final status (polled)", f"**{b['took_s']:,.0f} s** ({b['status']}; upload took "
                                                        f"{b['upload_s']:.1f} s)"],
            ["request counts", b["counts"]],
            ["output file lines by status; error file lines",
             f"{b['output']['statuses']}; {b['error_file']['lines']}"],
            ["ledger rows of the batch's lines (ok) / Job request ids", f"{led['batch_rows']:,} "
                                                                       f"({led['batch_rows_ok']:,}) / "
                                                                       f"{led['job_request_ids']:,}"],
            ["tokens: output file usage / batch ledger rows / all rows of the batch workload",
             f"{b['output']['tokens']:,} / {led['batch_tokens']:,} / {led['batch_workload_tokens']:,}"],
            ["lanes and endpoints of the batch's rows", f"{led['lanes']}; {led['endpoints']}"],
        ]),
        "",
        _engine_text(data.get("engine") or {}),
        "",
        md_table(["target", "measured", "target value", "verdict"],
                 [[t["what"], f"**{t['value']}**", t["target"], _verdict(t["met"])] for t in targets(data)]),
    ]
    return "\n".join(lines)


def _engine_text(engine: dict) -> str:
    if "modelled_token_time_ratio" not in engine:
        return "The simulator's load was not sampled in both phases."
    return (f"**The simulated GPU.** It ran {engine['running_alone']:.1f} sequences at once on average with chat "
            f"alone and {engine['running_beside']:.1f} beside the batch; a decode step costs "
            f"{engine['decode_base_ms']:g} ms + {engine['decode_per_seq_ms']:g} ms per running sequence, and the "
            f"batch's prompts stalled the engine {engine['batch_prefill_share']:.1%} of the time (prefill "
            f"{engine['prefill_ms_per_token']:g} ms a token), so its cost model makes each chat token "
            f"{engine['modelled_token_time_ratio']:.2f}x as slow beside the batch. A chat p99 within 1.10x leaves "
            f"room for about {engine['room_for_1_10']:.0f} batch sequences beyond chat's own: the latency target's "
            "idle capacity, far below the tokens the admission bound counts.")


def plot(data: dict, plots_dir=PLOTS_DIR) -> list[str]:
    from bench.plots import cdf_plot, timeseries

    f = data["time_scale"]
    b = data["batch"]
    names = []
    calls = data["calls"]["chat"]
    phases = dict(warm_s=data["sizes"]["warm_s"], uploaded_s=b["uploaded_s"], ended_s=b["ended_s"])
    answered = [c for c in calls if c["status"] == 200]
    series = {label: [c["latency"] * f for c in answered
                      if chat_phase_of(c["start"] * f, c["latency"] * f, **phases) == phase]
              for label, phase in (("chat alone", "alone"), ("chat beside the batch", "beside"))}
    path = plots_dir / "batch_chat_latency_cdf.png"
    cdf_plot(series, path, title="Batch API beside chat: chat latency CDF", xlabel="latency, simulated s")
    names.append(path.name)

    bin_s = 10.0
    end = b["ended_s"] + bin_s
    n = int(end // bin_s) + 1
    per_min = {"batch": [0.0] * n, "chat": [0.0] * n}
    for label, key in (("batch", "batch_rows_at"), ("chat", "chat_rows_at")):
        for at, tokens in data[key]:
            i = int(at // bin_s)
            if 0 <= i < n:
                per_min[label][i] += tokens * 60.0 / bin_s
    xs = [i * bin_s for i in range(n)]
    path = plots_dir / "batch_tokens_per_minute.png"
    timeseries({"batch (ledger, by admission)": (xs, per_min["batch"]), "chat": (xs, per_min["chat"])}, path,
               title="Batch API beside chat: tokens per minute (ledger)", xlabel="simulated s",
               ylabel="tokens / min", step=True,
               hlines={"pool budget P": data["pool"]["budget_tpm"], "idle for the batch": data["bound"]["idle_tpm"]},
               spans=[(b["created_s"], b["ended_s"], "batch")])
    names.append(path.name)
    return names


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--lines", type=int, default=None, help=f"the batch's lines (default {FULL_LINES:,})")
    parser.add_argument("--lines-in-flight", type=int, default=None,
                        help="SLUICE_BATCH_LINES_IN_FLIGHT for the run (default: the setting's)")
    parser.add_argument("--pool-share", type=float, default=None,
                        help="SLUICE_BATCH_POOL_SHARE for the run (default: the environment's, else the setting's)")
    args = parser.parse_args()
    data = main(seed=args.seed, quick=args.quick, lines=args.lines, lines_in_flight=args.lines_in_flight,
                pool_share=args.pool_share)
    _, plots_dir = report_paths(quick=args.quick)
    plots_dir.mkdir(parents=True, exist_ok=True)
    plot(data, plots_dir)
    print(summarize(data))


if __name__ == "__main__":
    _cli()
