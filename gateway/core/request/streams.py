"""The streaming relay between the worker and the waiting web process
(docs/architecture.md, "Streaming").

A streamed request is admitted, queued, claimed and retried like any other
until the pool's first chunk. From then on the worker appends each chunk of
the pool's server-sent events to the request's Redis Stream
(``keys.request_stream``: XADD, one field ``d`` = the event's JSON), and the
web process reads it with a blocking XREAD on the event loop and writes each
chunk to the caller as it arrives: no thread per stream, nothing buffered.

Whoever finishes the request (request_finish: the worker, or whoever took it
over from a lost worker) appends the end marker (field ``end``) after the
outcome is published, so the web process wakes at once and ends the stream
with ``data: [DONE]`` or an error event in OpenAI's shape.

Each append also names its request on the waiting web process's notice
stream (``RequestRecord.stream_wake``: its shared read's wake key,
gateway/web/stream_reads.py), in the same write and after the chunks, so
that read names only the streams that have news instead of every stream it
relays (a read's cost in Redis grows with the streams it names). A notice is
a hint: the chunks are in the request's stream, and a notice lost costs a
quiet interval's delay, never a chunk.

A caller that goes away sets the cancel flag (``keys.request_stream_cancel``);
the worker reads it in the round trip of an XADD (the first chunk's, then
one every 0.1 s: gateway/worker/streaming.py), closes the pool call (the
pool stops generating) and settles on the tokens produced. Both keys carry
the request's hash tag and expire with its other keys (TTL set with the
flag's reads and by every other write), so nothing leaks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from budgets.redis.clients import SyncRedis, get_redis
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.request.records import Outcome, ttl_ms

# The outcome status a waiting web process gets when a stream's first chunk
# came: answer with the stream, not with JSON.
STREAMING = "streaming"
CHUNK_FIELD = "d"
END_FIELD = "end"
# A notice's one field: the request ids of its appends, space-separated.
NOTICE_FIELD = "r"
# A notice stream keeps about this many notices; its reader reads far fewer
# at a time, and one that falls a whole batch behind reads every stream.
NOTICE_MAXLEN = 4096
# A notice stream's life past its last renewal (a web process gone leaves
# it to expire; its reader renews it too).
NOTICE_TTL_MS = 60_000
DONE_EVENT = b"data: [DONE]\n\n"


def stream_append(client: SyncRedis, *, request_id: str, chunks: Sequence[str], watch: bool = True,
                  answer_if_lost: str | None = None, wake: str = "") -> bool:
    """Append chunks (SSE events' JSON, one entry each) in one round trip;
    True when the caller has gone away. Several chunks go in one MULTI/EXEC,
    so a blocked reader wakes once with all of them (Redis serves blocked
    readers after a command, and EXEC is one), not once per chunk.
    ``watch``: also read the cancel flag and renew the stream's TTL (the
    worker does it with the first chunks and then every CANCEL_CHECK_S, not
    per chunk); otherwise bare XADDs, which cannot report a cancel.
    ``answer_if_lost``: with the first chunks, the request's stored answer
    (SET NX, before the XADD: no reader sees a chunk before it).
    ``wake``: the waiting web process's notice stream ('' none)."""
    commands = stream_append_commands(request_id=request_id, chunks=chunks, watch=watch,
                                      answer_if_lost=answer_if_lost, wake=wake)
    return stream_append_cancelled(commands.run(client), watch=watch)


def stream_append_commands(*, request_id: str, chunks: Sequence[str], watch: bool,
                           answer_if_lost: str | None, wake: str = "") -> Commands:
    """``stream_append``'s commands, for a caller that sends several streams'
    appends in one write (gateway/worker/stream_hub.py: it sends their
    notices itself, one per web process, so ``wake`` is '' there)."""
    stream_key = keys.request_stream(request_id)
    # Plain commands in one write (budgets/redis/composition.py Commands:
    # no redis-py pipeline per chunk).
    commands = Commands(transaction=len(chunks) > 1)
    if answer_if_lost is not None:
        commands.command("SET", keys.request_response(request_id), answer_if_lost, "NX", "PX", ttl_ms())
    for chunk in chunks:
        commands.command("XADD", stream_key, "*", CHUNK_FIELD, chunk)
    if wake:
        stream_notice_commands(commands, wake=wake, request_ids=(request_id,), renew=watch)
    if watch:
        commands.pexpire(stream_key, ttl_ms())
        commands.command("EXISTS", keys.request_stream_cancel(request_id))
    return commands


def stream_append_cancelled(replies: list, *, watch: bool) -> bool:
    """From an append's replies: whether the caller has gone away."""
    return watch and bool(replies[-1])


def stream_notice_commands(commands: Commands, *, wake: str, request_ids: Sequence[str], renew: bool) -> Commands:
    """Add to ``commands`` one notice on the web process's notice stream
    ``wake`` naming ``request_ids``, and with ``renew`` its TTL (the stream
    lives while appends come: a web process gone leaves it to expire)."""
    commands.command("XADD", wake, "MAXLEN", "~", NOTICE_MAXLEN, "*", NOTICE_FIELD, " ".join(request_ids))
    if renew:
        commands.pexpire(wake, NOTICE_TTL_MS)
    return commands


def stream_notice_ids(fields) -> list[str]:
    """The request ids a notice names (its fields as a list or a map)."""
    value = fields.get(NOTICE_FIELD) if isinstance(fields, dict) else (
        fields[1] if len(fields) >= 2 and fields[0] == NOTICE_FIELD else None)
    return value.split() if isinstance(value, str) else []


def stream_end(*, request_id: str, client: SyncRedis | None = None, wake: str = "") -> None:
    """Append the end marker: the outcome is published, the web process ends
    the stream with it. Idempotent enough: a second marker is never read
    (the reader stops at the first)."""
    stream_key = keys.request_stream(request_id)
    commands = Commands().command("XADD", stream_key, "*", END_FIELD, "1").pexpire(stream_key, ttl_ms())
    if wake:
        stream_notice_commands(commands, wake=wake, request_ids=(request_id,), renew=True)
    commands.run(client or get_redis())


def stream_cancel(*, request_id: str, client: SyncRedis | None = None) -> None:
    """The caller went away: ask the worker to close the pool call."""
    (client or get_redis()).set(keys.request_stream_cancel(request_id), "1", px=ttl_ms())


def sse_event(data: str | bytes) -> bytes:
    return b"data: " + (data.encode() if isinstance(data, str) else data) + b"\n\n"


def stream_error_event(outcome: Outcome) -> bytes:
    """An outcome that is not a completed stream, as OpenAI's error event
    (the SDKs raise APIError on it)."""
    error: dict[str, Any] = dict((outcome.body or {}).get("error") or {})
    error.setdefault("message", "The stream ended before the pool finished it.")
    error.setdefault("type", "server_error")
    error.setdefault("param", None)
    error.setdefault("code", outcome.status)
    return sse_event(json.dumps({"error": error}, separators=(",", ":")))


def stream_closing_events(outcome: Outcome) -> bytes:
    """How the caller's stream ends, given the request's outcome."""
    if outcome.status == "ok":
        return DONE_EVENT
    return stream_error_event(outcome)

