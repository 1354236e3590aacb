"""The load generator of bench/burst.py, run as its own process so that its
CPU (parsing hundreds of thousands of server-sent events) never shares an
interpreter with the process that samples the platform's CPU and memory.

    python -m bench.burst_client SPEC_JSON

``SPEC_JSON`` holds ``mode`` ("burst" or "probe"), ``url`` (the chat
completions URL), ``headers``, ``body`` (the request, streamed), ``n`` and
``out`` (where to write the JSON result). In "burst" mode it prints
``ready`` once imported, then opens all ``n`` streams at once on asyncio
streams (one connection each, no client library: httpx costs several times
the CPU per chunk) and reads each to its end. In "probe" mode it sends the
``n`` requests one after another, ``every_s`` apart, each on a fresh
connection, and times each answer.

Per stream it keeps the status, the error code (a JSON error body, or an
error event inside the stream), the time of its first content chunk and of
its end (seconds from the burst's start), and the completion tokens of its
usage chunk. Only the events that can hold the first content, an error or
the usage are parsed as JSON; the others are counted."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit

from bench.http import read_head

try:
    import uvloop
except ImportError:  # the plain loop measures the same, at a higher client CPU
    uvloop = None


def _request_bytes(url: str, headers: dict[str, str], body: dict) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    lines = [f"POST {parts.path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close",
             *(f"{name}: {value}" for name, value in headers.items())]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def _body_parts(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body as it arrives: de-chunked, or up to Content-Length, or to EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readline()
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while part := await reader.read(65536):
            yield part


def _error_code(body: bytes, status: int) -> str:
    try:
        error = json.loads(body).get("error") or {}
        return str(error.get("code") or error.get("type") or f"http_{status}")
    except (ValueError, AttributeError):
        return f"http_{status}"


async def one(url: str, headers: dict[str, str], body: dict, t0: float) -> dict:
    """One streamed request, read to its end; times in seconds from ``t0``."""
    host, port, raw = _request_bytes(url, headers, body)
    sent = time.monotonic()
    out = {"start_s": sent - t0, "status": 0, "code": None, "first_s": None, "end_s": None, "tokens": 0,
           "events": 0}
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write(raw)
        await writer.drain()
        status, response_headers = await read_head(reader)
        out["status"] = status
        if status != 200:
            body_bytes = b"".join([part async for part in _body_parts(reader, response_headers)])
            out["code"] = _error_code(body_bytes, status)
            return out
        buffer, done = b"", False
        async for part in _body_parts(reader, response_headers):
            buffer += part.replace(b"\r\n", b"\n")
            while (cut := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:cut], buffer[cut + 2:]
                if not event.startswith(b"data: "):
                    continue
                data = event[6:]
                if data == b"[DONE]":
                    done = True
                    continue
                out["events"] += 1
                if (out["first_s"] is None and b'"content"' in data) or b'"error"' in data \
                        or b'"completion_tokens"' in data:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out["code"] = str((chunk["error"] or {}).get("code") or "stream_error")
                    choices = chunk.get("choices") or []
                    if out["first_s"] is None and choices and (choices[0].get("delta") or {}).get("content"):
                        out["first_s"] = time.monotonic() - t0
                    if chunk.get("usage"):
                        out["tokens"] = int(chunk["usage"].get("completion_tokens") or 0)
        if out["code"] is None and not done:
            out["code"] = "short_stream"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        out["code"] = f"transport: {type(exc).__name__}"
    finally:
        out["end_s"] = time.monotonic() - t0
        if writer is not None:
            writer.close()
    return out


async def burst(spec: dict) -> list[dict]:
    t0 = time.monotonic()
    return await asyncio.gather(*(one(spec["url"], spec["headers"], spec["body"], t0) for _ in range(spec["n"])))


async def probe(spec: dict) -> list[dict]:
    """Requests one at a time, ``every_s`` apart; each one's ``answer_s`` is
    the time from its send to its whole answer."""
    results = []
    for i in range(spec["n"]):
        if i:
            await asyncio.sleep(spec["every_s"])
        t0 = time.monotonic()
        result = await one(spec["url"], spec["headers"], spec["body"], t0)
        results.append({**result, "answer_s": result["end_s"]})
    return results


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    run = burst if spec["mode"] == "burst" else probe
    print("ready", flush=True)
    results = uvloop.run(run(spec)) if uvloop is not None else asyncio.run(run(spec))
    with open(spec["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
