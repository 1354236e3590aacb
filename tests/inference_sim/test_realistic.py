"""Realistic mode: calibration profiles, Pareto output lengths, and the
engine in virtual time (the same arithmetic the server sleeps through)."""

from __future__ import annotations

import dataclasses

import pytest

from inference_sim.config import PROFILES, SimConfig, parse_config
from inference_sim.sampling import OutputLengthSampler
from inference_sim.virtual import closed_loop, sweep


def test_profile_sets_defaults_that_flags_and_env_override():
    # given a calibrated profile
    cfg = parse_config(["--profile", "a100-llama3-8b"], environ={})
    # then its values become the defaults
    assert (cfg.slots, cfg.kv_cache_tokens, cfg.decode_base_ms) == (256, 450_000, 12.0)
    assert cfg.profile == "a100-llama3-8b"
    # and an env var beats the profile, a flag beats both
    cfg = parse_config(["--profile", "a100-llama3-8b", "--slots", "8"], environ={"SIM_KV_CACHE_TOKENS": "1000"})
    assert (cfg.slots, cfg.kv_cache_tokens, cfg.decode_base_ms) == (8, 1000, 12.0)
    cfg = parse_config([], environ={"SIM_PROFILE": "h100x2-llama3-70b"})
    assert cfg.prefill_ms_per_token == PROFILES["h100x2-llama3-70b"]["prefill_ms_per_token"]
    assert parse_config([], environ={}).slots == SimConfig().slots


def test_unknown_profile_and_distribution_are_rejected():
    with pytest.raises(SystemExit):
        parse_config(["--profile", "tpu-v9"], environ={})
    with pytest.raises(SystemExit):
        parse_config(["--output-dist", "uniform"], environ={})


def test_pareto_sampler_is_seeded_with_the_median_and_a_heavier_tail():
    first = [OutputLengthSampler(3, 100, 1.0, "pareto", 1.2).sample() for _ in range(3)]
    assert len(set(first)) == 1
    pareto = OutputLengthSampler(3, 100, 1.0, "pareto", 1.2)
    lognormal = OutputLengthSampler(3, 100, 0.5)
    p = sorted(pareto.sample() for _ in range(4000))
    ln = sorted(lognormal.sample() for _ in range(4000))
    assert 85 <= p[2000] <= 115  # median kept
    assert p[3996] > 5 * ln[3996]  # far heavier tail than a narrow lognormal
    assert min(p) >= round(100 / 2 ** (1 / 1.2)) - 1  # Pareto's scale is its minimum


def test_virtual_engine_single_request_is_exact_step_arithmetic():
    # given the demo engine and one client with fixed lengths
    cfg = SimConfig()
    done = closed_loop(cfg, 1, lambda c, i: ("x", 100, 10), duration_s=0.5)
    first = done[0]
    # then the prefill step costs prefill + one decode step, and each later step base + per-sequence
    assert first.prefill_ms == pytest.approx(0.1 * 100 + 20 + 0.5)
    assert first.decode_ms == pytest.approx(9 * 20.5)
    assert first.latency_s == pytest.approx((first.prefill_ms + first.decode_ms) / 1000)


def test_virtual_sweep_has_the_shape_of_real_engines():
    # Throughput grows near-linearly while the batch has room, then stops at
    # the slot limit; past it TTFT is queueing and grows with concurrency.
    cfg = dataclasses.replace(SimConfig(), slots=8)
    points = {p.concurrency: p for p in sweep(cfg, [1, 4, 8, 16, 32], 200, 50, duration_s=120, warmup_s=20)}
    assert points[4].output_tokens_per_s > 3 * points[1].output_tokens_per_s
    assert points[16].output_tokens_per_s == pytest.approx(points[8].output_tokens_per_s, rel=0.1)
    assert points[32].ttft_ms_mean > 2 * points[16].ttft_ms_mean > 2 * points[8].ttft_ms_mean
    assert points[1].itl_ms_mean < points[8].itl_ms_mean


def test_profile_reproduces_the_published_single_stream_numbers():
    # A100 Llama-3.1-8B: ~75 output tok/s at concurrency 1 for 1,024/128 (docs/calibration.md).
    cfg = SimConfig(**PROFILES["a100-llama3-8b"])
    (point,) = sweep(cfg, [1], 1024, 128, duration_s=60, warmup_s=5)
    assert 65 <= point.output_tokens_per_s <= 90
