"""The pool, reached with the official openai SDK. Its own retries are off:
the gateway decides about retries (a retry the SDK makes on its own is load
the admission step never saw).

A non-streamed call goes through ``pool_chat_post``: the SDK client's own
httpx client (its connection pool, timeout and event hooks) without the
SDK's request building, which cost about as much worker CPU as everything
else in the call (bench/pool_client_overhead.py, bench/PROFILE.md). Its
failures are the SDK's exceptions, made by the SDK: an error status raises
what ``client.chat.completions.create`` would (RateLimitError,
InternalServerError, ...: ``_make_status_error_from_response``), a timeout
APITimeoutError, any other transport failure APIConnectionError. A stream
opens the same way (``pool_chat_stream_open``: the answer's headers, its
events read by gateway/worker/streaming.py), so a stream's time to first
token no longer carries the SDK's request building either."""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from collections.abc import Callable

import httpx
from django.conf import settings
from openai import APIConnectionError, APITimeoutError, OpenAI

from budgets.admission.provider_limits import provider_limits_record

logger = logging.getLogger(__name__)

_clients: dict[tuple[str, str, int], OpenAI] = {}
_lock = threading.Lock()
_sent = threading.local()


def _count_sent(request: httpx.Request) -> None:
    # httpx calls this once the request is built (its body encoded) and is
    # about to go on the wire: a failure before it never reached the pool.
    _sent.count = getattr(_sent, "count", 0) + 1


def pool_requests_sent() -> int:
    """Requests this thread has sent to any pool so far. Compared before and
    after a failure: did the failed call reach the pool?"""
    return getattr(_sent, "count", 0)


def pool_api_key(*, api_key_env: str) -> str:
    """A pool's API key lives in the variable its InferencePool.api_key_env
    names (a secret never stored in the database)."""
    return os.environ.get(api_key_env, "") if api_key_env else ""


def _limits_reader(pool_id: int) -> Callable[[httpx.Response], None]:
    """An httpx response hook: every answer of the pool, errors included,
    tells the pool's admission what the provider's x-ratelimit-* headers say
    (budgets/admission/provider_limits.py). It runs when the headers arrive;
    a failure to record them never fails the call."""
    def read(response: httpx.Response) -> None:
        try:
            provider_limits_record(pool_id=pool_id, headers=response.headers)
        except Exception:  # noqa: BLE001 - the answer matters more than the bookkeeping
            logger.warning("pool %s: could not record its rate-limit headers", pool_id, exc_info=True)
    return read


def pool_client(*, base_url: str, api_key_env: str, pool_id: int = 0) -> OpenAI:
    """The SDK client of one pool (``pool_id`` 0: none, no headers recorded)."""
    api_key = pool_api_key(api_key_env=api_key_env)
    cache_key = (base_url, api_key_env, pool_id)
    client = _clients.get(cache_key)
    if client is None:
        with _lock:
            client = _clients.get(cache_key)
            if client is None:
                client = OpenAI(
                    base_url=base_url,
                    api_key=api_key or "sluice-no-key",
                    max_retries=0,
                    timeout=httpx.Timeout(settings.SLUICE_UPSTREAM_TIMEOUT_S, connect=5.0),
                    http_client=httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                                             event_hooks={"request": [_count_sent],
                                                          "response": [_limits_reader(pool_id)] if pool_id else []}),
                )
                _clients[cache_key] = client
    return client


def _json_bytes(body: dict) -> bytes:
    # As the SDK encodes a body (openai._utils._json.openapi_dumps, httpx's
    # defaults): UTF-8, compact; what it cannot encode (a lone surrogate, a
    # NaN) raises here, before anything is sent, as it did in the SDK.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _chat_request(client: OpenAI, *, body: dict, accept: str) -> httpx.Request:
    return client._client.build_request(
        "POST", f"{client.base_url}chat/completions", content=_json_bytes(body),
        headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json", "Accept": accept},
        timeout=client.timeout)


def _chat_send(client: OpenAI, request: httpx.Request, *, stream: bool) -> httpx.Response:
    """Send on ``client``'s httpx client; the answer (status < 400), or the
    SDK's exception (an error answer read first: its body is the error's)."""
    try:
        response = client._client.send(request, stream=stream)
    except httpx.TimeoutException as exc:
        raise APITimeoutError(request=request) from exc
    except (httpx.RequestError, ssl.SSLError) as exc:
        raise APIConnectionError(request=request) from exc
    if response.status_code >= 400:
        if stream:
            try:
                response.read()
            except httpx.HTTPError:
                pass  # the status says enough
            finally:
                response.close()
        raise client._make_status_error_from_response(response)
    return response


def pool_chat_post(client: OpenAI, *, body: dict) -> httpx.Response:
    """POST ``body`` to the pool's chat/completions with ``client``'s httpx
    client; the answer (status < 400, read), or the SDK's exception."""
    return _chat_send(client, _chat_request(client, body=body, accept="application/json"), stream=False)


def pool_chat_stream_open(client: OpenAI, *, body: dict) -> httpx.Response:
    """Open a streamed chat completion (``body`` asks for ``stream``): the
    answer once its headers came (status < 400, its events still to read;
    the caller closes it), or the SDK's exception, as ``pool_chat_post``."""
    return _chat_send(client, _chat_request(client, body=body, accept="text/event-stream"), stream=True)
