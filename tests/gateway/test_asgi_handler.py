"""The /v1 ASGI handler (llm_platform/asgi.py) answers without starting a
thread per request (Django's own handler starts and joins one for each), and
a client that goes away cancels its view as in Django's."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def _scope(path: str, headers: list[tuple[bytes, bytes]] = ()) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 5000),
            "server": ("testserver", 80)}


async def _call(app, scope: dict, *, disconnect_after_s: float | None = None) -> list[dict]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        if disconnect_after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_v1_answers_start_no_thread_per_request(monkeypatch):
    from llm_platform.asgi import application

    async def run(n: int) -> list[int]:
        statuses = []
        for _ in range(n):
            sent = await _call(application, _scope("/v1/models"))  # no key: 401, decided on the loop
            statuses.append(sent[0]["status"])
        return statuses

    async def main() -> tuple[list[int], int]:
        await run(3)  # warm: imports, the default executor
        started = []
        original = threading.Thread.start

        def counting_start(self):
            started.append(self.name)
            return original(self)

        monkeypatch.setattr(threading.Thread, "start", counting_start)
        statuses = await run(20)
        return statuses, len(started)

    statuses, threads_started = asyncio.run(main())
    assert statuses == [401] * 20
    assert threads_started == 0


def test_a_client_that_leaves_cancels_its_view(monkeypatch):
    from llm_platform import asgi

    cancelled = asyncio.Event()

    async def slow_view(request):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> list[dict]:
        monkeypatch.setattr(asgi.ApiHandler, "get_response_async", lambda self, request: slow_view(request))
        return await asyncio.wait_for(_call(asgi.api_application, _scope("/v1/models"), disconnect_after_s=0.05),
                                      timeout=5)

    sent = asyncio.run(main())
    assert cancelled.is_set()
    assert sent == []  # nothing was answered to a client that is gone
