"""Provider rate limits: RPM and TPM over a sliding 60 s window of simulated time.

Like OpenAI, a request is checked at arrival against its worst case (prompt
plus the max_tokens it asked for), so a burst of long-output requests is
refused up front. Once it finishes the window keeps only what it really used
(prompt + completion), so short answers give the unused allowance back. A
limit of 0 means unlimited; the window is kept anyway so a limit switched on
at run time sees the recent traffic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from inference_sim.clock import SimClock

WINDOW_S = 60.0


class WindowEntry:
    """One admitted request in the window; ``tokens`` is corrected on settle."""

    __slots__ = ("at", "tokens", "counted", "expired")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens
        self.counted = True  # False once released: no longer a request or tokens
        self.expired = False  # True once it slid out of the window


@dataclass(frozen=True)
class Rejection:
    kind: str  # "requests" | "tokens"
    limit: int
    used: int
    requested: int
    retry_after_sim_s: float


class SlidingWindowLimiter:
    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self._entries: deque[WindowEntry] = deque()
        self._requests = 0
        self._tokens = 0

    def reset(self) -> None:
        self._entries.clear()
        self._requests = 0
        self._tokens = 0

    def _expire(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self._entries and self._entries[0].at <= horizon:
            entry = self._entries.popleft()
            entry.expired = True
            if entry.counted:
                self._requests -= 1
                self._tokens -= entry.tokens

    def usage(self) -> tuple[int, int]:
        """(requests, tokens) in the current window."""
        self._expire(self._clock.now())
        return self._requests, self._tokens

    def try_admit(self, rpm: int, tpm: int, tokens: int) -> WindowEntry | Rejection:
        now = self._clock.now()
        self._expire(now)
        if rpm and self._requests + 1 > rpm:
            return Rejection("requests", rpm, self._requests, 1, self._wait_for_requests(now, rpm))
        if tpm and self._tokens + tokens > tpm:
            return Rejection("tokens", tpm, self._tokens, tokens, self._wait_for_tokens(now, tpm, tokens))
        entry = WindowEntry(now, tokens)
        self._entries.append(entry)
        self._requests += 1
        self._tokens += tokens
        return entry

    def reset_after(self, rpm: int, tpm: int) -> tuple[float, float]:
        """Simulated seconds until the window has room for one more request
        and for one more token (0 where it has room now): what the
        ``x-ratelimit-reset-*`` headers say."""
        now = self._clock.now()
        self._expire(now)
        requests = self._wait_for_requests(now, rpm) if rpm and self._requests >= rpm else 0.0
        tokens = self._wait_for_tokens(now, tpm, 1) if tpm and self._tokens >= tpm else 0.0
        return requests, tokens

    def settle(self, entry: WindowEntry, actual_tokens: int) -> None:
        """Replace the arrival-time estimate with what the request really used."""
        if entry.counted and not entry.expired:
            self._tokens += actual_tokens - entry.tokens
        entry.tokens = actual_tokens

    def release(self, entry: WindowEntry) -> None:
        """Forget a request the pool refused after admission (it used nothing)."""
        if entry.counted and not entry.expired:
            self._requests -= 1
            self._tokens -= entry.tokens
        entry.counted = False

    def _live(self):
        return (e for e in self._entries if e.counted)

    def _wait_for_requests(self, now: float, rpm: int) -> float:
        # The request fits once enough of the oldest entries slide out that
        # fewer than rpm remain.
        must_expire = self._requests - (rpm - 1)
        for entry in self._live():
            must_expire -= 1
            if must_expire <= 0:
                return max(0.0, entry.at + WINDOW_S - now)
        return WINDOW_S

    def _wait_for_tokens(self, now: float, tpm: int, tokens: int) -> float:
        if tokens > tpm:
            return WINDOW_S  # never fits; OpenAI answers "request too large" with a 429 too
        excess = self._tokens + tokens - tpm
        for entry in self._live():
            excess -= entry.tokens
            if excess <= 0:
                return max(0.0, entry.at + WINDOW_S - now)
        return WINDOW_S


def real_retry_after(clock: SimClock, sim_seconds: float) -> tuple[int, int]:
    """(retry-after in whole real seconds, retry-after-ms), both rounded up, at least 1."""
    real = clock.to_real(sim_seconds)
    return max(1, math.ceil(real)), max(1, math.ceil(real * 1000))


def go_duration(real_seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's
    time.Duration format, to the millisecond): ``0s``, ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(real_seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{seconds}" if minutes else seconds
