"""POST /v1/files's body: streamed to Django as it arrives, never joined in
memory, and cut off with a 413 past the file limit, whether or not the
client declared its length."""

from __future__ import annotations

import asyncio
import json

from gateway.web.body_limit import body_limit_streamed


def _upload_scope(length: int | None) -> dict:
    headers = [(b"host", b"testserver"), (b"content-type", b"multipart/form-data; boundary=x")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "method": "POST", "path": "/v1/files", "headers": headers}


def _run(scope, chunks: list[bytes]) -> tuple[list[dict], list[dict]]:
    """(what the app received, what the caller was sent)."""
    received: list[dict] = []
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app_reading(scope_, receive_, send_):
        while True:
            message = await receive_()
            received.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        if received[-1]["type"] != "http.disconnect":
            await send_({"type": "http.response.start", "status": 200, "headers": []})
            await send_({"type": "http.response.body", "body": b"stored"})

    asyncio.run(body_limit_streamed(app_reading, limit=lambda: 1000)(scope, receive, send))
    return received, sent


def test_a_body_within_the_limit_reaches_the_app_chunk_by_chunk():
    received, sent = _run(_upload_scope(None), [b"a" * 400, b"b" * 400, b"c" * 200])
    assert [len(m["body"]) for m in received] == [400, 400, 200]  # passed on as it came, not joined
    assert sent[0]["status"] == 200


def test_a_body_past_the_limit_without_a_length_is_cut_off_with_a_413():
    received, sent = _run(_upload_scope(None), [b"a" * 600, b"b" * 600, b"c" * 600])
    assert received[-1]["type"] == "http.disconnect"  # the app stopped reading at the limit
    assert len(received) == 2
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"


def test_a_declared_length_past_the_limit_is_refused_before_reading():
    received, sent = _run(_upload_scope(5000), [b"a" * 10])
    assert received == []
    assert sent[0]["status"] == 413
