"""The lane worker's stream hub (gateway/worker/stream_hub.py): one thread
per process reads every plain-path stream and relays each pass's appends in
one write. Against the real Redis and a real HTTP/1.1 pool on a socket."""

from __future__ import annotations

import http.server
import json
import random
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.core import keys
from gateway.core.request.streams import CHUNK_FIELD
from gateway.worker import pool_client as pc
from gateway.worker.stream_hub import BodyDecoder
from tests.gateway.pool_streams import stream_call

TOKENS = 12


def _chunked(data: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


def _feed_split(body: BodyDecoder, raw: bytes, cuts: list[int]) -> bytes:
    out, at = b"", 0
    for cut in [*cuts, len(raw)]:
        out += body.feed(raw[at:cut])
        at = cut
    return out


def test_a_chunked_body_decodes_the_same_however_its_reads_are_cut():
    # given a chunked body with an extension and a trailer
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)]
    raw = b"".join(_chunked(e, b";ext=1" if i == 2 else b"") for i, e in enumerate(events)) + b"0\r\nX-T: 1\r\n\r\n"
    # when it arrives cut at every single position, and at random cuts
    for cut in range(1, len(raw)):
        body = BodyDecoder(chunked=True, length=None)
        assert _feed_split(body, raw, [cut]) == b"".join(events)
        assert body.complete
    rng = random.Random(7)
    for _ in range(200):
        body = BodyDecoder(chunked=True, length=None)
        cuts = sorted(rng.sample(range(1, len(raw)), 6))
        assert _feed_split(body, raw, cuts) == b"".join(events)
        assert body.complete
    # then an unfinished body is not complete
    body = BodyDecoder(chunked=True, length=None)
    assert body.feed(raw[:-2]) == b"".join(events)
    assert not body.complete


def test_a_sized_body_and_one_to_the_close():
    body = BodyDecoder(chunked=False, length=10)
    assert body.feed(b"0123456") == b"0123456" and not body.complete
    assert body.feed(b"789extra") == b"789" and body.complete
    open_ended = BodyDecoder(chunked=False, length=None)
    assert open_ended.feed(b"abc") == b"abc" and not open_ended.complete


@pytest.mark.parametrize("raw", [b"zz\r\ndata\r\n", b"3\r\nabcXY", b"-1\r\n", b"1" * 5000])
def test_bytes_that_are_not_chunked_framing_are_refused(raw):
    with pytest.raises(ValueError):
        BodyDecoder(chunked=True, length=None).feed(raw)


def _events(model: str) -> list[bytes]:
    n = int(model.split("-")[1]) if "-" in model else TOKENS
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]} for i in range(n)]
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


@pytest.fixture
def chunked_pool() -> Iterator[dict]:
    """An HTTP/1.1 pool sending each event as its own chunk, a few ms apart
    (model ``stall``: the opening chunk, then nothing; ``cut``: three tokens,
    then the connection closed mid-body); the client ports it served."""
    served: dict = {"ports": [], "url": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 (http.server's naming)
            model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
            served["ports"].append(self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = _events(model)
            if model == "stall":
                self.wfile.write(_chunked(events[0]))
                self.wfile.flush()
                time.sleep(3)
                self.close_connection = True
                return
            if model == "cut":
                for event in events[:4]:
                    self.wfile.write(_chunked(event))
                self.wfile.flush()
                self.close_connection = True
                return
            for event in events:
                time.sleep(0.002)
                self.wfile.write(_chunked(event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # 40 connects at once (the default backlog is 5)

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    served["url"] = f"http://127.0.0.1:{server.server_port}/v1"
    pc._clients.clear()
    try:
        yield served
    finally:
        server.shutdown()
        pc._clients.clear()


def _relayed(redis_client, request_id: str) -> list[dict]:
    return [json.loads(fields[CHUNK_FIELD]) for _, fields in redis_client.xrange(keys.request_stream(request_id))]


def test_forty_streams_at_once_each_relayed_whole_and_in_order_by_one_thread(chunked_pool, redis_client):
    # given 40 streams, each of its own length, started at once on 40 threads
    ids = [f"req_hub_{i}" for i in range(40)]
    outcomes: dict = {}

    def run(i: int) -> None:
        outcomes[ids[i]] = stream_call(ids[i], chunked_pool["url"], f"m-{5 + i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # then one hub thread relayed them all
    assert [t.name for t in threading.enumerate()].count("stream-hub") == 1
    for i, request_id in enumerate(ids):
        n = 5 + i
        chunks = _relayed(redis_client, request_id)
        # every event but [DONE], in the pool's order, the opening chunk first
        assert len(chunks) == n + 3
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["delta"]["content"] for c in chunks[1:n + 1]] == [f"t{k}" for k in range(n)]
        outcome = outcomes[request_id]
        assert (outcome.status, outcome.output_tokens, outcome.usage_source, outcome.streamed) == ("ok", n, "pool", True)
    # and each body was read to its end: the next call reuses a kept connection
    before = len(set(chunked_pool["ports"]))
    assert stream_call("req_hub_again", chunked_pool["url"], "m-3").status == "ok"
    assert len(set(chunked_pool["ports"])) == before


def test_a_stream_quiet_past_the_read_timeout_ends_broken_and_charged(chunked_pool, redis_client, settings):
    # given a pool that sends its opening chunk and then nothing for 3 s
    settings.SLUICE_UPSTREAM_TIMEOUT_S = 0.5
    started = time.monotonic()
    outcome = stream_call("req_hub_stall", chunked_pool["url"], "stall")
    # then the stream ends at the read timeout, not at the pool's close
    assert time.monotonic() - started < 2.5
    assert (outcome.status, outcome.http_status) == ("upstream_error", 502)
    # and the opening chunk held for the first token was never relayed (no token came)
    assert _relayed(redis_client, "req_hub_stall") == []


def test_a_pool_that_closes_mid_body_ends_the_stream_with_what_it_relayed(chunked_pool, redis_client):
    outcome = stream_call("req_hub_cut", chunked_pool["url"], "cut")
    chunks = _relayed(redis_client, "req_hub_cut")
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "t0", "t1", "t2"]
    assert (outcome.status, outcome.http_status, outcome.usage_source) == ("upstream_error", 502, "counted")
    assert outcome.output_tokens > 0


def test_a_cancelled_caller_ends_its_stream_in_the_hub(chunked_pool, redis_client):
    # given the caller's cancel flag already set
    redis_client.set(keys.request_stream_cancel("req_hub_cancel"), "1", px=60_000)
    outcome = stream_call("req_hub_cancel", chunked_pool["url"], "m-200")
    # then the worker stops at its first append (which reads the flag)
    assert (outcome.status, outcome.http_status) == ("cancelled", 499)
    assert len(_relayed(redis_client, "req_hub_cancel")) < 200


def test_each_pass_names_its_streams_once_on_each_web_process_notice_stream(chunked_pool, redis_client):
    # given 30 streams at once whose records name one of two web processes' notice streams
    wakes = [keys.web_stream_wake(f"hubtest{n}") for n in range(2)]
    redis_client.delete(*wakes)
    ids = [f"req_hub_notice_{i}" for i in range(30)]
    threads = [threading.Thread(target=stream_call, args=(ids[i], chunked_pool["url"], "m-20", wakes[i % 2]))
               for i in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    appended = sum(len(_relayed(redis_client, request_id)) for request_id in ids)
    for n, wake in enumerate(wakes):
        notices = [fields["r"].split() for _, fields in redis_client.xrange(wake)]
        named = [request_id for notice in notices for request_id in notice]
        # then every stream of that web process is named there, and no other's
        assert set(named) == set(ids[n::2])
        # and the notices come one per pass, not one per append: fewer than the appends they name
        assert len(notices) < len(named) <= appended
        # and the notice stream expires on its own (a web process gone leaves nothing behind)
        assert 0 < redis_client.pttl(wake) <= 60_000
