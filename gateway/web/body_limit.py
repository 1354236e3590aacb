"""The body's size limit on /v1 and /api, before Django: an ASGI wrapper that
refuses a body over SLUICE_MAX_BODY_BYTES with a 413 (OpenAI's shape on /v1,
DRF's on /api: llm_platform/api_input.py) before anything
stores or parses it (Django's ASGI handler would spool any chunked body,
however large, to a temporary file first), counting what arrives, not what
Content-Length says."""

from __future__ import annotations

import json
from collections.abc import Callable

from django.conf import settings

from gateway.core.errors import error_body


def too_large_message(limit: int) -> str:
    return f"The request body exceeds {limit} bytes."


def too_large_body(limit: int) -> dict:
    return error_body(message=too_large_message(limit), error_type="invalid_request_error", code="body_too_large")


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def body_limit(app, *, refusal: Callable[[int], dict] = too_large_body):
    """Read the whole body, at most SLUICE_MAX_BODY_BYTES of it, then hand it
    to ``app`` as one message; over the limit, answer 413 with
    ``refusal(limit)`` and stop reading."""

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        limit = settings.SLUICE_MAX_BODY_BYTES
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            return await _send_json(send, 413, refusal(limit))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the caller left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _send_json(send, 413, refusal(limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect Django listens for

        return await app(scope, replay, send)

    return limited


# Room for the multipart envelope (boundaries, part headers, the purpose field) around the file.
MULTIPART_ROOM = 64 * 1024


def body_limit_streamed(app, *, limit: Callable[[], int]):
    """For uploads (POST /v1/files): the body goes to ``app`` as it arrives
    (Django spools it to a temporary file past FILE_UPLOAD_MAX_MEMORY_SIZE),
    counted on the way; past ``limit()`` the read stops and the caller gets
    a 413. Nothing holds the whole body in memory."""

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        most = limit()
        declared = _declared_length(scope)
        if declared is not None and declared > most:
            return await _send_json(send, 413, too_large_body(most))
        size = 0
        over = False
        started = False

        async def counted():
            nonlocal size, over
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > most:
                    over = True
                    return {"type": "http.disconnect"}  # Django stops reading and answers nothing
            return message

        async def watched_send(message):
            nonlocal started
            started = True
            await send(message)

        await app(scope, counted, watched_send)
        if over and not started:
            await _send_json(send, 413, too_large_body(most))

    return limited
