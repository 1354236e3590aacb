"""Sliding-window sums over (time, amount) events, for "tokens in any 60 s"."""

from __future__ import annotations

from collections.abc import Sequence


def sliding_max(events: Sequence[tuple[float, float]], window: float) -> float:
    """The largest sum of amounts whose times fall in any half-open window
    [t, t + window). Checking windows that start at an event is enough."""
    ordered = sorted(events)
    best = 0.0
    total = 0.0
    lo = 0
    for hi, (t, amount) in enumerate(ordered):
        total += amount
        while ordered[lo][0] <= t - window:
            total -= ordered[lo][1]
            lo += 1
        best = max(best, total)
    return best


def sliding_series(events: Sequence[tuple[float, float]], window: float, *, step: float, end: float,
                   start: float = 0.0) -> tuple[list[float], list[float]]:
    """Sum of amounts in the trailing window (t - window, t], sampled every ``step``."""
    ordered = sorted(events)
    xs, ys = [], []
    lo = hi = 0
    total = 0.0
    t = start
    while t <= end + 1e-9:
        while hi < len(ordered) and ordered[hi][0] <= t:
            total += ordered[hi][1]
            hi += 1
        while lo < hi and ordered[lo][0] <= t - window:
            total -= ordered[lo][1]
            lo += 1
        xs.append(round(t, 3))
        ys.append(total)
        t += step
    return xs, ys
