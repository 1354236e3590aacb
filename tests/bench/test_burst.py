"""The burst scenario's client reads a stream's events, error events and
refusals as it should, and its statistics count what finished; the
process meters read /proc. No timing assertions (CONVENTIONS: speed claims
live in bench/).

No __init__.py in this folder on purpose (see test_baseline_gateway.py)."""

from __future__ import annotations

import asyncio
import json
import os
import time

from bench.burst import _stats
from bench.burst_client import one
from bench.common import speed_scaled
from bench.procs import CpuMeter, RssPeaks


def _event(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def _chunk(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}}], "usage": None}


async def _serve(answer: bytes, request: dict) -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        request["head"] = head.decode()
        request["body"] = json.loads(await reader.readexactly(length))
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions"


def _chunked(events: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for event in events:
        # split each event over two HTTP chunks: the client must join them
        for part in (event[:7], event[7:]):
            out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


def _ask(answer: bytes) -> tuple[dict, dict]:
    async def run() -> tuple[dict, dict]:
        request: dict = {}
        server, url = await _serve(answer, request)
        async with server:
            result = await one(url, {"Authorization": "Bearer k"}, {"stream": True}, time.monotonic())
        return result, request

    return asyncio.run(run())


def test_a_whole_stream_counts_its_usage_and_first_content():
    # given a stream of a role chunk, two content chunks, the usage chunk and [DONE]
    events = [_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), _event(_chunk("Hel")),
              _event(_chunk("lo")), _event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}),
              _event(b"[DONE]")]
    # when the client reads it
    result, request = _ask(_chunked(events))
    # then
    assert (result["status"], result["code"], result["tokens"], result["events"]) == (200, None, 2, 4)
    assert result["first_s"] is not None and result["end_s"] >= result["first_s"]
    assert request["body"] == {"stream": True}
    assert "Authorization: Bearer k" in request["head"]


def test_an_error_event_and_a_stream_without_done_are_errors():
    error = [_event(_chunk("a")), _event({"error": {"code": "upstream_error", "message": "x"}}), _event(b"[DONE]")]
    assert _ask(_chunked(error))[0]["code"] == "upstream_error"
    cut = [_event(_chunk("a"))]
    assert _ask(_chunked(cut))[0]["code"] == "short_stream"


def test_a_refusal_keeps_its_status_and_code():
    body = json.dumps({"error": {"code": "workload_rpm", "message": "over", "type": "rate_limit"}}).encode()
    answer = (f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
              "\r\n\r\n").encode() + body
    result, _ = _ask(answer)
    assert (result["status"], result["code"], result["tokens"]) == (429, "workload_rpm", 0)


def test_stats_count_only_finished_streams():
    streams = [{"status": 200, "code": None, "first_s": 0.1, "end_s": 2.0, "tokens": 256},
               {"status": 200, "code": None, "first_s": 0.3, "end_s": 4.0, "tokens": 256},
               {"status": 200, "code": "queue_timeout", "first_s": None, "end_s": 10.0, "tokens": 0},
               {"status": 429, "code": "workload_tpm", "first_s": None, "end_s": 0.01, "tokens": 0}]
    stats = _stats(streams)
    assert (stats["finished"], stats["tokens"], stats["last_end_s"], stats["burst_s"]) == (2, 512, 4.0, 10.0)
    assert stats["errors"] == {"queue_timeout": 1, "workload_tpm": 1}
    assert stats["tokens_per_s"] == 51.2


def test_the_meters_read_this_process():
    cpu = CpuMeter({"me": os.getpid()}).read()
    rss = RssPeaks({"me": os.getpid()})
    rss.sample()
    assert cpu["me"] > 0
    assert rss.peak["me"] > 0 and rss.peak_total == rss.peak["me"] and rss.samples == 1


def test_targets_scale_with_the_machine_speed():
    assert speed_scaled(4.0, 0.9) == 4.0
    assert speed_scaled(4.0, 1.8) == 8.0
