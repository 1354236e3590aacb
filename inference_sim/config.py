"""Simulator configuration: one table of options, settable by CLI flag or env var.

Every option ``name`` is the flag ``--name-with-dashes`` and the environment
variable ``SIM_NAME``; a flag beats the environment, which beats the default.
A handful of options (``RUNTIME_KEYS``) can also change while the server runs,
through ``POST /admin/capacity`` or a ``--schedule`` entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "SIM_"

# Options that may change at run time, and the check each new value must pass.
RUNTIME_KEYS: dict[str, tuple[type, str]] = {
    "tpm": (int, "an integer >= 0 (0 = unlimited)"),
    "rpm": (int, "an integer >= 0 (0 = unlimited)"),
    "slots": (int, "an integer >= 1"),
    "capacity_factor": (float, "a number > 0"),
    "kv_cache_tokens": (int, "an integer >= 1"),
}

# Outage fields a schedule entry may carry besides RUNTIME_KEYS.
SCHEDULE_OUTAGE_KEYS = ("outage_s", "outage_status")
OUTAGE_STATUSES = (429, 500, 502, 503)


@dataclass
class ScheduleEntry:
    """A change applied ``at_s`` simulated seconds after start (or the last reset)."""

    at_s: float
    changes: dict[str, Any]
    outage_s: float | None = None
    outage_status: int = 503

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at_s": self.at_s, **self.changes}
        if self.outage_s is not None:
            out["outage_s"] = self.outage_s
            out["outage_status"] = self.outage_status
        return out


# Named engine calibrations (``--profile``): defaults for the engine's
# parameters, which any explicit flag or SIM_* variable still overrides.
# "demo" is the plain defaults below; the others are fitted to published
# concurrency sweeps (docs/calibration.md has the sources, the fit and the
# comparison; ``python -m bench.calibration`` redraws it).
PROFILES: dict[str, dict[str, Any]] = {
    "demo": {},
    # Llama-3.1-8B-Instruct bf16 on one A100 (vLLM): ~75 output tok/s at
    # concurrency 1 and ~6.6x that at 8, for 1,024 prompt / 128 output tokens.
    "a100-llama3-8b": {"slots": 256, "kv_cache_tokens": 450_000, "decode_base_ms": 12.0,
                       "decode_per_seq_ms": 0.05, "prefill_ms_per_token": 0.06},
    # Llama-3.3-70B-Instruct fp8 on 2 x H100 (TP2, NVIDIA NIM): ITL 18.6 ms at
    # concurrency 1 rising to ~93 ms, throughput flat at ~920 tok/s from ~100
    # concurrent requests (KV cache full), for 5,000 prompt / 500 output tokens.
    "h100x2-llama3-70b": {"slots": 256, "kv_cache_tokens": 550_000, "decode_base_ms": 18.0,
                          "decode_per_seq_ms": 0.05, "prefill_ms_per_token": 0.078},
}
OUTPUT_DISTRIBUTIONS = ("lognormal", "pareto")


@dataclass
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    models: list[str] = field(default_factory=lambda: ["sim-small", "sim-large"])
    # Served on /v1/embeddings only (as vLLM serves an embedding model).
    embedding_models: list[str] = field(default_factory=lambda: ["sim-embed"])
    embedding_dimensions: int = 256
    embedding_max_input_tokens: int = 8192
    encoding: str = "cl100k_base"
    profile: str = "demo"
    # Output length: heavy-tailed around the median, truncated at max_tokens.
    seed: int = 42
    output_dist: str = "lognormal"
    output_median: float = 128.0
    output_sigma: float = 1.0
    output_pareto_alpha: float = 1.5
    default_max_tokens: int = 256
    # Engine (see engine.py for where the defaults come from).
    slots: int = 16
    kv_cache_tokens: int = 65536
    decode_base_ms: float = 20.0
    decode_per_seq_ms: float = 0.5
    prefill_ms_per_token: float = 0.1
    capacity_factor: float = 1.0
    time_scale: float = 1.0
    zero_latency: bool = False
    # Provider limits over a sliding 60 s window of simulated time; 0 = unlimited.
    tpm: int = 0
    rpm: int = 0
    schedule: list[ScheduleEntry] = field(default_factory=list)
    log_level: str = "warning"
    access_log: bool = False

    def runtime_values(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in RUNTIME_KEYS}

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["schedule"] = [entry.to_dict() for entry in self.schedule]
        return out

    def validate(self) -> None:
        if not self.models or any(not m for m in self.models):
            raise ValueError("models must be a non-empty comma-separated list")
        if set(self.models) & set(self.embedding_models):
            raise ValueError("a model is either a chat model or an embedding model, not both")
        if self.embedding_dimensions < 1 or self.embedding_max_input_tokens < 1:
            raise ValueError("embedding_dimensions and embedding_max_input_tokens must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.output_median <= 0 or self.output_sigma < 0:
            raise ValueError("output_median must be > 0 and output_sigma >= 0")
        if self.output_dist not in OUTPUT_DISTRIBUTIONS:
            raise ValueError(f"output_dist must be one of {list(OUTPUT_DISTRIBUTIONS)}")
        if self.output_pareto_alpha <= 0:
            raise ValueError("output_pareto_alpha must be > 0")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if min(self.decode_base_ms, self.decode_per_seq_ms, self.prefill_ms_per_token) < 0:
            raise ValueError("step-time parameters must be >= 0")
        check_runtime_changes(self.runtime_values())


def check_runtime_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Validated, type-converted copy of a runtime update; ValueError if bad."""
    unknown = sorted(set(changes) - set(RUNTIME_KEYS))
    if unknown:
        raise ValueError(f"unknown capacity field(s) {unknown}; allowed: {sorted(RUNTIME_KEYS)}")
    clean: dict[str, Any] = {}
    for key, value in changes.items():
        kind, rule = RUNTIME_KEYS[key]
        # bool is an int subclass; "true" is never a sensible capacity.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be {rule}")
        if kind is int and value != int(value):
            raise ValueError(f"{key} must be {rule}")
        value = kind(value)
        minimum_ok = {
            "tpm": value >= 0,
            "rpm": value >= 0,
            "slots": value >= 1,
            "capacity_factor": value > 0,
            "kv_cache_tokens": value >= 1,
        }[key]
        if not minimum_ok:
            raise ValueError(f"{key} must be {rule}")
        clean[key] = value
    return clean


def parse_schedule(raw: str | list[Any] | None) -> list[ScheduleEntry]:
    """Parse ``--schedule`` JSON: a list of {"at_s": t, <runtime key>: value, ...}."""
    if raw is None or raw == "" or raw == []:
        return []
    items = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise ValueError("schedule must be a JSON list of objects")
    entries = []
    for item in items:
        if not isinstance(item, dict) or "at_s" not in item:
            raise ValueError(f"schedule entry {item!r} must be an object with at_s")
        at_s = item["at_s"]
        if isinstance(at_s, bool) or not isinstance(at_s, int | float) or at_s < 0:
            raise ValueError(f"schedule at_s must be a number >= 0, got {at_s!r}")
        rest = {k: v for k, v in item.items() if k != "at_s" and k not in SCHEDULE_OUTAGE_KEYS}
        entry = ScheduleEntry(at_s=float(at_s), changes=check_runtime_changes(rest))
        if "outage_s" in item:
            entry.outage_s = float(item["outage_s"])
            entry.outage_status = int(item.get("outage_status", 503))
            if entry.outage_s < 0 or entry.outage_status not in OUTAGE_STATUSES:
                raise ValueError(f"schedule outage needs outage_s >= 0 and outage_status in {OUTAGE_STATUSES}")
        if not entry.changes and entry.outage_s is None:
            raise ValueError(f"schedule entry {item!r} changes nothing")
        entries.append(entry)
    return sorted(entries, key=lambda e: e.at_s)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_models(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


# name -> (parser from text, help). Defaults come from SimConfig.
_OPTIONS: dict[str, tuple[Any, str]] = {
    "host": (str, "interface to bind"),
    "port": (int, "port to bind (0 = any free port; the ready line names it)"),
    "models": (_parse_models, "comma-separated model ids served"),
    "embedding_models": (_parse_models, "comma-separated embedding model ids served (may be empty)"),
    "embedding_dimensions": (int, "length of an embedding vector (a request may ask for fewer)"),
    "embedding_max_input_tokens": (int, "tokens an embedding input may hold"),
    "encoding": (str, "tiktoken encoding used to count tokens"),
    "profile": (str, f"engine calibration whose values become the defaults: {', '.join(PROFILES)}"),
    "seed": (int, "seed of the output-length sampler (re-applied by /admin/reset)"),
    "output_dist": (str, f"output-length distribution: {', '.join(OUTPUT_DISTRIBUTIONS)}"),
    "output_median": (float, "median output length, tokens"),
    "output_sigma": (float, "sigma of the lognormal output length (log space)"),
    "output_pareto_alpha": (float, "tail index of the Pareto output length (smaller = heavier)"),
    "default_max_tokens": (int, "max output tokens when the request sets none"),
    "slots": (int, "concurrent sequences in a batch"),
    "kv_cache_tokens": (int, "KV-cache budget: prompt+output tokens of running sequences"),
    "decode_base_ms": (float, "fixed part of one engine step, ms"),
    "decode_per_seq_ms": (float, "extra step time per running sequence, ms"),
    "prefill_ms_per_token": (float, "prefill cost per prompt token of newly admitted sequences, ms"),
    "capacity_factor": (float, "throughput multiplier: step times are divided by it"),
    "time_scale": (float, "real sleeps are divided by this (10 = ten times faster)"),
    "zero_latency": (_parse_bool, "answer at once, without the engine (gateway overhead runs)"),
    "tpm": (int, "provider tokens-per-minute limit (0 = unlimited)"),
    "rpm": (int, "provider requests-per-minute limit (0 = unlimited)"),
    "schedule": (parse_schedule, 'JSON list like [{"at_s": 60, "capacity_factor": 0.5, "tpm": 20000}]'),
    "log_level": (str, "uvicorn log level"),
    "access_log": (_parse_bool, "log every request"),
}


def _profile_of(argv: Sequence[str] | None, environ: Mapping[str, str]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile", default=environ.get(ENV_PREFIX + "PROFILE", "demo"))
    known, _ = pre.parse_known_args(argv)
    return known.profile


def build_parser(environ: Mapping[str, str] | None = None, profile: str = "demo") -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    defaults = SimConfig(**PROFILES.get(profile, {}))
    parser = argparse.ArgumentParser(
        prog="python -m inference_sim",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Simulated OpenAI-compatible GPU inference pool. "
        f"Every flag --some-name can also be set with the env var {ENV_PREFIX}SOME_NAME.",
    )
    for name, (convert, help_text) in _OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        env_name = ENV_PREFIX + name.upper()
        default = getattr(defaults, name)
        if env_name in environ:
            try:
                default = convert(environ[env_name])
            except ValueError as exc:
                parser.error(f"{env_name}: {exc}")
        help_full = f"{help_text} (env {env_name})"
        if isinstance(getattr(defaults, name), bool):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_full)
        else:
            parser.add_argument(flag, dest=name, type=convert, default=default, help=help_full)
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SimConfig:
    environ = os.environ if environ is None else environ
    profile = _profile_of(argv, environ)
    if profile not in PROFILES:
        build_parser(environ).error(f"--profile must be one of {sorted(PROFILES)}, got {profile!r}")
    parser = build_parser(environ, profile)
    args = parser.parse_args(argv)
    config = SimConfig(**vars(args))
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return config
