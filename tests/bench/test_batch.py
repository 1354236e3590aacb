"""The Batch API scenario's arithmetic and report, without running it: the
idle-capacity bound, the reading of OpenAI-format output files, the lines
it submits, and the analysis of a made-up run (chat latencies, ledger rows,
a batch's times) down to the summary's verdicts. No timing assertions
(CONVENTIONS: speed claims live in bench/).

No __init__.py in this folder on purpose (see test_baseline_gateway.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import batch
from bench.batch import IdleBound, Sizes, batch_lines, jsonl, output_read
from bench.load import Call

F = batch.SCALE.factor


def _bound(**changes) -> IdleBound:
    values = dict(pool_tpm=120_000, pool_rpm=4_800, chat_tpm=20_000, chat_rpm=300, batch_ceiling_tpm=120_000,
                  batch_rpm=4_800, batch_tokens=1_000_000, batch_lines=5_000)
    return IdleBound(**{**values, **changes})


def test_the_bound_is_the_batch_tokens_at_what_chat_leaves_of_the_pool():
    bound = _bound()
    # 120k - 20k = 100k TPM idle: 1M tokens take 10 minutes
    assert bound.idle_tpm == 100_000
    assert bound.seconds == pytest.approx(600.0)
    assert bound.binding == "tokens"


def test_the_ceiling_and_the_request_rate_bound_it_too():
    # a ceiling below what chat leaves binds instead
    assert _bound(batch_ceiling_tpm=50_000).seconds == pytest.approx(1_200.0)
    # 5,000 lines at 4,800 - 300 = 4,500 RPM take 66.7 s; tokens would take 6 s
    small = _bound(batch_tokens=10_000)
    assert small.binding == "requests"
    assert small.seconds == pytest.approx(60 * 5_000 / 4_500)


def test_the_share_of_places_binds_when_the_lines_service_time_over_k_is_longer():
    # 5,000 lines of 3 s service each, 8 at once: 1,875 s against the 600 s
    # the budget allows
    bound = _bound(batch_service_s=15_000.0, share_places=8)
    assert bound.budget_seconds == pytest.approx(600.0)
    assert bound.share_seconds == pytest.approx(1_875.0)
    assert bound.seconds == pytest.approx(1_875.0) and bound.binding == "share of places"
    # a short service time leaves the budget bound binding
    quick = _bound(batch_service_s=2_400.0, share_places=8)
    assert quick.share_seconds == pytest.approx(300.0)
    assert quick.seconds == pytest.approx(600.0) and quick.binding == "tokens"
    # not share-limited: no share bound
    assert _bound(batch_service_s=15_000.0).share_seconds == 0.0


def test_the_places_are_the_pool_limit_times_the_share_rounded_down_at_least_one():
    assert batch.share_places(0.25) == 8  # the scenario's 32-place pool
    assert batch.share_places(0.2) == 6  # 6.4
    assert batch.share_places(0.01) == 1
    assert batch.share_places(0.5, max_concurrency=7) == 3


def test_the_share_is_the_platform_environments_else_the_settings_default(settings):
    settings.SLUICE_BATCH_POOL_SHARE = 0.25
    assert batch._share_run_with({"SLUICE_BATCH_POOL_SHARE": "0.2"}) == 0.2
    assert batch._share_run_with({}) == 0.25
    assert batch._share_run_with({"SLUICE_BATCH_POOL_SHARE": " "}) == 0.25


def test_no_idle_capacity_is_an_infinite_bound():
    bound = _bound(chat_tpm=120_000)
    assert bound.seconds == float("inf") and bound.binding == "no idle capacity"


def test_output_lines_are_counted_with_their_usage_and_request_ids():
    text = "\n".join(json.dumps(line) for line in [
        {"id": "batch_req_1", "custom_id": "a", "error": None,
         "response": {"status_code": 200, "request_id": "req_1",
                      "body": {"usage": {"prompt_tokens": 150, "completion_tokens": 40, "total_tokens": 190}}}},
        {"id": "batch_req_2", "custom_id": "b", "error": None,
         "response": {"status_code": 200, "request_id": "req_2",
                      "body": {"usage": {"prompt_tokens": 151, "completion_tokens": 9, "total_tokens": 160}}}},
        {"id": "batch_req_3", "custom_id": "c", "response": {"status_code": 400, "request_id": "req_3",
                                                              "body": {"error": {"code": "invalid_request"}}}},
    ]) + "\n\n"
    read = output_read(text)
    assert read["lines"] == 3 and read["custom_ids"] == ["a", "b", "c"]
    assert read["request_ids"] == ["req_1", "req_2", "req_3"]
    assert read["statuses"] == {"200": 2, "400": 1}
    assert (read["prompt_tokens"], read["completion_tokens"], read["tokens"]) == (301, 49, 350)
    assert output_read("")["lines"] == 0


def test_the_lines_are_the_same_for_a_seed_and_in_openais_format():
    lines = batch_lines(seed=1, count=20)
    assert lines == batch_lines(seed=1, count=20)
    assert lines != batch_lines(seed=2, count=20)
    assert len({line["custom_id"] for line in lines}) == 20
    first = lines[0]
    assert (first["method"], first["url"]) == ("POST", "/v1/chat/completions")
    assert first["body"]["max_tokens"] == batch.LINE_MAX_TOKENS
    assert 1 <= first["body"]["sim"]["output_tokens"] <= 4 * batch.LINE_MAX_TOKENS
    parsed = [json.loads(raw) for raw in jsonl(lines).decode().splitlines()]
    assert parsed == lines


def _made_up_run(*, beside_latency: float, took_real_s: float, output_tokens: int) -> tuple[dict, dict]:
    """Chat alone 0-40 s sim at 0.2 s, beside the batch (40 s sim on) at
    ``beside_latency``; the batch's 4 lines of 100 tokens each in the ledger."""
    t0_epoch = 1_000.0
    chat_calls = [Call("chat", start=i / F, latency=0.2 / F, status=200) for i in range(5, 40)]
    created_real = 40 / F
    chat_calls += [Call("chat", start=created_real + i / F, latency=beside_latency / F, status=200)
                   for i in range(int(took_real_s * F))]
    chat_calls.append(Call("chat", start=created_real + 1 / F, latency=0.1, status=429, code="workload_tpm"))

    def row(at_sim: float, tokens: tuple[int, int], workload_id: int, request_id: str) -> dict:
        return {"request_id": request_id, "created_at": t0_epoch + at_sim / F, "workload_id": workload_id,
                "lane": "batch" if workload_id == 2 else "interactive", "status": "ok", "borrowed": False,
                "actual_input_tokens": tokens[0], "actual_output_tokens": tokens[1], "upstream_ms": 90, "total_ms": 100,
                "endpoint": "/v1/chat/completions"}

    batch_rows = [row(41 + i, (70, 30), 2, f"req_b{i}") for i in range(4)]
    # chat beside the batch: 60 tokens a simulated second
    chat_rows = [row(40 + i, (20, 40), 1, f"req_c{i}") for i in range(int(took_real_s * F))]
    output = {"lines": 4, "custom_ids": ["l0", "l1", "l2", "l3"], "request_ids": [r["request_id"] for r in batch_rows],
              "statuses": {"200": 4}, "prompt_tokens": 280, "completion_tokens": output_tokens - 280,
              "tokens": output_tokens}
    run = {
        "t0_epoch": t0_epoch, "chat": chat_calls, "samples": [],
        "batch": {"id": "batch_x", "status": "completed", "timed_out": False,
                  "counts": {"total": 4, "completed": 4, "failed": 0}, "uploaded_at": created_real - 0.1,
                  "created_at": created_real, "ended_at": created_real + took_real_s, "progress": [],
                  "server_times": {}, "errors": None, "output": output,
                  "error_file": output_read(""), "input_custom_ids": ["l0", "l1", "l2", "l3"]},
        "ledger": {"job_request_ids": 4, "batch_rows": batch_rows,
                   "workload_rows": {"1": chat_rows, "2": batch_rows}},
    }
    expected = _bound(batch_tokens=400, batch_lines=4)
    return run, {"sizes": Sizes(lines=4, solo_s=40.0, warm_s=5.0), "seed": 1, "quick": True,
                 "chat": SimpleNamespace(workload_id=1), "batch": SimpleNamespace(workload_id=2), "chat_rate": 1.0,
                 "expected": expected, "pool_id": 1}


def test_a_made_up_run_is_judged_against_its_bound_and_its_ledger(tmp_path):
    # given a batch of 400 ledger tokens that took 20 s sim, chat at 3,600 TPM
    # beside it, chat's p99 unchanged
    run, kwargs = _made_up_run(beside_latency=0.2, took_real_s=20 / F, output_tokens=400)
    # when
    data = batch._analyse(run, **kwargs)
    # then the bound is 400 tokens at (120,000 - 3,600) TPM; the share bound
    # (4 lines of 90 ms real, 8 places) is shorter
    assert data["pool_share"] == 0.25 and data["bound"]["share_places"] == 8
    assert data["bound"]["share_seconds"] == pytest.approx(4 * 0.09 * F / 8)
    assert data["bound"]["budget_seconds"] == data["bound"]["seconds"]
    assert data["bound"]["chat_tpm"] == pytest.approx(3_600)
    assert data["bound"]["idle_tpm"] == pytest.approx(116_400)
    assert data["bound"]["chat_rpm"] == pytest.approx(60)
    assert data["bound"]["binding"] == "tokens"
    assert data["bound"]["seconds"] == pytest.approx(60 * 400 / 116_400)
    assert data["batch"]["took_s"] == pytest.approx(20.0)
    assert data["time_ratio"] == pytest.approx(20.0 / data["bound"]["seconds"])
    assert data["chat"]["p99_ratio"] == pytest.approx(1.0)
    assert data["chat"]["beside"]["errors"] == {"workload_tpm": 1}
    assert data["met"] == {"chat_p99": True, "chat_refused": False, "batch_time": False, "tokens": True}
    assert data["checks"]["batch_lane"] and data["ledger"]["output_request_ids_in_ledger"] == 4
    body = batch.summarize(data)
    assert "| chat short p99 beside the batch / alone | **1.00** | ≤ 1.10 | met |" in body
    assert "**400 = 400 (4 rows, 4 lines)**" in body
    assert "| share bound: service time of the lines / K | 0 s (1 s / 8, share 0.25) |" in body
    assert sorted(batch.plot(data, tmp_path)) == ["batch_chat_latency_cdf.png", "batch_tokens_per_minute.png"]


def test_a_slower_chat_or_a_token_mismatch_is_missed():
    run, kwargs = _made_up_run(beside_latency=0.25, took_real_s=20 / F, output_tokens=401)
    data = batch._analyse(run, **kwargs)
    assert data["chat"]["p99_ratio"] == pytest.approx(1.25)
    assert data["met"]["chat_p99"] is False and data["met"]["tokens"] is False
    assert [t["met"] for t in batch.targets(data)] == [False, False, False, False]


def test_a_run_without_refusals_inside_its_bound_meets_every_target():
    # 40,000 tokens in the ledger and the output, 24 s sim; chat at 3,600 TPM
    # leaves 116,400: the bound is 20.6 s, the ratio 1.16
    run, kwargs = _made_up_run(beside_latency=0.2, took_real_s=24 / F, output_tokens=40_000)
    run["chat"] = [c for c in run["chat"] if c.ok]
    for row in run["ledger"]["batch_rows"]:
        row["actual_input_tokens"], row["actual_output_tokens"] = 7_000, 3_000
    data = batch._analyse(run, **kwargs)
    assert data["time_ratio"] == pytest.approx(24 / (60 * 40_000 / 116_400))
    assert all(data["met"].values()), data["met"]
    assert "| met |" in batch.summarize(data) and "missed" not in batch.summarize(data)


def test_a_share_limited_run_is_judged_against_its_service_time_over_k():
    # given 4 lines of 5 s real service each (20 s sim at time scale 4) and a
    # share of 1 place: 80 s sim, longer than the 0.2 s token bound
    run, kwargs = _made_up_run(beside_latency=0.2, took_real_s=90 / F, output_tokens=400)
    run["chat"] = [c for c in run["chat"] if c.ok]
    for row in run["ledger"]["batch_rows"]:
        row["upstream_ms"] = 5_000
    # when the platform ran with a share of 0.02 (floor(32 x 0.02) = 0, at least 1)
    data = batch._analyse(run, **kwargs, pool_share=0.02)
    # then the share binds and 90 s is within 1.2x of 4 x 5 x F s
    assert data["bound"]["share_places"] == 1
    assert data["bound"]["share_seconds"] == pytest.approx(4 * 5 * F)
    assert data["bound"]["binding"] == "share of places"
    assert data["time_ratio"] == pytest.approx(90 / (4 * 5 * F))
    assert data["met"]["batch_time"] is True
    assert "share of places bind" in batch.summarize(data)
    # and the same run on twice the places misses it
    wider = batch._analyse(run, **kwargs, pool_share=0.07)
    assert wider["bound"]["share_places"] == 2 and wider["met"]["batch_time"] is False


def test_chat_alone_ends_where_the_upload_begins():
    phases = dict(warm_s=10.0, uploaded_s=200.0, ended_s=900.0)
    assert batch.chat_phase_of(5.0, 0.5, **phases) is None  # warming up
    assert batch.chat_phase_of(150.0, 1.0, **phases) == "alone"
    # started alone, still running when the 1 MB upload stalled the gateway
    assert batch.chat_phase_of(199.0, 8.0, **phases) == "beside"
    assert batch.chat_phase_of(500.0, 1.0, **phases) == "beside"
    assert batch.chat_phase_of(900.0, 1.0, **phases) is None


def test_a_call_slowed_by_the_upload_counts_beside_the_batch_not_alone():
    run, kwargs = _made_up_run(beside_latency=0.2, took_real_s=20 / F, output_tokens=400)
    run["chat"].append(Call("chat", start=39.5 / F, latency=8.0 / F, status=200))
    data = batch._analyse(run, **kwargs)
    assert data["chat"]["solo"]["n"] == 35 and data["chat"]["solo"]["p99"] == pytest.approx(0.2)
    assert data["chat"]["beside"]["n"] == 21 and data["chat"]["beside"]["p99"] > 1.0


def test_the_engine_model_turns_running_sequences_into_chat_slowdown():
    # given 4 sequences at once with chat alone, 24 beside the batch, and the
    # batch prefilling 500 tokens a simulated second
    samples = [{"t": t / F, "sim_running": 4, "sim_queued": 0} for t in range(10, 40)]
    samples += [{"t": t / F, "sim_running": 24, "sim_queued": 0} for t in range(40, 80)]
    samples.append({"t": 50 / F, "error": "timeout"})
    engine = batch._engine_load(samples, solo=(10, 40), beside=(40, 80), prefill_tokens_per_s=500)
    # then (20 + 0.5 x 24) / (20 + 0.5 x 4) x (1 + 500 x 0.1 / 1000): 32 / 22 x 1.05
    assert (engine["running_alone"], engine["running_beside"]) == (4, 24)
    assert engine["batch_prefill_share"] == pytest.approx(0.05)
    assert engine["modelled_token_time_ratio"] == pytest.approx(32 / 22 * 1.05)
    assert engine["room_for_1_10"] == pytest.approx(0.1 * 22 / 0.5)
    assert "32 / 22" not in batch._engine_text(engine) and "1.53x as slow" in batch._engine_text(engine)
    assert batch._engine_load([], solo=(0, 1), beside=(1, 2), prefill_tokens_per_s=0)["running_alone"] is None
