"""Static files (the API docs' assets) are served by WhiteNoise's own
middleware on the full Django stack, straight from the installed packages
(no collectstatic), before sessions or the database are touched."""

from __future__ import annotations

import asyncio

from llm_platform.asgi import application
from tests.asgi_calls import asgi_call, get_scope

ASSET = "/static/drf_spectacular_sidecar/swagger-ui-dist/favicon-32x32.png"


def _get(path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    sent = asyncio.run(asgi_call(application, get_scope(path)))
    return sent[0]["status"], {k.lower(): v for k, v in sent[0]["headers"]}, b"".join(m.get("body", b"") for m in sent[1:])


def test_a_packaged_asset_is_served_without_collectstatic():
    status, headers, body = _get(ASSET)
    assert status == 200
    assert headers[b"content-type"] == b"image/png"
    assert body.startswith(b"\x89PNG")


def test_an_unknown_asset_falls_through_to_django():
    status, _, _ = _get("/static/no-such-asset.css")
    assert status == 404
