"""uvicorn's httptools protocol, with each answer's head and body sent in
one write.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and the body when it sends ``http.response.body``:
two ``send`` system calls per answer. On a loopback or LAN connection a
send does much of the receiving side's work in the sender's system call
(the segment travels through the network stack, the reader is woken), so
the second one cost about as much again as the first: in py-spy,
uvicorn's ``send`` was 15-18% of the web process's on-CPU samples per
refusal (bench/PROFILE.md round 7).

Here the connection's transport keeps what is written during one turn of
the event loop and hands it to the real transport as one buffer at the end
of that turn (``loop.call_soon``). An app sends a whole small answer within
one turn (neither ``send`` awaits anything that suspends), so head and body
leave together; a streamed answer's chunks still leave as they are sent,
one turn later at most. Closing the connection sends what is pending first;
aborting it drops it, as an abort drops the real transport's buffer.
Everything else (flow control, reading, the peer's address) is the real
transport's.

Selected by ``--http llm_platform.http_protocol:HttpToolsProtocol``
(llm_platform/processes.py, docker/)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http import httptools_impl


class TurnBufferedTransport:
    """A transport whose writes within one event-loop turn go out as one."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(bytes(data))

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Hand what is pending to the real transport (idempotent)."""
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        pending = sum(len(chunk) for chunk in self._pending) if self._pending else 0
        return self._transport.get_write_buffer_size() + pending

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        # is_closing, get_extra_info, pause_reading, resume_reading,
        # set_write_buffer_limits, can_write_eof, ...: the real transport's.
        return getattr(self._transport, name)


class HttpToolsProtocol(httptools_impl.HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(TurnBufferedTransport(transport, self.loop))  # type: ignore[arg-type]
