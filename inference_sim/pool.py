"""The simulated pool's state: engine, limits, outages, schedule and counters.

The HTTP layer (app.py) is a thin shell over this object; everything a test or
benchmark can observe or change at run time lives here.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import llm_tokens

from inference_sim import errors
from inference_sim.clock import SimClock
from inference_sim.config import OUTAGE_STATUSES, ScheduleEntry, SimConfig, check_runtime_changes
from inference_sim.engine import BatchEngine, Sequence
from inference_sim.limits import WINDOW_S, SlidingWindowLimiter, WindowEntry
from inference_sim.sampling import OutputLengthSampler
from inference_sim.text import check_encoding

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """Totals since start or the last reset (gauges such as in_flight are live)."""

    requests_total: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    rejected_429: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    rate_limited: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def record_status(self, status: int) -> None:
        self.by_status[status] += 1
        if status == 429:
            self.rejected_429 += 1


class SimulatedPool:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._initial_runtime = config.runtime_values()
        self.clock = SimClock(config.time_scale)
        self.encoding = llm_tokens.get_encoding(config.encoding)
        check_encoding(self.encoding)
        self.sampler = OutputLengthSampler(config.seed, config.output_median, config.output_sigma,
                                           config.output_dist, config.output_pareto_alpha)
        self.limiter = SlidingWindowLimiter(self.clock)
        self.engine = BatchEngine(config, self.clock)
        self.counters = Counters()
        self.in_flight = 0
        self._outage_until = float("-inf")
        self._outage_status = 503
        self._epoch = 0.0  # simulated time the schedule counts from
        self._schedule_next = 0
        self._schedule_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        self.engine.start()
        self._start_schedule()

    async def stop(self) -> None:
        self._stop_schedule()
        await self.engine.stop()

    # -- token counting and output lengths -----------------------------------

    def count_prompt_tokens(self, messages: list[dict[str, Any]], prompt_fields: dict[str, Any] | None = None) -> int:
        # The same function the gateway estimates with, so both agree exactly
        # (images at llm_tokens' default charge).
        return llm_tokens.count_chat_tokens(messages, encoding_name=self.config.encoding, request=prompt_fields)

    def count_input_tokens(self, item: str | list[int]) -> int:
        """A legacy prompt's or an embedding input's tokens: a string's, as the
        gateway counts them (llm_tokens.count_text_tokens), or its token ids."""
        if isinstance(item, list):
            return len(item)
        return llm_tokens.count_text_tokens(item, self.config.encoding)

    def input_text(self, item: str | list[int]) -> str:
        """An input's text (token ids decoded), so a text and its ids embed alike."""
        if isinstance(item, str):
            return item
        try:
            return self.encoding.decode(item)
        except (KeyError, ValueError, OverflowError):
            raise errors.invalid_request("'input' holds a token id this model's tokenizer does not have.",
                                         param="input") from None

    def output_length(self, override: int | None, max_tokens: int) -> tuple[int, str]:
        """(tokens to generate, finish_reason)."""
        wanted = override if override is not None else self.sampler.sample()
        if wanted > max_tokens:
            return max_tokens, "length"
        return wanted, "stop"

    # -- request accounting --------------------------------------------------

    def begin(self) -> None:
        self.in_flight += 1

    def finish(self, seq: Sequence, entry: WindowEntry, outcome: str) -> None:
        """Account a generation that ended: "completed", "aborted" or "failed"."""
        self.in_flight -= 1
        self.limiter.settle(entry, seq.prompt_tokens + seq.generated)
        if outcome == "completed":
            self.counters.completed += 1
            self.counters.prompt_tokens += seq.prompt_tokens
            self.counters.completion_tokens += seq.generated
        elif outcome == "aborted":
            self.counters.aborted += 1
        else:
            self.counters.failed += 1

    # -- capacity, outages, schedule -----------------------------------------

    def update_capacity(self, changes: dict[str, Any]) -> dict[str, Any]:
        for key, value in check_runtime_changes(changes).items():
            setattr(self.config, key, value)
        return self.config.to_dict()

    def start_outage(self, seconds: float, status: int = 503) -> dict[str, Any]:
        if status not in OUTAGE_STATUSES:
            raise ValueError(f"status must be one of {list(OUTAGE_STATUSES)}")
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._outage_until = self.clock.now() + seconds
        self._outage_status = status
        return self.outage_state()

    def active_outage(self) -> tuple[int, float] | None:
        """(status, remaining simulated seconds) while an outage lasts."""
        remaining = self._outage_until - self.clock.now()
        if remaining > 0:
            return self._outage_status, remaining
        return None

    def outage_state(self) -> dict[str, Any]:
        active = self.active_outage()
        return {
            "active": active is not None,
            "status": self._outage_status if active else None,
            "remaining_s": round(active[1], 3) if active else 0.0,
        }

    def _apply_schedule_entry(self, entry: ScheduleEntry) -> None:
        logger.info("inference_sim schedule at %.1fs: %s", entry.at_s, entry.to_dict())
        if entry.changes:
            self.update_capacity(entry.changes)
        if entry.outage_s is not None:
            self.start_outage(entry.outage_s, entry.outage_status)

    def _apply_due_entries(self) -> None:
        schedule = self.config.schedule
        elapsed = self.clock.now() - self._epoch
        while self._schedule_next < len(schedule) and schedule[self._schedule_next].at_s <= elapsed:
            self._apply_schedule_entry(schedule[self._schedule_next])
            self._schedule_next += 1

    async def _run_schedule(self) -> None:
        schedule = self.config.schedule
        while self._schedule_next < len(schedule):
            await self.clock.sleep_until(self._epoch + schedule[self._schedule_next].at_s)
            self._apply_due_entries()

    def _start_schedule(self) -> None:
        self._epoch = self.clock.now()
        self._schedule_next = 0
        # Entries due at once (at_s 0) apply before the first request is served.
        self._apply_due_entries()
        if self._schedule_next < len(self.config.schedule):
            self._schedule_task = asyncio.create_task(self._run_schedule(), name="inference_sim.schedule")

    def _stop_schedule(self) -> None:
        if self._schedule_task is not None:
            self._schedule_task.cancel()
            self._schedule_task = None

    def reset(self) -> None:
        """Back to the starting state: counters, windows, seed, config, outage, schedule.

        Running requests carry on; the gauges (in_flight, running, queued) stay live.
        """
        self.counters = Counters()
        self.limiter.reset()
        self.engine.reset_peaks()
        self.sampler.reseed()
        for key, value in self._initial_runtime.items():
            setattr(self.config, key, value)
        self._outage_until = float("-inf")
        self._stop_schedule()
        self._start_schedule()

    # -- observation ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        window_requests, window_tokens = self.limiter.usage()
        counters = self.counters
        schedule = self.config.schedule
        return {
            "requests_total": counters.requests_total,
            "completed": counters.completed,
            "aborted": counters.aborted,
            "failed": counters.failed,
            "rejected_429": counters.rejected_429,
            "by_status": {str(status): n for status, n in sorted(counters.by_status.items())},
            "rate_limited": {"requests": counters.rate_limited["requests"], "tokens": counters.rate_limited["tokens"]},
            "prompt_tokens": counters.prompt_tokens,
            "completion_tokens": counters.completion_tokens,
            "in_flight": self.in_flight,
            "running": self.engine.running,
            "queued": self.engine.queued,
            "kv_tokens_in_use": self.engine.kv_in_use,
            "max_running": self.engine.max_running,
            "max_kv_tokens_in_use": self.engine.max_kv_in_use,
            "engine_steps": self.engine.steps,
            "window": {"seconds": WINDOW_S, "requests": window_requests, "tokens": window_tokens},
            "sim_time_s": round(self.clock.now() - self._epoch, 3),
            "outage": self.outage_state(),
            "schedule": {
                "applied": self._schedule_next,
                "pending": [entry.to_dict() for entry in schedule[self._schedule_next :]],
            },
            "config": self.config.to_dict(),
        }
