"""The web process's HTTP protocol (llm_platform/http_protocol.py): what
uvicorn writes within one event-loop turn reaches the socket as one write (an
answer's head and body together), streamed chunks still leave turn by turn,
closing sends what is pending and aborting drops it; and uvicorn serves
through it unchanged: keep-alive, bodies, streams, a closed connection."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from llm_platform.http_protocol import HttpToolsProtocol, TurnBufferedTransport


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def test_writes_of_one_turn_go_as_one_and_the_next_turns_on_their_own():
    async def run():
        real = RecordingTransport()
        transport = TurnBufferedTransport(real, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(bytearray(b"body"))
        transport.write(b"")
        assert real.writes == []  # nothing until the turn ends
        assert transport.get_write_buffer_size() == 7 + 23
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        transport.writelines([b"chunk 1", memoryview(b"!")])
        await asyncio.sleep(0)
        transport.write(b"chunk 2")
        await asyncio.sleep(0)
        assert real.writes[1:] == [b"chunk 1!", b"chunk 2"]
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the real transport's

    asyncio.run(run())


def test_close_sends_what_is_pending_first_and_abort_drops_it():
    async def run():
        real = RecordingTransport()
        transport = TurnBufferedTransport(real, asyncio.get_running_loop())
        transport.write(b"last words")
        transport.close()
        assert real.writes == [b"last words"] and real.closed
        await asyncio.sleep(0)  # the scheduled flush finds nothing left
        assert real.writes == [b"last words"]

        other = RecordingTransport()
        transport = TurnBufferedTransport(other, asyncio.get_running_loop())
        transport.write(b"never sent")
        transport.abort()
        await asyncio.sleep(0)
        assert other.writes == [] and other.aborted

    asyncio.run(run())


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    answer = b"echo:" + body
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_app, http=HttpToolsProtocol, loop="asyncio", log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_uvicorn_serves_through_it_keep_alive_bodies_and_streams(server):
    with httpx.Client(base_url=server) as client:
        for i in range(5):  # one kept-alive connection, five answers
            reply = client.post("/echo", content=f"n{i}".encode())
            assert reply.status_code == 201 and reply.text == f"echo:n{i}"
        big = b"x" * 300_000
        assert client.post("/echo", content=big).content == b"echo:" + big
        with client.stream("GET", "/stream") as stream:
            assert stream.status_code == 200
            assert b"".join(stream.iter_bytes()) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


def test_a_connection_the_server_closes_gets_its_answer_first(server):
    # HTTP/1.0 without keep-alive: uvicorn closes after the answer
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi")
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 201") and received.endswith(b"\r\n\r\necho:hi")
