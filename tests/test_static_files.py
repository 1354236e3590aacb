"""Static files (the API docs' assets) are served by WhiteNoise's own
middleware on the full Django stack, straight from the installed packages
(no collectstatic), before sessions or the database are touched."""

from __future__ import annotations

import asyncio

from llm_platform.asgi import application

ASSET = "/static/drf_spectacular_sidecar/swagger-ui-dist/favicon-32x32.png"


def _get(path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(application(scope, receive, send))
    return sent[0]["status"], {k.lower(): v for k, v in sent[0]["headers"]}, b"".join(m.get("body", b"") for m in sent[1:])


def test_a_packaged_asset_is_served_without_collectstatic():
    status, headers, body = _get(ASSET)
    assert status == 200
    assert headers[b"content-type"] == b"image/png"
    assert body.startswith(b"\x89PNG")


def test_an_unknown_asset_falls_through_to_django():
    status, _, _ = _get("/static/no-such-asset.css")
    assert status == 404
