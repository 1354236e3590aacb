"""The worker's half of a stream, against a pool that paces its events
(gateway/worker/streaming.py, gateway/core/request/streams.py), on real Redis: the
opening chunk (the role, no content) goes to the caller with the first
token in one append, and chunks appended together wake a blocked reader
once, with all of them."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from budgets.redis.clients import get_redis
from gateway.core import keys
from gateway.core.request.streams import CHUNK_FIELD, stream_append
from gateway.worker import pool_client as pc
from tests.gateway.pool_streams import stream_call

pytestmark = pytest.mark.redis_cluster

OPENING_PAUSE_S = 0.3  # between the pool's opening chunk and its first token


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _events(kind: str) -> list[tuple[float, dict | str]]:
    """(pause before, event) as the pool sends them."""
    opening = (0.0, _chunk({"role": "assistant", "content": ""}))
    if kind == "opening_only":
        return [opening, (0.0, "[DONE]")]
    return [opening, (OPENING_PAUSE_S, _chunk({"content": "Hello"})), (0.0, _chunk({"content": " there"})),
            (0.0, _chunk({}, "stop")),
            (0.0, {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}),
            (0.0, "[DONE]")]


@pytest.fixture(params=["close", "chunked"])
def paced_pool(request) -> Iterator[callable]:
    """A pool whose stream is the events of the kind its request's model names,
    each flushed on its own after its pause: a body the connection's close
    ends (read on the call's thread), or a chunked one on a kept-alive
    connection, as vLLM sends it (read by the worker's stream hub)."""
    chunked = request.param == "chunked"

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if chunked else "HTTP/1.0"

        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
            self.end_headers()
            for pause, event in _events(body["model"]):
                time.sleep(pause)
                data = (event if isinstance(event, str) else json.dumps(event)).encode()
                event_bytes = b"data: " + data + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event_bytes), event_bytes) if chunked else event_bytes)
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pc._clients.clear()
    try:
        yield lambda: f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        pc._clients.clear()


def _first_read(redis_client, request_id: str) -> tuple[threading.Thread, list]:
    """A reader blocked on the request's stream, as the web process waits for
    its first chunk; what its first read returned (an error of the read is
    raised by ``_joined``, not lost with its thread)."""
    got: list = []
    client = get_redis(blocking=True)
    # The connection is made here, before the reader's thread starts: on a
    # loaded machine a connect inside it can take longer than the test's
    # connect timeout, which is not what this test is about. To the stream's
    # own node (a cluster's client routes by key; a PING goes to any node):
    # a read that connects first can start after the pool's whole stream
    # was appended, and read all of it at once.
    client.exists(keys.request_stream(request_id))

    def read() -> None:
        try:
            reply = client.xread({keys.request_stream(request_id): "0-0"}, block=10_000)
            got.extend(reply[0][1] if reply else [])
        except Exception as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.1)  # blocked before anything is appended
    return reader, got


def _joined(reader: threading.Thread, got: list) -> list:
    reader.join(timeout=10)
    assert not reader.is_alive(), "the reader's first read did not end"
    for item in got:
        if isinstance(item, Exception):
            raise item
    return got


def test_the_opening_chunk_reaches_the_reader_with_the_first_token(paced_pool, redis_client):
    request_id = "req_opening"
    reader, first = _first_read(redis_client, request_id)
    # when the pool sends its opening chunk, then its first token 0.3 s later
    outcome = stream_call(request_id, paced_pool(), "paced")
    _joined(reader, first)
    # then the caller's first read has both: one relay, not one per chunk
    # (and whatever else came in the same read of the pool's socket: the
    # relay appends one batch per read)
    deltas = [json.loads(fields[CHUNK_FIELD])["choices"][0]["delta"] for _, fields in first]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Hello"}]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " there"}, {}][
        :len(deltas)]
    # and the whole stream is relayed in order, settled on the pool's usage
    entries = redis_client.xrange(keys.request_stream(request_id))
    assert len(entries) == 5  # opening, two tokens, the finish, the usage
    assert (outcome.status, outcome.input_tokens, outcome.output_tokens, outcome.usage_source) == ("ok", 5, 2, "pool")
    # and its time to first token is the first token's, not the opening chunk's
    assert outcome.ttft_ms >= OPENING_PAUSE_S * 1000 - 50


def test_a_stream_that_ends_after_its_opening_chunk_still_relays_it(paced_pool, redis_client):
    request_id = "req_opening_only"
    outcome = stream_call(request_id, paced_pool(), "opening_only")
    entries = redis_client.xrange(keys.request_stream(request_id))
    assert [json.loads(fields[CHUNK_FIELD])["choices"][0]["delta"] for _, fields in entries] == \
        [{"role": "assistant", "content": ""}]
    assert outcome.status == "ok" and outcome.streamed


def test_chunks_appended_together_wake_a_blocked_reader_once_with_all_of_them(redis_client):
    request_id = "req_together"
    reader, first = _first_read(redis_client, request_id)
    cancelled = stream_append(redis_client, request_id=request_id, chunks=["a", "b", "c"], watch=True,
                              answer_if_lost='{"status": "worker_lost"}')
    _joined(reader, first)
    assert not cancelled
    assert [fields[CHUNK_FIELD] for _, fields in first] == ["a", "b", "c"]
    # the stored answer went first, and the stream has its TTL
    assert redis_client.get(keys.request_response(request_id)) == '{"status": "worker_lost"}'
    assert redis_client.pttl(keys.request_stream(request_id)) > 0
    # a cancel flag is read in the same round trip
    redis_client.set(keys.request_stream_cancel(request_id), "1")
    assert stream_append(redis_client, request_id=request_id, chunks=["d"], watch=True) is True
    assert stream_append(redis_client, request_id=request_id, chunks=["e"], watch=False) is False
    assert redis_client.xlen(keys.request_stream(request_id)) == 5
