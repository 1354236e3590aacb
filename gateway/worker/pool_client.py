"""The pool, reached with the official openai SDK. Its own retries are off:
the gateway decides about retries (a retry the SDK makes on its own is load
the admission step never saw).

A non-streamed call (chat, legacy completions, embeddings: the path is the
endpoint's) goes through ``pool_post``: the httpx client this
module hands the SDK client (its connection pool, timeout and event hooks),
without the SDK's request building, which costs about as much worker CPU as
everything else in the call (bench/pool_client_overhead.py). Its failures
are the SDK's exceptions: an error status raises what
``client.chat.completions.create`` would (RateLimitError,
InternalServerError, ...: ``pool_status_error``), a timeout APITimeoutError,
any other transport failure APIConnectionError. A stream opens the same way
(``pool_stream_open``: the answer's headers, its events read by
gateway/worker/streaming.py), so a stream's time to first token does not
carry the SDK's request building either.

To a plain ``http://`` pool that no proxy setting covers (a vLLM server
beside the gateway, the simulator), the POST goes out on the standard
library's ``http.client`` over kept-alive connections instead of httpx: a
fraction of httpx's CPU per call (bench/pool_client_overhead.py), the same
bytes on the wire, the same results and the same SDK exceptions
(``tests/gateway/test_pool_client.py`` holds the two side by side). A
stream to such a pool opens the same way (``PlainStream``: its lines read as
they come, a close that closes the connection unless the answer was read to
its end). Its sockets are the ones a stopping worker cuts at the end of its
grace (gateway/worker/shutdown.py), so such a call needs no thread of its
own. ``https://`` pools and proxied ones keep httpx, whose TLS and proxy
handling they need; ``SLUICE_POOL_PLAIN_HTTP=false`` turns the plain path
off."""

from __future__ import annotations

import functools
import http.client
import json
import logging
import os
import select
import socket
import ssl
import threading
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from openai import APIConnectionError, APITimeoutError, OpenAI

from budgets.admission.provider_limits import SentMark, provider_limits_record
from gateway.core.request.endpoints import CHAT_COMPLETIONS, pool_path
from gateway.worker.pool_errors import pool_status_error
from gateway.worker.shutdown import CallInterrupted, call_socket_watched

logger = logging.getLogger(__name__)

_clients: dict[tuple[str, str, int], OpenAI] = {}
# The httpx client each SDK client was handed (the SDK keeps it under a
# private name): the calls below send on it themselves.
_http_clients: weakref.WeakKeyDictionary[OpenAI, httpx.Client] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_sent = threading.local()


def _count_sent(request: httpx.Request | None) -> None:
    # httpx calls this once the request is built (its body encoded) and is
    # about to go on the wire (the plain path once it is connected): a
    # failure before it never reached the pool.
    _sent.count = getattr(_sent, "count", 0) + 1


def pool_requests_sent() -> int:
    """Requests this thread has sent to any pool so far. Compared before and
    after a failure: did the failed call reach the pool?"""
    return getattr(_sent, "count", 0)


def pool_api_key(*, api_key_env: str) -> str:
    """A pool's API key lives in the variable its InferencePool.api_key_env
    names (a secret never stored in the database)."""
    return os.environ.get(api_key_env, "") if api_key_env else ""


def _limits_note(pool_id: int, headers: Mapping[str, str], mark: SentMark | None, status: int) -> None:
    """Every answer of the pool, errors included, tells the pool's admission
    what the provider's x-ratelimit-* headers say
    (budgets/admission/provider_limits.py), in the order the calls went
    (``mark``: the call's, from its take; gateway/worker/lane_slot.py), and
    a refusal (``status`` 429) its Retry-After; a failure to record them
    never fails the call."""
    try:
        provider_limits_record(pool_id=pool_id, headers=headers, mark=mark, status=status)
    except Exception:  # noqa: BLE001 - the answer matters more than the bookkeeping
        logger.warning("pool %s: could not record its rate-limit headers", pool_id, exc_info=True)


def _limits_reader(pool_id: int) -> Callable[[httpx.Response], None]:
    """``_limits_note`` as an httpx response hook: it runs when the headers
    arrive (the call's mark rides in its request's extensions)."""
    return lambda response: _limits_note(pool_id, response.headers, response.request.extensions.get(_MARK),
                                         response.status_code)


@functools.cache
def pool_tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CAs, or SSL_CERT_FILE/DIR),
    made once per process and shared by every pool client and the prober's
    rounds. A client made without one parses the whole CA bundle again, for
    a plain http:// pool too (httpx builds its context eagerly), while every
    lane thread of the process waits for that client behind ``_lock``."""
    return httpx.create_ssl_context()


def pool_clients_warm() -> None:
    """Build at a worker's start what its first pool call would otherwise
    build while its lane threads wait: the TLS context, and httpx's
    transport (whose first build imports its connection pool's module)."""
    httpx.HTTPTransport(verify=pool_tls_context()).close()


def pool_client(*, base_url: str, api_key_env: str, pool_id: int = 0) -> OpenAI:
    """The SDK client of one pool (``pool_id`` 0: none, no headers recorded);
    the calls below take only a client made here."""
    api_key = pool_api_key(api_key_env=api_key_env)
    cache_key = (base_url, api_key_env, pool_id)
    client = _clients.get(cache_key)
    if client is None:
        with _lock:
            client = _clients.get(cache_key)
            if client is None:
                http_client = httpx.Client(
                    verify=pool_tls_context(),
                    limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                    event_hooks={"request": [_count_sent], "response": [_limits_reader(pool_id)] if pool_id else []})
                client = OpenAI(
                    base_url=base_url,
                    api_key=api_key or "sluice-no-key",
                    max_retries=0,
                    timeout=httpx.Timeout(settings.SLUICE_UPSTREAM_TIMEOUT_S, connect=5.0),
                    http_client=http_client,
                )
                _http_clients[client] = http_client
                _clients[cache_key] = client
    return client


def _json_bytes(body: dict) -> bytes:
    # As the SDK encodes a request body (its JSON helper with httpx's
    # defaults): UTF-8, compact; what it cannot encode (a lone surrogate, a
    # NaN) raises here, before anything is sent, as it did in the SDK.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _pool_url(client: OpenAI, path: str) -> str:
    return f"{client.base_url}{path}"


def _chat_headers(client: OpenAI, *, accept: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json", "Accept": accept}


_MARK = "sluice_sent_mark"
CHAT_PATH = pool_path(CHAT_COMPLETIONS)


def _chat_request(client: OpenAI, *, path: str, body: dict, accept: str, mark: SentMark | None = None) -> httpx.Request:
    return _http_clients[client].build_request("POST", _pool_url(client, path), content=_json_bytes(body),
                                               headers=_chat_headers(client, accept=accept), timeout=client.timeout,
                                               extensions={_MARK: mark})


def _chat_send(client: OpenAI, request: httpx.Request, *, stream: bool) -> httpx.Response:
    """Send on ``client``'s httpx client; the answer (status < 400), or the
    SDK's exception (an error answer read first: its body is the error's)."""
    try:
        response = _http_clients[client].send(request, stream=stream)
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
        raise pool_status_error(response)
    return response


@dataclass(frozen=True)
class PoolAnswer:
    """A pool's answer on the plain path: what the worker reads of it."""

    status_code: int
    headers: Mapping[str, str]  # http.client's message: names case-insensitive
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


PLAIN_IDLE_MAX = 64  # kept-alive connections per pool host, as httpx's max_keepalive_connections


class _PlainConnections:
    """Kept-alive ``http.client`` connections to one pool host, last used
    first. An idle connection with something to read has been closed by the
    server (or is out of step): it is dropped, never reused."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> http.client.HTTPConnection | None:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if _still_open(conn):
                    return conn
                conn.close()
        return None

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < PLAIN_IDLE_MAX:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _still_open(conn: http.client.HTTPConnection) -> bool:
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


_plain: dict[str, _PlainConnections | None] = {}  # by the pool's base URL


def _plain_connections(client: OpenAI) -> _PlainConnections | None:
    """The plain path's connections to this client's pool, or None when
    its calls keep httpx: an https:// pool, one a proxy setting covers
    (HTTP_PROXY, ALL_PROXY, NO_PROXY: as httpx reads them), or the setting off."""
    base = str(client.base_url)
    if base in _plain:
        return _plain[base]
    connections = None
    parts = urlsplit(base)
    if settings.SLUICE_POOL_PLAIN_HTTP and parts.scheme == "http" and parts.hostname:
        proxies = urllib.request.getproxies_environment()
        proxied = ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass_environment(
            parts.hostname, proxies)
        if not proxied:
            connections = _PlainConnections(parts.hostname, parts.port or 80)
    with _lock:
        _plain[base] = connections
    return connections


def _plain_send(client: OpenAI, connections: _PlainConnections, *, path: str, body: dict, accept: str,
                read_all: bool) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, bytes | None]:
    """The plain path's POST on one kept-alive connection, cut by a stopping
    worker's grace (``call_socket_watched``): the connection, the answer
    with its headers read, and its body when ``read_all`` or its status is
    an error's (None otherwise: a stream, read later). A failure closes the
    connection and raises the SDK's exception, as ``_chat_send`` does."""
    url = _pool_url(client, path)
    content = _json_bytes(body)
    headers = _chat_headers(client, accept=accept)
    timeout = client.timeout if isinstance(client.timeout, httpx.Timeout) else httpx.Timeout(client.timeout)
    conn = connections.take()
    try:
        if conn is None:
            conn = http.client.HTTPConnection(connections.host, connections.port, timeout=timeout.connect)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sock.settimeout(timeout.read)
        with call_socket_watched(conn.sock):
            _count_sent(None)
            conn.request("POST", urlsplit(url).path, body=content, headers=headers)
            response = conn.getresponse()
            read = response.read() if read_all or response.status >= 400 else None
    except CallInterrupted:
        if conn is not None:
            conn.close()
        raise
    except TimeoutError as exc:
        if conn is not None:
            conn.close()
        raise APITimeoutError(request=httpx.Request("POST", url)) from exc
    except (OSError, http.client.HTTPException) as exc:
        if conn is not None:
            conn.close()
        raise APIConnectionError(request=httpx.Request("POST", url)) from exc
    return conn, response, read


def _plain_status_error(client: OpenAI, path: str, response: http.client.HTTPResponse, content: bytes) -> Exception:
    """The SDK's exception for an error answer on the plain path."""
    return pool_status_error(httpx.Response(
        response.status, headers=response.getheaders(), content=content,
        request=httpx.Request("POST", _pool_url(client, path))))


def _plain_post(client: OpenAI, connections: _PlainConnections, *, path: str, body: dict, pool_id: int,
                mark: SentMark | None) -> PoolAnswer:
    """The plain path's POST: one kept-alive connection, the SDK's exceptions
    as ``_chat_send`` raises them."""
    conn, response, content = _plain_send(client, connections, path=path, body=body, accept="application/json",
                                          read_all=True)
    answer = PoolAnswer(status_code=response.status, headers=response.headers, content=content)
    if response.will_close:
        conn.close()
    else:
        connections.give_back(conn)
    if pool_id:
        _limits_note(pool_id, answer.headers, mark, answer.status_code)
    if answer.status_code >= 400:
        raise _plain_status_error(client, path, response, answer.content)
    return answer


def pool_call_inline(client: OpenAI) -> bool:
    """Whether this client's calls go out on the plain path: on sockets the
    worker's stop can cut (gateway/worker/shutdown.py), so they need no
    thread of their own to be cut off at the end of the grace."""
    return _plain_connections(client) is not None


def pool_post(client: OpenAI, *, body: dict, pool_id: int = 0, mark: SentMark | None = None,
              path: str = CHAT_PATH) -> httpx.Response | PoolAnswer:
    """POST ``body`` to the pool's ``path`` (chat/completions, completions,
    embeddings: gateway/core/request/endpoints.py); the answer (status < 400,
    read: its ``text``), or the SDK's exception. On the plain path when the
    pool allows it (above), else with ``client``'s httpx client. ``mark``:
    the call's, from its take (for the answer's x-ratelimit-* statement)."""
    connections = _plain_connections(client)
    if connections is not None:
        return _plain_post(client, connections, path=path, body=body, pool_id=pool_id, mark=mark)
    return _chat_send(client, _chat_request(client, path=path, body=body, accept="application/json", mark=mark),
                      stream=False)


READ_BYTES = 1 << 16  # at most this much of a stream per read: what came since the last read, usually


class SseLines:
    """Server-sent events' lines (decoded, without their ends: LF, CRLF or a
    bare CR, as SSE allows) from a body's reads: ``feed`` gives the lines a
    read completed (a line cut between two reads goes with the second),
    ``end`` what is left when the body ends."""

    __slots__ = ("tail",)

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, raw: bytes) -> list[str] | None:
        data = self.tail + raw if self.tail else raw
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self.tail = data
            return None
        self.tail = data[cut + 1:]
        text = data[:cut].decode("utf-8", errors="replace")
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        return text.split("\n")

    def end(self) -> list[str] | None:
        tail, self.tail = self.tail, b""
        return [tail.decode("utf-8", errors="replace")] if tail else None


def sse_line_batches(reads: Iterable[bytes]) -> Iterator[list[str]]:
    """``SseLines`` over ``reads``: a list of lines per read of the socket."""
    lines = SseLines()
    for raw in reads:
        batch = lines.feed(raw)
        if batch is not None:
            yield batch
    batch = lines.end()
    if batch is not None:
        yield batch


def stream_line_batches(response: httpx.Response | PlainStream) -> Iterator[list[str]]:
    """A streamed answer's lines, a list per batch that came together, on
    either path (httpx's errors either way)."""
    if isinstance(response, PlainStream):
        return response.iter_batches()
    return sse_line_batches(response.iter_bytes())


class PlainStream:
    """A streamed answer on the plain path, as the worker reads one
    (gateway/worker/streaming.py: ``headers``, ``iter_batches``, ``close``).
    A failure while reading is httpx's exception for it (``ReadTimeout``,
    ``ReadError``), as on the httpx path. ``close`` ends the call: the
    connection is closed, so the pool stops generating, unless the answer
    was read to its end; after ``data: [DONE]`` the end of the body is
    usually already here, and is read (briefly) to keep the connection."""

    DRAIN_S = 0.05  # how long close() waits for the end of a body whose [DONE] came
    DRAIN_BYTES = 1 << 16

    def __init__(self, conn: http.client.HTTPConnection, connections: _PlainConnections,
                 response: http.client.HTTPResponse, url: str) -> None:
        self._conn, self._connections, self._response, self._url = conn, connections, response, url
        self.status_code = response.status
        self.headers = response.headers
        self._done = False
        self._closed = False
        self._handed = False  # read by the stream hub, not by ``response``
        self._timeout: float | None = None

    @property
    def url(self) -> str:
        return self._url

    def hub_ready(self) -> bool:
        """Whether the stream hub can read this answer: on a kept-alive
        connection (an answer that ends with its connection's close holds
        the socket in the response alone: read on the call's thread)."""
        return self._conn.sock is not None and not self._response.will_close

    def hand_over(self) -> tuple[socket.socket, bytes, bool, int | None, float | None]:
        """For the stream hub (gateway/worker/stream_hub.py), which reads the
        body from the socket itself: the socket, now non-blocking; the
        body's bytes already read with the headers; whether the body is
        chunked; its length when sized; the call's read timeout."""
        self._handed = True
        sock = self._conn.sock
        self._timeout = sock.gettimeout()
        sock.setblocking(False)
        fp = self._response.fp
        # What the header read buffered past the headers (on a socket with
        # nothing more, a non-blocking read gives nothing).
        head = fp.read1(READ_BYTES) if fp is not None else b""
        return sock, head or b"", bool(self._response.chunked), self._response.length, self._timeout

    def take_back(self, *, complete: bool) -> None:
        """The hub is done with the socket: its timeout back, and with the
        body read to its end (``complete``) the connection is kept by ``close``."""
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.settimeout(self._timeout)
            except OSError:
                pass
        if complete:
            self._done = True
            self._response.close()  # read through: the connection is free for its next request

    def iter_batches(self) -> Iterator[list[str]]:
        """The body's lines, without their ends, a list per read: the lines
        that came together (one batch of tokens the pool sent at once is
        one list), each list as soon as it came."""
        response = self._response
        try:
            for lines in sse_line_batches(iter(lambda: response.read1(READ_BYTES), b"")):
                if "data: [DONE]" in lines:
                    self._done = True
                yield lines
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "the pool's stream timed out",
                                    request=httpx.Request("POST", self._url)) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=httpx.Request("POST", self._url)) from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        response, conn = self._response, self._conn
        if self._done and not self._handed and not response.isclosed() and conn.sock is not None:
            try:
                conn.sock.settimeout(self.DRAIN_S)
                response.read(self.DRAIN_BYTES)
            except (OSError, ValueError, http.client.HTTPException):
                pass
        if response.isclosed() and not response.will_close and conn.sock is not None:
            self._connections.give_back(conn)
        else:
            response.close()
            conn.close()


def _plain_stream_open(client: OpenAI, connections: _PlainConnections, *, path: str, body: dict, pool_id: int,
                       mark: SentMark | None) -> PlainStream:
    """The plain path's streamed POST: the answer once its headers came, or
    the SDK's exception, as ``_plain_post`` raises it."""
    conn, response, error_body = _plain_send(client, connections, path=path, body=body, accept="text/event-stream",
                                             read_all=False)
    if pool_id:
        _limits_note(pool_id, response.headers, mark, response.status)
    if response.status >= 400:
        conn.close()
        raise _plain_status_error(client, path, response, error_body)
    return PlainStream(conn, connections, response, _pool_url(client, path))


def pool_stream_open(client: OpenAI, *, body: dict, pool_id: int = 0, mark: SentMark | None = None,
                     path: str = CHAT_PATH) -> httpx.Response | PlainStream:
    """Open a streamed completion (chat or legacy: ``path``; ``body`` asks
    for ``stream``): the answer once its headers came (status < 400, its
    events still to read: ``stream_line_batches``; the caller closes it), or
    the SDK's exception, as ``pool_post``; on the plain path when the pool
    allows it."""
    connections = _plain_connections(client)
    if connections is not None:
        return _plain_stream_open(client, connections, path=path, body=body, pool_id=pool_id, mark=mark)
    return _chat_send(client, _chat_request(client, path=path, body=body, accept="text/event-stream", mark=mark),
                      stream=True)
