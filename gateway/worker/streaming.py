"""The worker's half of a streamed request (docs/architecture.md, "Streaming").

The pool is asked to stream with its usage (``stream_options.include_usage``
is always set upstream: gateway/core/request/chat.py ``pool_payload``). Opening the
call is an attempt like any other: a refusal before the first chunk (429,
5xx, timeout) raises as the SDK raises it, and the retry policy in
gateway/worker/execution.py ``pool_call`` decides. From the first chunk on
nothing is retried: the chunks are appended to the request's Redis Stream
(gateway/core/request/streams.py) as they arrive, one round trip per batch
the pool sent together (what one read of its socket returns), the caller's
cancel flag read in the same round trip, and the outcome says what to charge:

- the pool's usage chunk when it sent one (``usage_source`` "pool");
- else the text produced, counted with the pool's tokenizer, and the prompt
  as estimated (``usage_source`` "counted"): a caller that went away
  (``cancelled``), a stream the pool broke off (``upstream_error``), a
  worker that stops past its shutdown grace (``upstream_error``,
  ``worker_shutdown``).

Before the first chunk is relayed, the request's stored answer is set to
"lost, charged on the estimate" (``worker_lost_outcome``): a worker killed
mid-stream is then finished from it by whoever takes the request over
(gateway/core/request/takeover.py), never delivered again (its caller already has
chunks) and never left hanging."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import httpx
import openai
from django.conf import settings

import llm_tokens
from budgets.admission.provider_limits import SentMark
from budgets.redis.clients import get_redis
from gateway.core.errors import error_body
from gateway.core.request.endpoints import pool_path
from gateway.core.request.records import Outcome, RequestRecord, worker_lost_outcome
from gateway.core.request.streams import stream_append
from gateway.worker.pool_client import PlainStream, pool_call_inline, pool_stream_open, stream_line_batches
from gateway.worker.shutdown import pool_call_within_grace, shutdown_grace_over
from gateway.worker.stream_hub import stream_hub_relay

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"
# The cancel flag is read with the first chunk and then at most this often
# (a caller that leaves is noticed within it plus one batch, well within the
# second the contract allows); the appends between are bare XADDs.
CANCEL_CHECK_S = 0.1
CLIENT_CLOSED = 499  # nginx's code: the caller closed the connection first
STREAM_BROKEN = (httpx.HTTPError, openai.APIError)


class _Relay:
    """What one stream produced so far."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.pieces: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.relayed = 0
        self.finished = False  # a finish_reason came
        self.produced = False  # some content came (not only the opening chunk's empty one)
        self.done = False  # [DONE] came
        self.error: dict[str, Any] | None = None  # an error event from the pool
        self.first_chunk_ms: int | None = None  # since the call started, when the first chunks were relayed
        self.next_check = 0.0  # when the cancel flag is next read (time.monotonic())
        self.completion_id = ""  # the pool's id for the answer, from its first chunk that has one

    def tokens(self) -> tuple[int, int, str]:
        """(input, output, usage_source) to settle on."""
        if self.usage is not None:
            return int(self.usage.get("prompt_tokens") or 0), int(self.usage.get("completion_tokens") or 0), "pool"
        text = "".join(self.pieces)
        output = llm_tokens.count_text_tokens(text, self.record.tokenizer or "cl100k_base") if text else 0
        return self.record.estimated_input_tokens, output, "counted"


def _read_chunk(relay: _Relay, data: str) -> bool:
    """Take one event's JSON in; whether to relay it to the caller."""
    try:
        chunk = json.loads(data)
    except ValueError:
        relay.error = {"message": "The inference pool sent an event that is not JSON."}
        return False
    if not isinstance(chunk, dict):
        return False
    if isinstance(chunk.get("error"), dict):
        relay.error = chunk["error"]
        return False
    if not relay.completion_id and isinstance(chunk.get("id"), str):
        relay.completion_id = chunk["id"][:128]
    if isinstance(chunk.get("usage"), dict):
        relay.usage = chunk["usage"]
    choices = chunk.get("choices")
    if not choices:
        # The usage chunk: only for a caller that asked for it.
        return relay.record.stream_usage
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        # A chat chunk's text is its delta's content; a legacy completion's, its "text".
        text = delta.get("content") if isinstance(delta, dict) else None
        text = choice.get("text") if text is None else text
        if isinstance(text, str):
            relay.pieces.append(text)
            relay.produced = relay.produced or bool(text)
        if choice.get("finish_reason"):
            relay.finished = True
    return True


def _append(client, relay: _Relay, chunks: list[str], started: float) -> bool:
    """Relay ``chunks`` (one round trip); True when the caller has gone away.
    The first append also sets the stored answer a lost worker is finished
    on (_first_chunk_answer), before the chunks are visible."""
    watch, answer_if_lost = relay_mark(relay, chunks, started)
    return stream_append(client, request_id=relay.record.request_id, chunks=chunks, watch=watch,
                         answer_if_lost=answer_if_lost, wake=relay.record.stream_wake)


def _first_chunk_answer(record: RequestRecord) -> str:
    """The stored answer from the first chunk on: the caller has chunks, so a
    lost worker's request is finished on it, not delivered again."""
    return worker_lost_outcome(record).to_json()


def take_lines(relay: _Relay, lines: list[str], opening: list[str]) -> list[str]:
    """One batch of the pool's lines (what one read brought): the events to
    relay. The opening chunk (the role, no content yet) is held in
    ``opening`` until the first token, to go with it in one append: the
    caller's stream starts with both, one relay through Redis and the web
    process instead of two. Sets ``relay.done`` at ``[DONE]`` and
    ``relay.error`` at an error event (the lines after either are not read)."""
    relayable: list[str] = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            relay.done = True
            break
        if not _read_chunk(relay, data):
            if relay.error is not None:
                break
            continue
        if (relay.relayed == 0 and not opening and not relayable
                and not (relay.produced or relay.finished or relay.usage)):
            opening.append(data)
            continue
        relayable.append(data)
    return relayable


def relay_mark(relay: _Relay, chunks: list[str], started: float) -> tuple[bool, str | None]:
    """Count ``chunks`` as relayed now: (whether this append reads the
    cancel flag, the stored answer to set with it when it is the first)."""
    now = time.monotonic()
    first = relay.relayed == 0
    if first:
        relay.first_chunk_ms = int((now - started) * 1000)
    relay.relayed += len(chunks)
    watch = now >= relay.next_check
    if watch:
        relay.next_check = now + CANCEL_CHECK_S
    return watch, _first_chunk_answer(relay.record) if first else None


def _relay_here(response, relay: _Relay, started: float) -> tuple[bool, bool]:
    """Relay the stream on this thread, one append per batch the pool sent
    together (what one read of its socket returns, or what piled up while
    the last append was out), never one per event: (cancelled, stopped)."""
    client = get_redis()
    cancelled = stopped = False
    opening: list[str] = []
    for lines in stream_line_batches(response):
        relayable = take_lines(relay, lines, opening)
        if relayable:
            cancelled = _append(client, relay, [*opening, *relayable], started)
            opening.clear()
            if cancelled:
                break
            if shutdown_grace_over():
                stopped = True
                break
        if relay.done or relay.error is not None:
            break
    if opening and not stopped and not cancelled:
        # The stream ended after its opening chunk: the caller still gets it.
        cancelled = _append(client, relay, opening, started)
    return cancelled, stopped


class _HubFlow:
    """A stream's relay as the stream hub drives it (gateway/worker/stream_hub.py
    ``HubFlow``): the same events, marks and opening chunk as ``_relay_here``."""

    def __init__(self, relay: _Relay, started: float) -> None:
        self.relay, self.started = relay, started
        self.request_id = relay.record.request_id
        self.stream_wake = relay.record.stream_wake
        self.opening: list[str] = []

    def take(self, lines: list[str]) -> list[str]:
        relayable = take_lines(self.relay, lines, self.opening)
        if not relayable:
            return []
        chunks, self.opening = [*self.opening, *relayable], []
        return chunks

    def mark(self, chunks: list[str]) -> tuple[bool, str | None]:
        return relay_mark(self.relay, chunks, self.started)

    def over(self) -> bool:
        return self.relay.done or self.relay.error is not None

    def done(self) -> bool:
        return self.relay.done

    def left(self) -> list[str]:
        held, self.opening = self.opening, []
        return held


def pool_stream(pool, record: RequestRecord, *, payload: dict[str, Any], extra_body: dict | None,
                started: float, mark: SentMark | None = None) -> Outcome:
    """One streamed attempt. Errors before the pool's first byte raise (the
    caller, ``_single_call``, turns them into a retryable outcome or not);
    everything after is this function's outcome."""
    body = {**payload, **extra_body} if extra_body else payload
    # http.client to a plain http:// pool, else the SDK client's own httpx
    # client, without the SDK's request building either way
    # (gateway/worker/pool_client.py): errors are the SDK's exceptions.
    response = pool_call_within_grace(lambda: pool_stream_open(pool, body=body, pool_id=record.pool_id, mark=mark,
                                                               path=pool_path(record.endpoint)),
                                      inline=pool_call_inline(pool))
    relay = _Relay(record)
    cancelled = stopped = False
    try:
        if isinstance(response, PlainStream) and settings.SLUICE_STREAM_HUB and response.hub_ready():
            # The process's one relay thread reads this stream beside every
            # other (gateway/worker/stream_hub.py); this thread waits for it.
            cancelled, stopped = stream_hub_relay(response, _HubFlow(relay, started))
        else:
            cancelled, stopped = _relay_here(response, relay, started)
    except STREAM_BROKEN as exc:
        logger.warning("request %s: the pool's stream broke off after %d chunks: %s", record.request_id,
                       relay.relayed, exc)
    finally:
        # Closing the response closes the connection: the pool stops generating.
        response.close()
    upstream_ms = int((time.monotonic() - started) * 1000)
    first_chunk_ms = relay.first_chunk_ms
    input_tokens, output_tokens, source = relay.tokens()
    outcome = Outcome(status="ok", input_tokens=input_tokens, output_tokens=output_tokens, upstream_ms=upstream_ms,
                      attempts=1, upstream_status=200, usage_source=source, streamed=relay.relayed > 0,
                      ttft_ms=first_chunk_ms, completion_id=relay.completion_id)
    if cancelled:
        return replace(outcome, status=CANCELLED, http_status=CLIENT_CLOSED,
                       body=error_body(message="The caller closed the stream.", error_type="invalid_request_error",
                                       code=CANCELLED))
    if stopped:
        return replace(outcome, status="upstream_error", http_status=503, retry_after_ms=1000,
                       body=error_body(message="The worker relaying this stream stopped; it is charged the tokens "
                                               "produced. Retry it.", error_type="service_unavailable",
                                       code="worker_shutdown"))
    if relay.error is not None or not (relay.done or relay.finished):
        message = relay.error.get("message") if relay.error else None
        return replace(outcome, status="upstream_error", http_status=502,
                       body=error_body(message="The inference pool's stream broke off"
                                               + (f": {str(message)[:500]}" if message else "")
                                               + "; it is charged the tokens produced.",
                                       error_type="upstream_error", code="upstream_stream_error"))
    return outcome
