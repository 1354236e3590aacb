"""A continuous-batching engine in the style of vLLM / TGI, in simulated time.

Model
-----
The engine runs steps. Each step decodes one token for every running
sequence and lasts::

    step_ms = (prefill_ms_per_token * prompt tokens admitted this step
               + decode_base_ms + decode_per_seq_ms * running sequences)
              / capacity_factor

New sequences are admitted only at a step boundary, FIFO, while a batch slot
is free (``slots``) and the KV cache can hold them (``kv_cache_tokens``). Their
prefill runs inside that step, so it stalls every running sequence's decode
(prefill and decode compete, as in vLLM's default scheduler), and it yields
their first token. A long prompt at the head of the queue blocks the short
requests behind it; a long generation holds its slot for hundreds of steps.

A sequence reserves ``prompt + output`` tokens of KV cache when admitted. The
simulator knows each output length in advance, so this is vLLM without
preemption: the sum over running sequences never exceeds the budget and no
sequence is ever evicted.

Per sequence the simulator reports, in simulated milliseconds: ``queue_ms``
(arrival to admission), ``prefill_ms`` (the admission step: time to first
token once admitted) and ``decode_ms`` (every later step it took part in).

Where the default numbers come from (approximate, for a 7-8B fp16 model on
one A100-class GPU; they are orders of magnitude, not a benchmark):

* ``decode_base_ms = 20``: decode is memory-bandwidth bound, each step reads
  all ~14-16 GB of weights, ~7-8 ms at 2 TB/s in theory; published vLLM/TGI
  runs (the vLLM PagedAttention paper, Kwon et al. 2023; Databricks' "LLM
  inference performance engineering" post on A100s; Anyscale's continuous-
  batching post) show inter-token latency of about 12-25 ms at small batches.
* ``decode_per_seq_ms = 0.5``: step time grows slowly with batch size (attention
  over each sequence's KV cache): roughly 25-30 ms at batch 16 and 50+ ms at
  batch 64 in the same reports.
* ``prefill_ms_per_token = 0.1``: prefill is compute bound, ~2 x 7e9 FLOPs per
  token at ~50% of 312 TFLOPS is ~0.09 ms; a 2,000-token prompt costs ~200 ms
  time-to-first-token, in line with published TTFT figures.
* ``kv_cache_tokens = 65536``: Llama-2-7B keeps ~0.5 MB of KV per token
  (2 x 32 layers x 4096 x 2 bytes); the memory left on a 40-80 GB card after
  weights holds roughly 40k-120k tokens.
* ``slots = 16``: a deliberately modest max batch so queueing shows up at demo
  load (vLLM's default max_num_seqs is 256).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from inference_sim.clock import SimClock
from inference_sim.config import SimConfig

logger = logging.getLogger(__name__)

# When the loop falls this far (real seconds) behind its own timeline (CPU
# starved, huge time scale), the engine restarts its timeline at "now" instead
# of racing to catch up, so simulated time cannot drift without bound.
MAX_REAL_LAG_S = 0.05


class Sequence:
    """One request's generation, shared by the engine and the HTTP handler."""

    def __init__(self, prompt_tokens: int, output_tokens: int, arrival: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.arrival = arrival
        self.generated = 0
        self.queue_ms = 0.0
        self.prefill_ms = 0.0
        self.decode_ms = 0.0
        self.admitted = False
        self.finished = False
        self.aborted = False
        self.error: str | None = None
        # progress fires after every step (streaming); completed only at the end.
        self.progress = asyncio.Event()
        self.completed = asyncio.Event()

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def finish(self, error: str | None = None) -> None:
        self.finished = True
        self.error = error
        self.progress.set()
        self.completed.set()

    def finish_instantly(self) -> None:
        """Zero-latency mode: everything generated, no time spent."""
        self.generated = self.output_tokens
        self.finish()

    async def wait_generated(self, count: int) -> None:
        """Until ``count`` tokens exist or the sequence ended."""
        while self.generated < count and not self.finished:
            self.progress.clear()
            await self.progress.wait()


class BatchEngine:
    def __init__(self, config: SimConfig, clock: SimClock) -> None:
        self._config = config
        self._clock = clock
        self._waiting: deque[Sequence] = deque()
        self._running: dict[Sequence, None] = {}  # insertion-ordered set
        self._kv_in_use = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.max_running = 0
        self.max_kv_in_use = 0

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="inference_sim.engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq in [*self._waiting, *self._running]:
            seq.finish(error="engine stopped")
        self._waiting.clear()
        self._running.clear()
        self._kv_in_use = 0

    # -- requests ------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self._waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence whose client went away, freeing its slot at once."""
        if seq.finished:
            return
        seq.aborted = True
        if seq in self._running:
            del self._running[seq]
            self._kv_in_use -= seq.kv_tokens
        else:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass
        seq.finish(error="aborted")

    # -- gauges --------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def kv_in_use(self) -> int:
        return self._kv_in_use

    def reset_peaks(self) -> None:
        self.steps = 0
        self.max_running = len(self._running)
        self.max_kv_in_use = self._kv_in_use

    # -- the loop ------------------------------------------------------------

    def _admit(self, step_start: float) -> list[Sequence]:
        config = self._config
        admitted = []
        while self._waiting and len(self._running) < config.slots:
            head = self._waiting[0]
            # FIFO: a head that does not fit blocks everyone behind it. An
            # empty batch takes it anyway, so lowering kv_cache_tokens at run
            # time below a queued request's size cannot wedge the engine.
            if self._running and self._kv_in_use + head.kv_tokens > config.kv_cache_tokens:
                break
            self._waiting.popleft()
            self._running[head] = None
            self._kv_in_use += head.kv_tokens
            head.admitted = True
            head.queue_ms = max(0.0, (step_start - head.arrival) * 1000)
            admitted.append(head)
        self.max_running = max(self.max_running, len(self._running))
        self.max_kv_in_use = max(self.max_kv_in_use, self._kv_in_use)
        return admitted

    def _step_ms(self, admitted: list[Sequence]) -> float:
        config = self._config
        prefill_ms = config.prefill_ms_per_token * sum(seq.prompt_tokens for seq in admitted)
        decode_ms = config.decode_base_ms + config.decode_per_seq_ms * len(self._running)
        return (prefill_ms + decode_ms) / config.capacity_factor

    def _complete_step(self, admitted: list[Sequence], step_ms: float) -> None:
        new = set(admitted)
        for seq in list(self._running):  # aborted sequences already left
            if seq in new:
                seq.prefill_ms = step_ms
            else:
                seq.decode_ms += step_ms
            if seq.generated < seq.output_tokens:
                seq.generated += 1
            if seq.generated >= seq.output_tokens:
                del self._running[seq]
                self._kv_in_use -= seq.kv_tokens
                seq.finish()
            else:
                seq.progress.set()

    def _fail_all(self, error: str) -> None:
        for seq in [*self._waiting, *self._running]:
            seq.finish(error=error)
        self._waiting.clear()
        self._running.clear()
        self._kv_in_use = 0

    async def _run(self) -> None:
        # Steps follow a virtual timeline (each starts where the last ended) so
        # reported times are exact sums of step times whatever the event loop's
        # jitter; sleep_until keeps that timeline in step with the clock.
        prev_end: float | None = None
        while True:
            if not self._waiting and not self._running:
                prev_end = None
                self._wake.clear()
                await self._wake.wait()  # idle: no polling
                continue
            try:
                now = self._clock.now()
                lagging = prev_end is not None and self._clock.to_real(now - prev_end) > MAX_REAL_LAG_S
                step_start = now if prev_end is None or lagging else prev_end
                admitted = self._admit(step_start)
                if not self._running:
                    prev_end = None
                    continue
                step_ms = self._step_ms(admitted)
                step_end = step_start + step_ms / 1000
                await self._clock.sleep_until(step_end)
                self.steps += 1
                self._complete_step(admitted, step_ms)
                prev_end = step_end
            except asyncio.CancelledError:
                raise
            except Exception:  # never leave requests hanging on a dead loop
                logger.exception("inference_sim engine step failed")
                self._fail_all("engine failure")
                prev_end = None
