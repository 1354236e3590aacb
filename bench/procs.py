"""What the processes of a platform cost, read from /proc: CPU seconds
(user + system, threads and reaped children included) and resident memory
(VmRSS) of named process trees (a root and all its descendants)."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, its threads included, and of its reaped children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[0] is the state (field 3): utime, stime, cutime, cstime are fields 14-17
    return sum(int(x) for x in fields[11:15]) / TICK


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """The process and every process below it (children of each of its threads)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            out.extend(descendants(int(child)))
    return out


class CpuMeter:
    """CPU seconds of named process trees."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots

    def read(self) -> dict[str, float]:
        return {name: sum(cpu_s(p) for p in descendants(pid)) for name, pid in self.roots.items()}


class RssPeaks:
    """Peak resident memory of named process trees, from repeated samples.

    ``sample()`` reads VmRSS of every process of every tree; it keeps each
    tree's peak and the peak of their sum at one sample (the platform's
    footprint at its worst moment, never more than the sum of the peaks)."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        self.peak: dict[str, int] = {name: 0 for name in roots}
        self.peak_total = 0
        self.samples = 0

    def sample(self) -> None:
        total = 0
        for name, pid in self.roots.items():
            rss = sum(rss_bytes(p) for p in descendants(pid))
            self.peak[name] = max(self.peak[name], rss)
            total += rss
        self.peak_total = max(self.peak_total, total)
        self.samples += 1


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}
