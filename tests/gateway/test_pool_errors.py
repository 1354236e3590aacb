"""The worker's exception for a pool's error answer (gateway/worker/pool_errors.py)
is the one the openai SDK's own ``chat.completions.create`` raises for the same
answer: same class, status, body, message and headers, on both of the worker's
paths (http.client and httpx). The simulator gives the statuses it knows; a
stand-in pool answers the others (401, 403, 409, 422, a status the SDK has no
class for, bodies that are not the usual JSON). An SDK upgrade that words or
maps its errors otherwise fails here."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from gateway.worker import pool_client as pc
from tests.gateway.test_pool_client import BODY, _sim, fresh_clients  # noqa: F401 - autouse: fresh clients per test


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory) -> Iterator[str]:
    yield from _sim(tmp_path_factory, "sim-pool-errors")


class _StandIn(BaseHTTPRequestHandler):
    """Answers what the request's ``answer`` field says: status, headers, raw body."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        answer = request["answer"]
        content = answer["body"].encode()
        self.send_response(answer["status"])
        for name, value in {"content-type": "application/json", **answer.get("headers", {})}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def stand_in_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _seen(exc: openai.APIStatusError) -> dict:
    return {"class": type(exc), "status": exc.status_code, "message": exc.message, "str": str(exc), "body": exc.body,
            "code": exc.code, "type": exc.type, "param": exc.param, "request_id": exc.request_id,
            "retry-after": exc.response.headers.get("retry-after"),
            "x-ratelimit-remaining-tokens": exc.response.headers.get("x-ratelimit-remaining-tokens")}


def _raised_three_ways(url: str, extra: dict, *, model: str = "sim-small") -> list[dict]:
    """What the SDK's create raises, then the worker's plain path, then its httpx path."""
    client = pc.pool_client(base_url=url, api_key_env="")
    body = {**BODY, "model": model, **extra}
    seen = []
    with pytest.raises(openai.APIStatusError) as sdk:
        client.chat.completions.create(**{k: v for k, v in body.items() if k not in extra}, extra_body=extra)
    seen.append(_seen(sdk.value))
    for plain in (True, False):
        if not plain:
            pc._plain[str(client.base_url)] = None  # this client's calls now keep httpx
        with pytest.raises(openai.APIStatusError) as ours:
            pc.pool_post(client, body=body)
        seen.append(_seen(ours.value))
    return seen


@pytest.mark.parametrize("extra, model, expected", [
    ({"sim": {"fail_status": 429, "fail_retry_after": 2}}, "sim-small", openai.RateLimitError),
    ({"sim": {"fail_status": 500}}, "sim-small", openai.InternalServerError),
    ({"sim": {"fail_status": 502}}, "sim-small", openai.InternalServerError),
    ({"sim": {"fail_status": 503, "fail_retry_after": 1}}, "sim-small", openai.InternalServerError),
    ({"sim": {"fail_status": 418}}, "sim-small", openai.BadRequestError),  # not a status it injects: 400
    ({}, "no-such-model", openai.NotFoundError),
])
def test_the_simulators_error_answers_raise_what_the_sdk_raises(sim_url, extra, model, expected):
    sdk, plain, via_httpx = _raised_three_ways(sim_url, extra, model=model)
    assert sdk["class"] is expected
    assert plain == via_httpx == sdk


def _error(message: object) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "x", "code": "c"}})


@pytest.mark.parametrize("status, body, expected", [
    (400, _error("bad"), openai.BadRequestError),
    (401, _error("no key"), openai.AuthenticationError),
    (403, _error("not yours"), openai.PermissionDeniedError),
    (404, _error("nothing here"), openai.NotFoundError),
    (409, _error("conflict"), openai.ConflictError),
    (422, _error("unprocessable"), openai.UnprocessableEntityError),
    (429, _error("slow down"), openai.RateLimitError),
    (418, _error("a teapot"), openai.APIStatusError),  # no class of its own
    (504, _error("timed out"), openai.InternalServerError),
    (500, _error(""), openai.InternalServerError),  # an empty message: the code alone
    (500, _error(7), openai.InternalServerError),  # a message that is not text
    (500, json.dumps({"detail": "no error object"}), openai.InternalServerError),
    (500, json.dumps(["a", "list"]), openai.InternalServerError),
    (502, "  <html>Bad gateway</html>\n", openai.InternalServerError),  # not JSON: the text, stripped
    (503, "", openai.InternalServerError),
])
def test_every_status_the_sdk_tells_apart_raises_what_the_sdk_raises(stand_in_url, status, body, expected):
    answer = {"status": status, "body": body,
              "headers": {"retry-after": "3", "x-ratelimit-remaining-tokens": "12", "x-request-id": "req-1"}}
    sdk, plain, via_httpx = _raised_three_ways(stand_in_url, {"answer": answer})
    assert sdk["class"] is expected and sdk["status"] == status and sdk["retry-after"] == "3"
    assert plain == via_httpx == sdk
