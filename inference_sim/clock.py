"""Simulated time: real monotonic time multiplied by the time scale.

Everything the simulator reasons about (engine steps, rate-limit windows,
outages, the schedule) is in simulated seconds; only the final ``sleep``
converts back to real time, so ``--time-scale 10`` runs the same scenario ten
times faster without changing any reported number.
"""

from __future__ import annotations

import asyncio
import time


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._origin = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since the clock was created."""
        return (time.monotonic() - self._origin) * self.time_scale

    def to_real(self, sim_seconds: float) -> float:
        return sim_seconds / self.time_scale

    async def sleep(self, sim_seconds: float) -> None:
        if sim_seconds > 0:
            await asyncio.sleep(sim_seconds / self.time_scale)

    async def sleep_until(self, sim_time: float) -> None:
        # Sleeping towards a deadline (not for a duration) keeps event-loop
        # overhead and timer granularity from piling up over many steps.
        await self.sleep(sim_time - self.now())
