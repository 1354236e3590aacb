"""A callback receiver for tests: an HTTP server on 127.0.0.1 that records
every POST (when, headers, raw body) and answers the statuses it is given in
turn (the last one repeats)."""

from __future__ import annotations

import http.server
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Received:
    at: float  # time.monotonic()
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class CallbackReceiver:
    statuses: list[int] = field(default_factory=lambda: [204])
    received: list[Received] = field(default_factory=list)

    def __enter__(self) -> CallbackReceiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                index = len(receiver.received)
                receiver.received.append(Received(at=time.monotonic(), path=self.path,
                                                  headers={k.lower(): v for k, v in self.headers.items()}, body=body))
                self.send_response(receiver.statuses[min(index, len(receiver.statuses) - 1)])
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def port(self) -> int:
        return self.server.server_port

    def url(self, path: str = "/hook", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def wait_for(self, count: int, timeout: float = 20.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.received)
