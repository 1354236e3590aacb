"""Plot helpers: small PNGs (about 100 dpi, 7x4 in) that stay commit-sized."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 90
SIZE = (7.5, 4.0)


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def cdf_plot(series: Mapping[str, Sequence[float]], path: Path, *, title: str, xlabel: str, log_x: bool = False,
             marks: Sequence[float] = (50, 99)) -> None:
    fig, ax = plt.subplots(figsize=SIZE)
    for label, values in series.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
    for q in marks:
        ax.axhline(q / 100, color="grey", lw=0.6, ls=":")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def multi_cdf(panels: Mapping[str, Mapping[str, Sequence[float]]], path: Path, *, title: str, xlabel: str,
              log_x: bool = True) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(SIZE[0] * 1.4, SIZE[1]), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (panel, series) in zip(axes, panels.items()):
        for label, values in series.items():
            if not values:
                continue
            xs = np.sort(np.asarray(values, dtype=float))
            ys = np.arange(1, len(xs) + 1) / len(xs)
            ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.6, ls=":")
        if log_x:
            ax.set_xscale("log")
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(title)
    _save(fig, path)


def timeseries(lines: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: Path, *, title: str,
               xlabel: str, ylabel: str, hlines: Mapping[str, float] | None = None,
               spans: Sequence[tuple[float, float, str]] = (), step: bool = False, ylim0: bool = True) -> None:
    fig, ax = plt.subplots(figsize=SIZE)
    for label, (xs, ys) in lines.items():
        if step:
            ax.step(xs, ys, where="post", label=label)
        else:
            ax.plot(xs, ys, label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, ls="--", lw=1, color="black" if "budget" in label or "ceiling" in label else "grey")
        ax.annotate(label, (ax.get_xlim()[0], y), fontsize=7, va="bottom")
    for start, end, label in spans:
        ax.axvspan(start, end, color="orange", alpha=0.15, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ylim0:
        ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def stacked_bars(categories: Sequence[str], stacks: Mapping[str, Sequence[float]], path: Path, *, title: str,
                 ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=SIZE)
    bottom = np.zeros(len(categories))
    for label, values in stacks.items():
        values = np.asarray(values, dtype=float)
        if not values.any():
            continue
        ax.bar(categories, values, bottom=bottom, label=label)
        bottom += values
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), fontsize=8)
    _save(fig, path)
