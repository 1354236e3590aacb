"""Load shapes shared by the scenarios: open-loop pacing, closed-loop
clients, and a sampler that polls gauges (simulator stats, lane queue depth)
while a phase runs. Every loop is bounded in count and in time."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.http import HttpClient, Response, TransportError


@dataclass
class Call:
    """One HTTP call as the client saw it (real seconds, from the phase start)."""

    kind: str
    start: float
    latency: float
    status: int  # 0: no HTTP answer
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200


KEEP_HEADERS = ("x-sluice-lane", "x-sluice-borrowed", "x-sluice-queue-ms", "x-sluice-total-ms", "retry-after",
                "retry-after-ms", "x-sim-queue-ms", "x-sim-prefill-ms", "x-sim-decode-ms", "x-request-id",
                "x-sluice-pool", "x-sluice-route-refusals")


async def timed_post(client: HttpClient, path: str, body: dict, headers: dict[str, str], kind: str, t0: float,
                     timeout: float = 600.0) -> Call:
    start = time.monotonic()
    try:
        response: Response = await client.post(path, body, headers, timeout=timeout)
    except TransportError as exc:
        return Call(kind, start - t0, time.monotonic() - start, 0, code="transport", extra={"error": str(exc)[:200]})
    latency = time.monotonic() - start
    usage = None
    code = response.error_code
    if response.status == 200:
        try:
            usage = response.json().get("usage")
        except (ValueError, AttributeError):
            usage = None
    kept = {name: response.headers[name] for name in KEEP_HEADERS if name in response.headers}
    return Call(kind, start - t0, latency, response.status, code, kept, usage)


async def stream_refusal_code(response: httpx.Response) -> str:
    """The error code of a stream refused before it started (a JSON error body)."""
    await response.aread()
    try:
        return response.json().get("error", {}).get("code") or f"http_{response.status_code}"
    except ValueError:
        return f"http_{response.status_code}"


async def timed_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], kind: str,
                       t0: float) -> Call:
    """One streamed chat call (``stream`` and ``include_usage`` set here):
    its latency is the time to the stream's end, ``extra["ttft"]`` the time
    to its first content chunk (real seconds); the usage is the usage chunk's.
    An error event, or a stream that ends without [DONE], is an error."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first: float | None = None
    usage, code, done, status, kept = None, None, False, 0, {}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            status = response.status_code
            kept = {name: response.headers[name] for name in KEEP_HEADERS if name in response.headers}
            if status != 200:
                code = await stream_refusal_code(response)
            else:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                        break
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        code = str(chunk["error"].get("code") or "stream_error")
                        break
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                        first = time.monotonic()
    except httpx.HTTPError as exc:
        return Call(kind, start - t0, time.monotonic() - start, 0, code="transport",
                    extra={"error": f"{type(exc).__name__}: {exc}"[:200]})
    if status == 200 and code is None and not done:
        code = "short_stream"
    if code is not None and status == 200:
        status = 0  # the stream started, then failed: not a success
    extra = {"ttft": first - start} if first is not None else {}
    return Call(kind, start - t0, time.monotonic() - start, status, code, kept, usage, extra)


async def open_loop(rate_per_s: float, duration_s: float, fire: Callable[[int], Awaitable[Any]], *,
                    poisson: bool = False, rng: random.Random | None = None, max_requests: int = 1_000_000,
                    stop: asyncio.Event | None = None) -> int:
    """Start ``fire(i)`` at ``rate_per_s`` for ``duration_s`` (uniform or
    Poisson spacing), or until ``stop`` is set, without waiting for answers;
    then wait for all of them."""
    rng = rng or random.Random(0)
    tasks: set[asyncio.Task] = set()
    start = time.monotonic()
    next_at = start
    i = 0
    while i < max_requests:
        now = time.monotonic()
        if now - start >= duration_s or (stop is not None and stop.is_set()):
            break
        if next_at > now:
            await asyncio.sleep(next_at - now)
        task = asyncio.create_task(fire(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        next_at += rng.expovariate(rate_per_s) if poisson else 1.0 / rate_per_s
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    return i


async def closed_loop(clients: int, duration_s: float, step: Callable[[int, int], Awaitable[Any]],
                      max_per_client: int = 1_000_000) -> None:
    """``clients`` loops each calling ``await step(client, i)`` back to back
    until ``duration_s`` passes (a call in progress then finishes)."""
    deadline = time.monotonic() + duration_s

    async def run(client: int) -> None:
        for i in range(max_per_client):
            if time.monotonic() >= deadline:
                return
            await step(client, i)

    await asyncio.gather(*(run(c) for c in range(clients)))


class Sampler:
    """Polls ``probe()`` every ``interval_s`` real seconds in the background.

    ``stop`` sets a flag as well as cancelling the task: on Python 3.11,
    ``asyncio.wait_for`` (the bench's HttpClient, redis-py's writes) returns
    its result instead of raising when the cancel arrives just as its inner
    call finishes, and a loop stopped by the cancel alone would then poll for
    ever (seen once: a quick bench in CI waiting with every process idle).
    The flag ends the loop at its next turn whatever the cancel did."""

    def __init__(self, probe: Callable[[], Awaitable[dict]], interval_s: float, t0: float) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.t0 = t0
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def _run(self) -> None:
        while not self._stopping:
            try:
                sample = await self.probe()
                sample["t"] = time.monotonic() - self.t0
                self.samples.append(sample)
            except Exception as exc:  # a missed sample is not worth failing the run over
                self.samples.append({"t": time.monotonic() - self.t0, "error": str(exc)[:200]})
            if not self._stopping:
                await asyncio.sleep(self.interval_s)

    def start(self) -> Sampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> list[dict]:
        self._stopping = True
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        return self.samples


def lane_depths(redis_client) -> dict[str, int]:
    """Messages waiting in each lane's Celery queue (the Redis broker keeps one
    list per queue and priority step: ``lane`` and ``lane\\x06\\x16N``)."""
    from bench.platform import LANES

    out = {}
    pipe = redis_client.pipeline(transaction=False)
    names = []
    for lane in LANES:
        for suffix in ("",) + tuple(f"\x06\x16{n}" for n in range(10)):
            names.append((lane, lane + suffix))
            pipe.llen(lane + suffix)
    for (lane, _), depth in zip(names, pipe.execute()):
        out[lane] = out.get(lane, 0) + int(depth)
    return out


def calls_to_json(calls: list[Call]) -> list[dict]:
    return [{"kind": c.kind, "start": round(c.start, 4), "latency": round(c.latency, 5), "status": c.status,
             "code": c.code, "headers": c.headers, "usage": c.usage, **({"extra": c.extra} if c.extra else {})}
            for c in calls]
