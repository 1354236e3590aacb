"""One HTTP request straight into an ASGI app, in this process, for tests
that need the app's own answer (status, headers, body) without a server."""

from __future__ import annotations

import asyncio


def get_scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}


async def asgi_call(app, scope: dict, body: bytes = b"") -> list[dict]:
    """Every message the app sent for ``scope`` and ``body`` (the client never leaves)."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent
