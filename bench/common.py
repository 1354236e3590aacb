"""Shared bits of the scenarios: paths, progress lines, percentiles, the
conversion between real and simulated time, result files."""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"
PLOTS_DIR = BENCH_DIR / "plots"
# A quick run is a smoke test, its numbers are not results: its report and
# plots go here, never over the committed bench/RESULTS.md and bench/plots/.
QUICK_DIR = OUT_DIR / "quick"

_T0 = time.monotonic()
# wait_http polls with httpx, and the openai SDK's client (httpx2) is as
# chatty: each logs every request at INFO.
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpx2").setLevel(logging.WARNING)


# The machine's speed, stated beside every CPU figure: the seconds this
# machine takes for a fixed pure-Python loop. The bench's CPU targets are
# for a machine that runs it in about SPEED_REFERENCE_S.
SPEED_LOOP = "s = 0\nfor i in range(10_000_000):\n    s += i\n"
SPEED_REFERENCE_S = 0.9
_speed: dict[str, float] = {}


def machine_speed() -> dict[str, float]:
    """Wall and CPU seconds of SPEED_LOOP, timed once per process (a
    `make bench` run times it at its start and every scenario reuses it).

    The loop runs at module level, as ``python -c`` runs it (its names are
    globals: about twice the time of the same loop inside a function), which
    is how the reference time of the targets was read."""
    if not _speed:
        code = compile(SPEED_LOOP, "<machine speed>", "exec")
        wall, cpu = time.perf_counter(), time.process_time()
        exec(code, {})
        _speed.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)
    return dict(_speed)


def speed_scaled(target: float, speed_s: float) -> float:
    """A CPU target for a machine running SPEED_LOOP in SPEED_REFERENCE_S,
    scaled to one that runs it in ``speed_s``."""
    return target * speed_s / SPEED_REFERENCE_S


def speed_line(speed: dict[str, float]) -> str:
    return (f"10 million pure-Python additions (`s = 0; for i in range(10_000_000): s += i`, module level) in "
            f"{speed['wall_s']:.2f} s "
            f"({speed['wall_s'] / SPEED_REFERENCE_S:.2f}x the {SPEED_REFERENCE_S} s the CPU targets are set for)")


def log(message: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {message}", flush=True)


@dataclass(frozen=True)
class TimeScale:
    """The simulator runs ``factor`` times faster than the wall clock.

    Everything a scenario configures or reports is in simulated time: a rate
    per simulated minute becomes ``factor`` times that per real minute (the
    gateway's token buckets run on the wall clock), a simulated duration
    lasts ``1/factor`` real seconds, and a latency measured on the wall clock
    is multiplied by ``factor``. The gateway's own overhead (real
    milliseconds of CPU and round trips) is therefore reported ``factor``
    times larger than it is: the scenarios keep the factor moderate and the
    overhead scenario measures it unscaled."""

    factor: float

    def real_rate(self, per_sim_minute: float) -> float:
        return per_sim_minute * self.factor

    def real_s(self, sim_seconds: float) -> float:
        return sim_seconds / self.factor

    def sim_s(self, real_seconds: float) -> float:
        return real_seconds * self.factor


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def pcts(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "p99": percentile(values, 99),
            "n": len(values)}


def write_result(name: str, data: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_json_default))
    return path


def read_result(name: str) -> dict[str, Any] | None:
    path = OUT_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _json_default(value: Any) -> Any:
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report_paths(*, quick: bool) -> tuple[Path, Path]:
    """Where a run's RESULTS.md and plots go (see QUICK_DIR)."""
    if quick:
        return QUICK_DIR / "RESULTS.md", QUICK_DIR / "plots"
    return BENCH_DIR / "RESULTS.md", PLOTS_DIR


def scenario_args(description: str, argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seed", type=int, default=1, help="seed of every random choice of the scenario")
    parser.add_argument("--quick", action="store_true", help="a shorter run (for a smoke test)")
    return parser.parse_args(list(argv) if argv is not None else None)


def fmt(value: float | None, digits: int = 0, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}{unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def run_standalone(name: str, main, summarize, plot, description: str) -> None:
    """`python -m bench.<scenario> --seed N`: run, write the JSON, print the
    section and draw its plots."""
    args = scenario_args(description)
    data = main(seed=args.seed, quick=args.quick)
    _, plots_dir = report_paths(quick=args.quick)
    plots_dir.mkdir(parents=True, exist_ok=True)
    plot(data, plots_dir)
    print(summarize(data))
    sys.stdout.flush()
