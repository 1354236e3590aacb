"""The web process's half of a stream (docs/architecture.md, "Streaming"):
read the request's Redis Stream (on the process's one shared XREAD:
gateway/web/stream_reads.py) and hand each batch of chunks to the ASGI
server as it arrives (no thread per stream, nothing buffered past a
batch), then end with ``data: [DONE]`` or the outcome's error event
(gateway/core/request/streams.py).

Between reads it watches the request as the unstreamed wait does
(gateway/web/dispatch.py): a worker lost mid-stream is taken over (finished
on the answer its first chunk stored: charged on the estimate, said in an
error event), so the caller never hangs. A caller that goes away (the ASGI
server cancels the response) sets the cancel flag, and the worker closes
the pool call."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from django.conf import settings
from django.http import StreamingHttpResponse

from budgets.redis.clients import REDIS_UNAVAILABLE, get_async_redis
from budgets.errors import Rejected
from gateway.core import keys
from gateway.core.errors import error_body
from gateway.core.observability import TIME_TO_FIRST_TOKEN
from gateway.core.request.records import FINISH, LOST, REQUEUE, Outcome, RequestRecord
from gateway.core.request.streams import CHUNK_FIELD, sse_event, stream_closing_events, stream_error_event
from gateway.web.dispatch import _claim, _stream_cancel_quietly, _take_over, _wait_outcome
from gateway.web.stream_reads import STREAM_READ_BATCH, StreamSub, shared_reads, stream_subscribe

logger = logging.getLogger(__name__)


def _unavailable_event(message: str) -> bytes:
    return stream_error_event(Outcome(status="result_unavailable", body=error_body(
        message=message, error_type="service_unavailable", code="result_unavailable")))


async def stream_relay(*, record: RequestRecord, head: tuple = ()) -> AsyncIterator[bytes]:
    """The caller's server-sent events, from the stream's first chunk:
    ``head``, the entries already read while waiting for it (id, fields),
    then what later reads bring."""
    stream_key = keys.request_stream(record.request_id)
    result_key = keys.request_result(record.request_id)
    block_ms = max(1, int(settings.SLUICE_HEARTBEAT_INTERVAL_S * 1000))
    last_id = "0-0"
    ended = False
    sub: StreamSub | None = None
    try:
        while True:
            if head:
                reply, head = [(stream_key, list(head))], ()
            else:
                try:
                    if shared_reads():  # the process's one read of every stream (gateway/web/stream_reads.py)
                        sub = sub or stream_subscribe(stream_key, last_id)
                        entries = await sub.read(block_ms / 1000)
                        reply = [(stream_key, entries)] if entries else None
                    else:
                        reply = await get_async_redis(blocking=True).xread({stream_key: last_id},
                                                                           count=STREAM_READ_BATCH, block=block_ms)
                except REDIS_UNAVAILABLE:
                    logger.warning("request %s: lost the stream store mid-stream", record.request_id, exc_info=True)
                    ended = True  # nobody could read a cancel flag either; the worker settles what it relayed
                    yield _unavailable_event("Sluice lost its connection to the stream; "
                                             "the request may still complete.")
                    return
            if not reply:
                # Quiet for an interval: is the worker still there?
                outcome = await _wait_outcome(result_key, 0.01)
                if outcome is None:
                    claim = await _claim(record)
                    if claim.verdict in (LOST, FINISH, REQUEUE):
                        await _take_over(record, claim)
                    continue
                ended = outcome.status == "ok"
                yield stream_closing_events(outcome)
                return
            events = []
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                chunk = fields.get(CHUNK_FIELD)
                if chunk is not None:
                    events.append(sse_event(chunk))
                    continue
                # The end marker: the outcome was published just before it.
                outcome = await _wait_outcome(result_key, settings.SLUICE_HEARTBEAT_INTERVAL_S)
                # Any other end (a take-over from a worker whose heartbeat
                # only stalled) also asks that worker to stop.
                ended = outcome is not None and outcome.status == "ok"
                events.append(stream_closing_events(outcome) if outcome is not None else
                              _unavailable_event("The stream ended without its outcome."))
                yield b"".join(events)
                return
            yield b"".join(events)
    except Rejected:  # the result store away while reading the outcome
        ended = True
        yield _unavailable_event("Sluice lost its connection to the result store; the request may still complete.")
    finally:
        if sub is not None:
            sub.close()
        if not ended:  # the caller left, or the stream ended without the pool finishing it
            _stream_cancel_quietly(record)


def stream_response(*, record: RequestRecord, headers: dict[str, str], head: tuple = ()) -> StreamingHttpResponse:
    """The caller's ``text/event-stream`` answer, with the same headers an
    unstreamed answer has; ``head``: the stream's entries already read."""
    # Admission (Redis's clock, which the hosts share by NTP) to the first chunk.
    TIME_TO_FIRST_TOKEN.labels(lane=record.lane).observe(max(0.0, time.time() - record.admitted_ms / 1000))
    response = StreamingHttpResponse(stream_relay(record=record, head=head), content_type="text/event-stream")
    for name, value in headers.items():
        response[name] = value
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer it either
    return response
