"""The /v1 ASGI handler (adapters/django.py, wired in llm_platform/asgi.py)
answers without starting a thread per request (Django's own handler starts
and joins one for each), and a client that goes away cancels its view as in
Django's."""

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
    from adapters.django import MiddlewareFreeASGIHandler
    from llm_platform import asgi

    cancelled = asyncio.Event()

    async def slow_view(request):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> list[dict]:
        monkeypatch.setattr(MiddlewareFreeASGIHandler, "get_response_async", lambda self, request: slow_view(request))
        return await asyncio.wait_for(_call(asgi.api_application, _scope("/v1/models"), disconnect_after_s=0.05),
                                      timeout=5)

    sent = asyncio.run(main())
    assert cancelled.is_set()
    assert sent == []  # nothing was answered to a client that is gone


def _relay_like(loop, pending: list, inside: asyncio.Event, seen: list):
    """A loop of awaits under asyncio.wait_for, as the stream relay's redis-py
    commands are: it ends only on a CancelledError."""

    async def run() -> None:
        try:
            while True:
                inner = loop.create_future()
                pending.append(inner)
                inside.set()
                seen.append(await asyncio.wait_for(inner, 30))
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    return run()


def test_a_view_whose_cancel_python_lost_is_cancelled_again():
    """Python 3.11's wait_for returns its result instead of raising when the
    cancel reaches it in the same turn as its inner call finishes: the
    handler cancels again until the view has ended."""
    from adapters.django import cancel_until_done

    async def main() -> tuple[bool, list]:
        loop = asyncio.get_running_loop()
        pending, inside, seen = [], asyncio.Event(), []
        task = asyncio.ensure_future(_relay_like(loop, pending, inside, seen))
        await inside.wait()
        pending[-1].set_result("answer")  # the inner call ends in the same turn as the cancel
        cancel_until_done(task, lambda: False, every_s=0.05)
        done, _ = await asyncio.wait({task}, timeout=3)
        if not done:
            task.cancel()
            for fut in pending:
                if not fut.done():
                    fut.set_result("late")
            await asyncio.wait({task}, timeout=1)
        return bool(done), seen

    ended, seen = asyncio.run(main())
    assert ended, "the view outlived its cancel"
    # The first cancel was lost (the answer came back instead), the second one ended the loop.
    assert seen[0] == "answer" and seen[-1] == "cancelled"


def test_no_cancel_once_the_handler_has_finished():
    from adapters.django import cancel_until_done

    async def main() -> list[str]:
        finished = {"v": False}
        steps: list[str] = []

        async def view() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                steps.append("cancelled")
            finished["v"] = True
            await asyncio.sleep(0.2)  # after the handler's end: nothing may cancel this
            steps.append("after")

        task = asyncio.ensure_future(view())
        await asyncio.sleep(0)
        cancel_until_done(task, lambda: finished["v"], every_s=0.02)
        await asyncio.wait_for(task, 3)
        return steps

    assert asyncio.run(main()) == ["cancelled", "after"]


def test_header_reads_what_request_headers_gives():
    from django.core.handlers.asgi import ASGIRequest

    from gateway.web.views import _header

    scope = {**_scope("/v1/chat/completions", [
        (b"authorization", b"Bearer sk-abc"), (b"content-length", b"12"), (b"idempotency-key", b"k1"),
        (b"x-session-id", b"s1"), (b"x-session-id", b"s2")]), "method": "POST"}
    request = ASGIRequest(scope, None)
    for meta_name, name in (("HTTP_AUTHORIZATION", "Authorization"), ("CONTENT_LENGTH", "Content-Length"),
                            ("HTTP_IDEMPOTENCY_KEY", "Idempotency-Key"), ("HTTP_X_SESSION_ID", "X-Session-Id"),
                            ("HTTP_X_MISSING", "X-Missing")):
        assert _header(request, meta_name) == request.headers.get(name, ""), name
    assert _header(request, "HTTP_X_SESSION_ID") == "s1,s2"
