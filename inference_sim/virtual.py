"""The engine in virtual time: the same BatchEngine admission and step
arithmetic as the HTTP server, driven step by step without sleeping, so a
closed-loop load of minutes of simulated traffic runs in milliseconds.

Used for calibration (throughput and latency against concurrency, compared
with published vLLM/NIM sweeps) and to size scenarios before spending wall
time on them. No HTTP and no event loop: a request here is exactly what the
server would compute for it, minus network and scheduling jitter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from inference_sim.config import SimConfig
from inference_sim.engine import BatchEngine, Sequence


class VirtualClock:
    """Stands in for SimClock; the driver advances ``t`` itself."""

    time_scale = 1.0

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def to_real(self, sim_seconds: float) -> float:
        return sim_seconds


@dataclass(frozen=True)
class Finished:
    client: int
    kind: str
    prompt_tokens: int
    output_tokens: int
    arrival: float  # simulated seconds
    end: float
    queue_ms: float
    prefill_ms: float
    decode_ms: float

    @property
    def latency_s(self) -> float:
        return self.end - self.arrival

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.prefill_ms

    @property
    def itl_ms(self) -> float | None:
        return self.decode_ms / (self.output_tokens - 1) if self.output_tokens > 1 else None


# next_request(client, i) -> (kind, prompt tokens, output tokens)
RequestSource = Callable[[int, int], tuple[str, int, int]]


def closed_loop(config: SimConfig, clients: int, next_request: RequestSource, duration_s: float,
                warmup_s: float = 0.0, stagger_s: float = 0.0, max_steps: int = 5_000_000) -> list[Finished]:
    """``clients`` callers, each sending its next request the moment its last
    one finishes, for ``duration_s`` simulated seconds. Client ``i`` sends
    its first request at ``i / clients * stagger_s``: with identical request
    lengths, clients that all start at once stay in lockstep forever (every
    prefill lands in the same step), which no real load does. Returns the
    requests that arrived after ``warmup_s``."""
    config = dataclasses.replace(config, zero_latency=False)
    clock = VirtualClock()
    engine = BatchEngine(config, clock)
    in_flight: dict[Sequence, tuple[int, str]] = {}
    counts = [0] * clients
    done: list[Finished] = []

    def submit(client: int) -> None:
        kind, prompt, output = next_request(client, counts[client])
        counts[client] += 1
        seq = Sequence(prompt, max(1, output), arrival=clock.t)
        in_flight[seq] = (client, kind)
        engine.submit(seq)

    starts = sorted((client / clients * stagger_s, client) for client in range(clients))
    steps = 0
    while clock.t < duration_s and steps < max_steps:
        while starts and starts[0][0] <= clock.t:
            submit(starts.pop(0)[1])
        admitted = engine._admit(clock.t)
        if not engine.running:
            if starts:  # idle until the next client starts
                clock.t = starts[0][0]
                continue
            break  # nothing can run (cannot happen with a sane config)
        step_ms = engine._step_ms(admitted)
        engine._complete_step(admitted, step_ms)
        clock.t += step_ms / 1000
        steps += 1
        for seq in [s for s in in_flight if s.finished]:
            client, kind = in_flight.pop(seq)
            if seq.arrival >= warmup_s:
                done.append(Finished(client, kind, seq.prompt_tokens, seq.generated, seq.arrival, clock.t,
                                     seq.queue_ms, seq.prefill_ms, seq.decode_ms))
            submit(client)
    return done


@dataclass(frozen=True)
class SweepPoint:
    concurrency: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_mean: float
    ttft_ms_p99: float
    itl_ms_mean: float
    latency_s_mean: float


def sweep(config: SimConfig, concurrencies: list[int], prompt_tokens: int, output_tokens: int,
          duration_s: float = 600.0, warmup_s: float = 60.0) -> list[SweepPoint]:
    """A fixed-length concurrency sweep, as ``vllm bench serve --max-concurrency``
    or NVIDIA's genai-perf run it (fixed input/output lengths, ignore_eos).
    Clients start spread over one unloaded request time (see closed_loop)."""
    points = []
    alone_s = (prompt_tokens * config.prefill_ms_per_token
               + output_tokens * (config.decode_base_ms + config.decode_per_seq_ms)) / config.capacity_factor / 1000
    for concurrency in concurrencies:
        finished = closed_loop(config, concurrency, lambda c, i: ("fixed", prompt_tokens, output_tokens),
                               duration_s, warmup_s, stagger_s=alone_s)
        if not finished:
            continue
        span = max(f.end for f in finished) - warmup_s
        ttfts = sorted(f.ttft_ms for f in finished)
        itls = [f.itl_ms for f in finished if f.itl_ms is not None]
        points.append(SweepPoint(
            concurrency=concurrency,
            output_tokens_per_s=sum(f.output_tokens for f in finished) / span,
            requests_per_s=len(finished) / span,
            ttft_ms_mean=sum(ttfts) / len(ttfts),
            ttft_ms_p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            itl_ms_mean=sum(itls) / len(itls) if itls else 0.0,
            latency_s_mean=sum(f.latency_s for f in finished) / len(finished),
        ))
    return points
