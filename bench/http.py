"""A small keep-alive HTTP/1.1 client on asyncio streams.

The load generator shares two cores with the gateway, its workers and the
simulated pool; httpx costs several times more CPU per request than this, and
every millisecond the client burns is a millisecond the system under test
loses. It does only what the scenarios need: JSON POST/GET on loopback,
Content-Length or chunked bodies, a bounded pool of reused connections.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# Idle keep-alive connections older than this are not reused: uvicorn closes
# them after its keep-alive timeout (5 s by default), and a POST sent on a
# connection the server is closing would fail for reasons of our own.
MAX_IDLE_S = 2.0


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """An HTTP/1.1 answer's status and headers (names lower-cased)."""
    status_line = await reader.readline()
    if not status_line:
        raise asyncio.IncompleteReadError(b"", None)
    status = int(status_line.split(None, 2)[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return status, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def error_code(self) -> str | None:
        """OpenAI-shaped error code (``error.code``), or None."""
        if self.status < 400:
            return None
        try:
            error = self.json().get("error") or {}
        except (ValueError, AttributeError):
            return f"http_{self.status}"
        return error.get("code") or error.get("type") or f"http_{self.status}"


class TransportError(Exception):
    """No HTTP answer: refused, reset, or timed out."""


class _Conn:
    __slots__ = ("reader", "writer", "last_used")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_used = time.monotonic()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already gone
            pass


class HttpClient:
    def __init__(self, base_url: str, *, max_connections: int = 256, timeout: float = 120.0) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.last_used < MAX_IDLE_S and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> Response:
        payload = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 f"Content-Length: {len(payload)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
        async with self._slots:
            conn = self._take_idle() or await self._connect_checked()
            try:
                response, keep = await asyncio.wait_for(self._exchange(conn, raw), timeout or self.timeout)
            except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                conn.close()
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            if keep:
                conn.last_used = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return response

    async def _connect_checked(self) -> _Conn:
        try:
            return await asyncio.wait_for(self._connect(), 10.0)
        except (asyncio.TimeoutError, OSError) as exc:
            raise TransportError(f"connect: {type(exc).__name__}: {exc}") from exc

    async def _exchange(self, conn: _Conn, raw: bytes) -> tuple[Response, bool]:
        conn.writer.write(raw)
        await conn.writer.drain()
        reader = conn.reader
        status, headers = await read_head(reader)
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            body = b"".join(chunks)
        else:
            body = await reader.read()
            return Response(status, headers, body), False
        keep = headers.get("connection", "").lower() != "close"
        return Response(status, headers, body), keep

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
                   timeout: float | None = None) -> Response:
        return await self.request("POST", path, body, headers, timeout)

    async def get(self, path: str, headers: dict[str, str] | None = None, timeout: float | None = None) -> Response:
        return await self.request("GET", path, None, headers, timeout)

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
