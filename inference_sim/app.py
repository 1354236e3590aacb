"""HTTP surface: the OpenAI-compatible endpoints and the /admin controls.

Order of checks for a completion, chosen so each knob is testable alone:
body (400) -> model (404) -> per-request latency -> outage -> injected
failure -> provider limits (429) -> context length (400) -> engine. Outages
and injected failures are refused before the limits, so they use no RPM/TPM.
Legacy completions run the same; embeddings check each input's length
before the limits and take one engine step of prefill (no decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from inference_sim import errors
from inference_sim.config import SimConfig
from inference_sim.engine import Sequence
from inference_sim.errors import OpenAIError
from inference_sim.limits import Rejection, WindowEntry, go_duration, real_retry_after
from inference_sim.pool import SimulatedPool
from inference_sim.protocol import (ChunkWriter, SimOverrides, completion_body, embedding_vector, embeddings_body,
                                    new_completion_id, parse_chat_request, parse_completion_request,
                                    parse_embedding_request, text_completion_body)
from inference_sim.text import completion_text, token_pieces

# nginx's "client closed request": what we record when the caller hung up.
CLIENT_CLOSED = 499


def _ms(value: float) -> str:
    return f"{value:.3f}"


async def _client_disconnected(receive: Receive) -> None:
    """Returns once the client hangs up (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # an unexpected message: don't spin on it


async def _unless_disconnected(request: Request, awaitable: Awaitable[Any]) -> bool:
    """Await ``awaitable``; False (and cancel it) if the client hangs up first.

    A gateway that gives up on a call closes the connection; like vLLM, the
    pool then drops the sequence so its slot and KV cache free up at once.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_client_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        work.result()
        return True
    work.cancel()
    return False


@dataclass(frozen=True)
class Generation:
    """What a chat or legacy completion asks the engine for, whatever its
    wire format: one prompt per choice (chat: exactly one)."""

    model: str
    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    sim: SimOverrides
    param: str  # where the prompt is in the body, for errors ("messages", "prompt")
    text: bool = False  # a legacy (text) completion


class ChatHandler:
    """``POST /v1/chat/completions``; the subclasses below serve the other endpoints."""

    def __init__(self, pool: SimulatedPool) -> None:
        self.pool = pool

    async def handle(self, request: Request) -> Response:
        self.pool.counters.requests_total += 1
        try:
            response = await self._serve(request)
        except OpenAIError as exc:
            response = exc.to_response()
        # reset() may have swapped the counters mid-request; count in the new ones.
        self.pool.counters.record_status(response.status_code)
        return response

    def _generation(self, raw_body: bytes) -> Generation:
        config = self.pool.config
        chat = parse_chat_request(raw_body, config.models, config.default_max_tokens)
        return Generation(model=chat.model, prompt_tokens=[self.pool.count_prompt_tokens(chat.messages, chat.prompt_fields)],
                          max_tokens=chat.max_tokens, stream=chat.stream, include_usage=chat.include_usage,
                          sim=chat.sim, param="messages")

    def _ratelimit_headers(self) -> dict[str, str]:
        config = self.pool.config
        used_requests, used_tokens = self.pool.limiter.usage()
        reset_requests, reset_tokens = self.pool.limiter.reset_after(config.rpm, config.tpm)
        clock = self.pool.clock
        # Limits are stated per minute of the caller's (real) clock, as a
        # provider's are: a simulator running N times faster allows N times
        # its simulated-minute limit per real minute. Remaining counts are
        # what its window holds now; resets are real time too.
        per_real_minute = 60.0 / clock.to_real(60.0)
        headers = {}
        if config.rpm:
            headers["x-ratelimit-limit-requests"] = str(round(config.rpm * per_real_minute))
            headers["x-ratelimit-remaining-requests"] = str(max(0, config.rpm - used_requests))
            headers["x-ratelimit-reset-requests"] = go_duration(clock.to_real(reset_requests))
        if config.tpm:
            headers["x-ratelimit-limit-tokens"] = str(round(config.tpm * per_real_minute))
            headers["x-ratelimit-remaining-tokens"] = str(max(0, config.tpm - used_tokens))
            headers["x-ratelimit-reset-tokens"] = go_duration(clock.to_real(reset_tokens))
        return headers

    def _check_failures(self, sim: SimOverrides) -> None:
        pool = self.pool
        outage = pool.active_outage()
        if outage is not None:
            status, remaining = outage
            headers = errors.retry_headers(*real_retry_after(pool.clock, remaining)) if status in (429, 503) else {}
            raise errors.failure(status, headers=headers, reason="simulated outage")
        if sim.fail_status is not None:
            headers = {}
            retry_after = sim.fail_retry_after
            if retry_after is None and sim.fail_status == 429:
                retry_after = 1.0
            if retry_after is not None:
                # Given in real seconds: it is what the client will sleep.
                headers = errors.retry_headers(math.ceil(retry_after), math.ceil(retry_after * 1000))
            raise errors.failure(sim.fail_status, headers=headers, reason="injected failure")

    def _rate_limited(self, model: str, rejection: Rejection) -> OpenAIError:
        pool = self.pool
        pool.counters.rate_limited[rejection.kind] += 1
        retry_s, retry_ms = real_retry_after(pool.clock, rejection.retry_after_sim_s)
        unit = "RPM" if rejection.kind == "requests" else "TPM"
        message = (
            f"Rate limit reached for {model} in organization inference-sim on {rejection.kind} per min "
            f"({unit}): Limit {rejection.limit}, Used {rejection.used}, Requested {rejection.requested}. "
            f"Please try again in {retry_ms / 1000:.3f}s."
        )
        headers = {**errors.retry_headers(retry_s, retry_ms), **self._ratelimit_headers()}
        return OpenAIError(429, message, rejection.kind, code="rate_limit_exceeded", headers=headers)

    async def _serve(self, request: Request) -> Response:
        pool = self.pool
        config = pool.config
        gen = self._generation(await request.body())

        if gen.sim.latency_ms:
            await pool.clock.sleep(gen.sim.latency_ms / 1000)
        self._check_failures(gen.sim)

        # Checked against the worst case at arrival, as OpenAI does.
        prompt_tokens = sum(gen.prompt_tokens)
        admission = pool.limiter.try_admit(config.rpm, config.tpm, prompt_tokens + gen.max_tokens * len(gen.prompt_tokens))
        if isinstance(admission, Rejection):
            raise self._rate_limited(gen.model, admission)

        outputs = [pool.output_length(gen.sim.output_tokens, gen.max_tokens) for _ in gen.prompt_tokens]
        for prompt, (completion_tokens, _) in zip(gen.prompt_tokens, outputs):
            if prompt + completion_tokens > config.kv_cache_tokens:
                pool.limiter.release(admission)
                raise errors.invalid_request(
                    f"This model's maximum context length is {config.kv_cache_tokens} tokens. However, you requested "
                    f"{prompt + completion_tokens} tokens ({prompt} in the {gen.param}, "
                    f"{completion_tokens} in the completion).",
                    param=gen.param,
                    code="context_length_exceeded",
                )

        headers = {"x-request-id": uuid.uuid4().hex, **self._ratelimit_headers()}
        # Several prompts run as one sequence: their tokens (and the usage)
        # are exact, their decode steps add up instead of overlapping.
        seq = Sequence(prompt_tokens, sum(tokens for tokens, _ in outputs), arrival=pool.clock.now())
        pool.begin()
        if config.zero_latency:
            seq.finish_instantly()
        else:
            pool.engine.submit(seq)

        if gen.stream:
            return await self._stream(request, gen, seq, admission, outputs[0][1], headers)
        return await self._complete(request, gen, seq, admission, outputs, headers)

    def _abandon(self, seq: Sequence, entry: WindowEntry) -> None:
        self.pool.engine.abort(seq)
        self.pool.finish(seq, entry, "aborted")

    async def _engine_done(
        self, request: Request, seq: Sequence, entry: WindowEntry, wait: Callable[[], Awaitable[Any]]
    ) -> bool:
        """Wait for the engine; False if the client hung up (the sequence is then aborted)."""
        if seq.finished:
            return True
        try:
            done = await _unless_disconnected(request, wait())
        except asyncio.CancelledError:  # the server is shutting down: account for it all the same
            self._abandon(seq, entry)
            raise
        if not done:
            self._abandon(seq, entry)
        return done

    def _fail(self, seq: Sequence, entry: WindowEntry) -> OpenAIError:
        self.pool.finish(seq, entry, "failed")
        return errors.failure(500, reason=seq.error)

    async def _complete(
        self, request: Request, gen: Generation, seq: Sequence, entry: WindowEntry, outputs: list[tuple[int, str]],
        headers: dict
    ) -> Response:
        if not await self._engine_done(request, seq, entry, seq.completed.wait):
            return Response(status_code=CLIENT_CLOSED)
        if seq.error:
            raise self._fail(seq, entry)
        self.pool.finish(seq, entry, "completed")
        headers.update(
            {
                "x-sim-queue-ms": _ms(seq.queue_ms),
                "x-sim-prefill-ms": _ms(seq.prefill_ms),
                "x-sim-decode-ms": _ms(seq.decode_ms),
            }
        )
        if gen.text:
            body = text_completion_body(new_completion_id("cmpl"), gen.model,
                                        [(completion_text(tokens), reason) for tokens, reason in outputs],
                                        seq.prompt_tokens, seq.generated)
        else:
            body = completion_body(new_completion_id(), gen.model, completion_text(seq.generated), outputs[0][1],
                                   seq.prompt_tokens, seq.generated)
        return JSONResponse(body, headers=headers)

    async def _stream(
        self, request: Request, gen: Generation, seq: Sequence, entry: WindowEntry, finish_reason: str, headers: dict
    ) -> Response:
        # Start the response at the first token, so the headers can carry the
        # queue and prefill times; decode time is not known until the end.
        if not await self._engine_done(request, seq, entry, lambda: seq.wait_generated(1)):
            return Response(status_code=CLIENT_CLOSED)
        if seq.error:
            raise self._fail(seq, entry)
        headers.update({"x-sim-queue-ms": _ms(seq.queue_ms), "x-sim-prefill-ms": _ms(seq.prefill_ms)})
        headers["cache-control"] = "no-cache"
        return _StreamResponse(_StreamSession(self.pool, gen, seq, entry, finish_reason), headers)


class TextCompletionHandler(ChatHandler):
    """``POST /v1/completions`` (legacy): a prompt (or several) instead of messages."""

    def _generation(self, raw_body: bytes) -> Generation:
        pool = self.pool
        completion = parse_completion_request(raw_body, pool.config.models, pool.config.default_max_tokens)
        return Generation(model=completion.model, prompt_tokens=[pool.count_input_tokens(p) for p in completion.prompts],
                          max_tokens=completion.max_tokens, stream=completion.stream,
                          include_usage=completion.include_usage, sim=completion.sim, param="prompt", text=True)


class EmbeddingsHandler(ChatHandler):
    """``POST /v1/embeddings``: one engine step of prefill over every input
    (no decode), deterministic vectors from each input's text."""

    async def _serve(self, request: Request) -> Response:
        pool = self.pool
        config = pool.config
        embedding = parse_embedding_request(await request.body(), config.embedding_models, config.embedding_dimensions)
        texts = [pool.input_text(item) for item in embedding.inputs]
        counts = [pool.count_input_tokens(item) for item in embedding.inputs]
        if embedding.sim.latency_ms:
            await pool.clock.sleep(embedding.sim.latency_ms / 1000)
        self._check_failures(embedding.sim)
        for index, count in enumerate(counts):
            if count > config.embedding_max_input_tokens:
                raise errors.invalid_request(
                    f"This model's maximum context length is {config.embedding_max_input_tokens} tokens, however you "
                    f"requested {count} tokens in input {index}.", param="input", code="context_length_exceeded")
        prompt_tokens = sum(counts)
        admission = pool.limiter.try_admit(config.rpm, config.tpm, prompt_tokens)
        if isinstance(admission, Rejection):
            raise self._rate_limited(embedding.model, admission)
        headers = {"x-request-id": uuid.uuid4().hex, **self._ratelimit_headers()}
        seq = Sequence(prompt_tokens, 0, arrival=pool.clock.now())
        pool.begin()
        if config.zero_latency:
            seq.finish_instantly()
        else:
            pool.engine.submit(seq)
        if not await self._engine_done(request, seq, admission, seq.completed.wait):
            return Response(status_code=CLIENT_CLOSED)
        if seq.error:
            raise self._fail(seq, admission)
        pool.finish(seq, admission, "completed")
        headers.update({"x-sim-queue-ms": _ms(seq.queue_ms), "x-sim-prefill-ms": _ms(seq.prefill_ms)})
        vectors = [embedding_vector(text, native_dimensions=config.embedding_dimensions,
                                    dimensions=embedding.dimensions) for text in texts]
        return JSONResponse(embeddings_body(embedding.model, vectors, embedding.encoding_format, prompt_tokens),
                            headers=headers)


class _StreamSession:
    """One streamed completion: its SSE events, and its accounting exactly once."""

    def __init__(self, pool: SimulatedPool, gen: Generation, seq: Sequence, entry: WindowEntry, finish_reason: str):
        self._pool = pool
        self._gen = gen
        self._seq = seq
        self._entry = entry
        self._finish_reason = finish_reason
        self._outcome = "aborted"  # unless the end is reached: the client hung up
        self._closed = False

    async def events(self) -> AsyncIterator[str]:
        gen, seq = self._gen, self._seq
        writer = ChunkWriter(new_completion_id("cmpl" if gen.text else "chatcmpl"), gen.model, gen.include_usage,
                             text=gen.text)
        pieces = token_pieces(seq.output_tokens)
        emitted = 0
        fail_after = gen.sim.fail_after_tokens
        try:
            if opening := writer.role():
                yield opening
            while True:
                while emitted < seq.generated:
                    if fail_after is not None and emitted >= fail_after:
                        # An injected mid-stream failure: the stream just ends.
                        self._outcome = "failed"
                        self._pool.engine.abort(seq)
                        return
                    emitted += 1
                    yield writer.content(next(pieces))
                if seq.finished:
                    break
                seq.progress.clear()
                await seq.progress.wait()
            if seq.error:
                self._outcome = "failed"
                return  # a mid-stream failure just ends the stream, as upstreams do
            self._outcome = "completed"
            yield writer.finish(self._finish_reason)
            if gen.include_usage:
                yield writer.usage(seq.prompt_tokens, seq.generated)
            yield writer.done()
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._outcome == "aborted":
            self._pool.engine.abort(self._seq)
        self._pool.finish(self._seq, self._entry, self._outcome)


class _StreamResponse(StreamingResponse):
    def __init__(self, session: _StreamSession, headers: dict[str, str]) -> None:
        super().__init__(session.events(), media_type="text/event-stream", headers=headers)
        self._session = session

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            # On a disconnect Starlette abandons the generator; close it now (its
            # cleanup frees the slot) rather than whenever it is garbage collected.
            # A generator that never started has no cleanup to run: close() covers it.
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            self._session.close()


def _error_response(exc: Exception) -> JSONResponse:
    return errors.invalid_request(str(exc)).to_response()


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise ValueError("body must be JSON") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    return body


def create_app(config: SimConfig) -> Starlette:
    pool = SimulatedPool(config)
    chat = ChatHandler(pool)
    completions = TextCompletionHandler(pool)
    embeddings = EmbeddingsHandler(pool)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def list_models(request: Request) -> Response:
        data = [{"id": model, "object": "model", "created": 0, "owned_by": "inference-sim"}
                for model in (*config.models, *config.embedding_models)]
        return JSONResponse({"object": "list", "data": data})

    async def admin_capacity(request: Request) -> Response:
        try:
            return JSONResponse(pool.update_capacity(await _json_object(request)))
        except ValueError as exc:
            return _error_response(exc)

    async def admin_outage(request: Request) -> Response:
        try:
            body = await _json_object(request)
            seconds, status = body.get("seconds"), body.get("status", 503)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise ValueError("seconds must be a number >= 0 (0 ends an outage)")
            if isinstance(status, bool) or not isinstance(status, int):
                raise ValueError("status must be an integer")
            return JSONResponse({"outage": pool.start_outage(float(seconds), status)})
        except ValueError as exc:
            return _error_response(exc)

    async def admin_stats(request: Request) -> Response:
        return JSONResponse(pool.stats())

    async def admin_reset(request: Request) -> Response:
        pool.reset()
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/chat/completions", chat.handle, methods=["POST"]),
            Route("/v1/completions", completions.handle, methods=["POST"]),
            Route("/v1/embeddings", embeddings.handle, methods=["POST"]),
            Route("/admin/capacity", admin_capacity, methods=["POST"]),
            Route("/admin/outage", admin_outage, methods=["POST"]),
            Route("/admin/stats", admin_stats, methods=["GET"]),
            Route("/admin/reset", admin_reset, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.pool = pool
    return app
