"""The worker's non-streamed pool call on its two paths (gateway/worker/pool_client.py):
the plain ``http.client`` path a plain http:// pool gets, beside the SDK client's
httpx path, against the simulator over HTTP: the same answers, the same SDK
exceptions, kept-alive connections reused and a closed one never, and the
cases that keep httpx (https://, a proxy, the setting off)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from budgets.admission.provider_limits import REFUSAL_HOLD_MAX_MS, duration_ms
from gateway.worker import pool_client as pc
from llm_platform.processes import Process, free_port, sim_command, wait_http

BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def _sim(tmp_path_factory, name: str, *, tpm: int | None = None) -> Iterator[str]:
    """A zero-latency simulator's /v1 URL for a module's tests; with ``tpm``
    it states its limits (x-ratelimit-* on every answer): ``tpm`` tokens and
    1,000 requests a minute."""
    import os

    port = free_port()
    limits = ["--tpm", str(tpm), "--rpm", "1000"] if tpm is not None else []
    sim = Process(name, sim_command(port=port, extra=["--zero-latency", "--seed", "3", *limits]), dict(os.environ),
                  tmp_path_factory.mktemp(name)).start()
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", sim)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory) -> Iterator[str]:
    yield from _sim(tmp_path_factory, "sim-pool-client")


@pytest.fixture(autouse=True)
def fresh_clients(settings):
    settings.SLUICE_POOL_PLAIN_HTTP = True
    pc._clients.clear()
    pc._plain.clear()
    yield
    for connections in pc._plain.values():
        if connections is not None:
            connections.close()
    pc._plain.clear()
    pc._clients.clear()


def _both(url: str, **kwargs):
    """The same pool's client on the plain path and on httpx (the setting off for the second)."""
    client = pc.pool_client(base_url=url, api_key_env="")
    plain = pc.pool_post(client, body=kwargs.get("body", BODY))
    pc._plain[str(client.base_url)] = None  # this client's calls now keep httpx
    via_httpx = pc.pool_post(client, body=kwargs.get("body", BODY))
    return plain, via_httpx


def test_a_plain_http_pool_answers_the_same_on_both_paths(sim_url):
    plain, via_httpx = _both(sim_url)
    assert isinstance(plain, pc.PoolAnswer) and not isinstance(via_httpx, pc.PoolAnswer)
    a, b = json.loads(plain.text), json.loads(via_httpx.text)
    assert (plain.status_code, a["object"], a["model"]) == (via_httpx.status_code, b["object"], b["model"]) \
        == (200, "chat.completion", "sim-small")
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 8
    assert plain.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("status, exception", [(429, openai.RateLimitError), (503, openai.InternalServerError),
                                               (500, openai.InternalServerError)])
def test_an_error_answer_raises_the_same_sdk_exception_on_both_paths(sim_url, status, exception):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    body = {**BODY, "sim": {"fail_status": status, "fail_retry_after": 2}}
    with pytest.raises(exception) as plain:
        pc.pool_post(client, body=body)
    pc._plain[str(client.base_url)] = None
    with pytest.raises(exception) as via_httpx:
        pc.pool_post(client, body=body)
    assert plain.value.status_code == via_httpx.value.status_code == status
    assert plain.value.response.headers.get("retry-after") == via_httpx.value.response.headers.get("retry-after")
    assert plain.value.body == via_httpx.value.body


def test_calls_reuse_one_kept_alive_connection(sim_url):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    pc.pool_post(client, body=BODY)
    connections = pc._plain[str(client.base_url)]
    first = connections._idle[-1]
    first_socket = first.sock
    for _ in range(5):
        pc.pool_post(client, body=BODY)
    assert connections._idle == [first] and first.sock is first_socket


def test_threads_at_once_each_get_an_answer_and_leave_their_connections_idle(sim_url):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    answers: list[int] = []

    def call() -> None:
        for _ in range(10):
            answers.append(pc.pool_post(client, body=BODY).status_code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [200] * 80
    assert 1 <= len(pc._plain[str(client.base_url)]._idle) <= 8


def _server_that_closes_after_each_answer() -> tuple[int, list[int], threading.Semaphore, threading.Event]:
    """A pool that answers one request per connection and then closes it
    without saying so (no Connection: close): what an idle timeout does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[int] = []
    closed = threading.Semaphore(0)
    stop = threading.Event()
    answer = json.dumps({"object": "chat.completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(1)
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                                  if h.lower().startswith(b"content-length")))
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(answer)).encode() + b"\r\n\r\n" + answer)
            closed.release()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], accepted, closed, stop


def test_a_connection_the_pool_closed_while_idle_is_never_reused():
    port, accepted, closed, stop = _server_that_closes_after_each_answer()
    try:
        client = pc.pool_client(base_url=f"http://127.0.0.1:{port}/v1", api_key_env="")
        sent_before = pc.pool_requests_sent()
        for _ in range(3):
            assert pc.pool_post(client, body=BODY).status_code == 200
            assert closed.acquire(timeout=5)  # the pool has closed it: the idle connection is a dead one
        assert len(accepted) == 3  # a new connection each time, not a failed reuse
        assert pc.pool_requests_sent() - sent_before == 3
    finally:
        stop.set()


def test_an_unreachable_pool_is_a_connection_error_that_never_reached_it():
    client = pc.pool_client(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key_env="")
    sent_before = pc.pool_requests_sent()
    with pytest.raises(openai.APIConnectionError) as raised:
        pc.pool_post(client, body=BODY)
    assert not isinstance(raised.value, openai.APITimeoutError)
    assert pc.pool_requests_sent() == sent_before


def test_a_pool_slower_than_the_timeout_is_a_timeout_error(sim_url, settings):
    settings.SLUICE_UPSTREAM_TIMEOUT_S = 0.3
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    with pytest.raises(openai.APITimeoutError):
        pc.pool_post(client, body={**BODY, "sim": {"latency_ms": 2000}})
    assert pc.pool_post(client, body=BODY).status_code == 200  # the timed-out connection was not kept


@pytest.mark.parametrize("base_url, env", [
    ("https://pool.example/v1", {}),
    ("http://pool.example/v1", {"HTTP_PROXY": "http://proxy.example:3128"}),
    ("http://pool.example/v1", {"ALL_PROXY": "http://proxy.example:3128"}),
])
def test_https_and_proxied_pools_keep_httpx(monkeypatch, base_url, env):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = pc.pool_client(base_url=base_url, api_key_env="")
    assert pc._plain_connections(client) is None


def test_a_pool_no_proxy_exempts_takes_the_plain_path(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    client = pc.pool_client(base_url="http://127.0.0.1:9/v1", api_key_env="")
    assert pc._plain_connections(client) is not None


def test_the_setting_off_keeps_httpx_for_every_pool(settings):
    settings.SLUICE_POOL_PLAIN_HTTP = False
    client = pc.pool_client(base_url="http://127.0.0.1:9/v1", api_key_env="")
    assert pc._plain_connections(client) is None


def test_pool_clients_share_the_tls_context_the_workers_start_built(sim_url, monkeypatch):
    """A worker builds the TLS context once, at its start (``pool_clients_warm``);
    no pool client parses the CA bundle again when its first call comes,
    whether its calls take the plain path or httpx."""
    import ssl

    made = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(1) or real(*a, **kw))
    pc.pool_tls_context.cache_clear()
    try:
        pc.pool_clients_warm()
        assert len(made) == 1
        answers = []
        for pool_id in (1, 2, 3):
            client = pc.pool_client(base_url=sim_url, api_key_env="", pool_id=pool_id)
            if pool_id == 3:
                pc._plain[str(client.base_url)] = None  # this one's calls keep httpx
            answers.append(pc.pool_post(client, body=BODY).status_code)
        assert answers == [200, 200, 200]
        assert len(made) == 1
    finally:
        pc.pool_tls_context.cache_clear()


@pytest.fixture(scope="module")
def limited_sim_url(tmp_path_factory) -> Iterator[str]:
    """A simulator with room for every call here."""
    yield from _sim(tmp_path_factory, "sim-pool-client-limits", tpm=1_000_000)


@pytest.mark.parametrize("path", ["plain", "httpx", "stream"])
def test_each_path_keeps_the_answers_statement_in_the_order_its_call_went(limited_sim_url, redis_client, path):
    # given a pool whose kept statement came from a call that went after an earlier one
    from budgets.admission import keys
    from budgets.admission.provider_limits import provider_limits_record, provider_take_call

    pool_id = 9_000_001
    capacity = keys.pool_capacity(pool_id)
    client = pc.pool_client(base_url=limited_sim_url, api_key_env="", pool_id=pool_id)
    if path != "plain":
        pc._plain[str(client.base_url)] = None
    early = provider_take_call(pool_id=pool_id, tokens=10).run().mark
    late = provider_take_call(pool_id=pool_id, tokens=10).run().mark
    provider_limits_record(pool_id=pool_id, mark=late, headers={"x-ratelimit-limit-tokens": "1000000",
                                                                 "x-ratelimit-remaining-tokens": "7"})

    def call(mark) -> None:
        if path == "stream":
            pc.pool_stream_open(client, body={**BODY, "stream": True}, mark=mark).close()
        else:
            pc.pool_post(client, body=BODY, pool_id=pool_id, mark=mark)

    # when the earlier call's answer comes back: older news, it changes nothing
    call(early)
    assert float(redis_client.hget(capacity, "prov_rem_tok")) == 7.0

    # and when a call that went after them answers, its statement is kept
    call(provider_take_call(pool_id=pool_id, tokens=10).run().mark)
    assert float(redis_client.hget(capacity, "prov_rem_tok")) > 900_000


@pytest.fixture(scope="module")
def refusing_sim_url(tmp_path_factory) -> Iterator[str]:
    """A simulator whose token limit a few calls fill (100 a minute): the
    next is refused with a little room left and its retry-after."""
    yield from _sim(tmp_path_factory, "sim-pool-client-refusals", tpm=100)


@pytest.mark.parametrize("path", ["plain", "httpx", "stream"])
def test_each_path_holds_the_room_a_refusal_states_until_its_retry_after(refusing_sim_url, redis_client, path):
    # given a provider whose window other calls filled (their answers kept nowhere), and a pool that has
    # heard nothing from it yet, so its next call of 40 tokens goes
    from budgets.admission import keys
    from budgets.admission.provider_limits import provider_take_call

    pool_id = 9_000_002 + ["plain", "httpx", "stream"].index(path)
    client = pc.pool_client(base_url=refusing_sim_url, api_key_env="", pool_id=pool_id)
    filler = pc.pool_client(base_url=refusing_sim_url, api_key_env="")
    if path != "plain":
        pc._plain[str(client.base_url)] = None
    body = {**BODY, "max_tokens": 30}
    for _ in range(10):
        try:
            pc.pool_post(filler, body=body)
        except openai.RateLimitError:
            break
    mark = provider_take_call(pool_id=pool_id, tokens=40).run().mark
    assert mark is not None and mark.tokens == 40

    # when it is refused, with less room left than it took
    with pytest.raises(openai.RateLimitError) as refused:
        if path == "stream":
            pc.pool_stream_open(client, body={**body, "stream": True}, pool_id=pool_id, mark=mark).close()
        else:
            pc.pool_post(client, body=body, pool_id=pool_id, mark=mark)
    headers = refused.value.response.headers
    assert int(headers["x-ratelimit-remaining-tokens"]) < 40 and duration_ms(headers["x-ratelimit-reset-tokens"]) == 0
    hold_ms = min(float(headers["retry-after-ms"]), REFUSAL_HOLD_MAX_MS)

    # then the token room stays closed until the refusal's retry-after (a second at most), counted from when
    # the call went
    reset_at = float(redis_client.hget(keys.pool_capacity(pool_id), "prov_reset_tok_ms"))
    assert reset_at == pytest.approx(mark.at_ms + hold_ms, abs=50)
    assert provider_take_call(pool_id=pool_id, tokens=40).run().wait_ms > 0


STREAM_BODY = {**BODY, "stream": True, "stream_options": {"include_usage": True}}


def _events(response) -> list[str]:
    try:
        return [line[6:] for lines in pc.stream_line_batches(response) for line in lines if line.startswith("data: ")]
    finally:
        response.close()


def test_a_stream_reads_the_same_events_on_both_paths(sim_url):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    plain = pc.pool_stream_open(client, body=STREAM_BODY)
    assert isinstance(plain, pc.PlainStream) and plain.headers["content-type"].startswith("text/event-stream")
    plain_events = _events(plain)
    pc._plain[str(client.base_url)] = None
    via_httpx = pc.pool_stream_open(client, body=STREAM_BODY)
    assert not isinstance(via_httpx, pc.PlainStream)
    httpx_events = _events(via_httpx)
    assert plain_events[-1] == httpx_events[-1] == "[DONE]"
    a, b = [json.loads(e) for e in plain_events[:-1]], [json.loads(e) for e in httpx_events[:-1]]
    assert len(a) == len(b) == 8 + 3  # the opening chunk, 8 tokens, the finish, the usage
    assert [c["choices"][0]["delta"].get("role") for c in a if c["choices"]] == \
        [c["choices"][0]["delta"].get("role") for c in b if c["choices"]]
    assert a[-1]["usage"] == b[-1]["usage"] and a[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("status, exception", [(429, openai.RateLimitError), (503, openai.InternalServerError)])
def test_a_stream_refused_before_it_starts_raises_the_same_sdk_exception_on_both_paths(sim_url, status, exception):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    body = {**STREAM_BODY, "sim": {"fail_status": status, "fail_retry_after": 2}}
    with pytest.raises(exception) as plain:
        pc.pool_stream_open(client, body=body)
    pc._plain[str(client.base_url)] = None
    with pytest.raises(exception) as via_httpx:
        pc.pool_stream_open(client, body=body)
    assert plain.value.status_code == via_httpx.value.status_code == status
    assert plain.value.body == via_httpx.value.body


def test_a_stream_read_to_its_end_keeps_its_connection_and_one_closed_early_closes_it(sim_url):
    client = pc.pool_client(base_url=sim_url, api_key_env="")
    # a stream read to its [DONE] (and no further, as the worker reads one):
    # its connection goes back and the next stream uses it
    done = pc.pool_stream_open(client, body=STREAM_BODY)
    assert any("data: [DONE]" in lines for lines in pc.stream_line_batches(done))
    done.close()
    connections = pc._plain[str(client.base_url)]
    [kept] = connections._idle
    kept_socket = kept.sock
    stream = pc.pool_stream_open(client, body={**STREAM_BODY, "max_tokens": 200, "sim": {"output_tokens": 200}})
    assert connections._idle == [] and kept.sock is kept_socket
    # closed after its first event: the connection is closed (the pool sees
    # its caller go), never handed to another call
    next(pc.stream_line_batches(stream))
    stream.close()
    assert connections._idle == [] and kept.sock is None and kept_socket.fileno() == -1


def _on_both_paths(respond, read) -> list:
    """A pool on a raw socket that answers each of two streamed calls with
    ``respond(conn)``; what ``read(stream)`` made of its answer on the plain
    path, then on httpx's."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            respond(conn)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        client = pc.pool_client(base_url=f"http://127.0.0.1:{port}/v1", api_key_env="")
        seen = []
        for plain in (True, False):
            if not plain:
                pc._plain[str(client.base_url)] = None
            stream = pc.pool_stream_open(client, body=STREAM_BODY)
            assert isinstance(stream, pc.PlainStream) is plain
            try:
                seen.append(read(stream))
            finally:
                stream.close()
        return seen
    finally:
        listener.close()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_stream_cut_off_mid_way_raises_what_the_httpx_path_raises_for_it():
    # a pool that sends one chunk of its chunked body, then drops the connection
    event = b'data: {"choices": []}\n\n'

    def respond(conn) -> None:
        conn.sendall(SSE_HEAD + f"{len(event):x}\r\n".encode() + event + b"\r\n" + b"40\r\ndata: {\"cho")

    def read(stream) -> tuple[str, type]:
        lines = []
        with pytest.raises(httpx.HTTPError) as raised:
            for batch in pc.stream_line_batches(stream):
                lines.extend(line for line in batch if line)
        return lines[0], type(raised.value)

    broken = _on_both_paths(respond, read)
    # the event before the cut arrives on both paths; the cut is an httpx
    # error on both (what gateway/worker/streaming.py catches)
    assert [line for line, _ in broken] == ['data: {"choices": []}'] * 2
    assert broken[0][1] is httpx.ReadError


def test_events_the_pool_sent_together_are_read_as_one_batch_on_both_paths():
    # a pool that writes five events at once, then three more, then its end
    first = b"".join(b'data: {"n": %d}\n\n' % i for i in range(5))
    second = b"".join(b'data: {"n": %d}\r\n\r\n' % i for i in range(5, 8)) + b"data: [DONE]\n\n"
    first_read = threading.Event()

    def respond(conn) -> None:
        conn.sendall(SSE_HEAD + f"{len(first):x}\r\n".encode() + first + b"\r\n")
        first_read.wait(5)
        first_read.clear()
        conn.sendall(f"{len(second):x}\r\n".encode() + second + b"\r\n0\r\n\r\n")

    def read(stream) -> list:
        batches = []
        for lines in pc.stream_line_batches(stream):
            batches.append([line for line in lines if line])
            first_read.set()  # the second write goes only once the first was read
        return batches

    seen = _on_both_paths(respond, read)
    # then each write is one batch, on both paths: one relay hop each
    expected = [[f'data: {{"n": {i}}}' for i in range(5)],
                [f'data: {{"n": {i}}}' for i in range(5, 8)] + ["data: [DONE]"]]
    assert seen == [expected, expected]


def test_a_line_cut_between_two_reads_goes_with_the_second():
    reads = [b'data: {"a"', b': 1}\n\ndata: {"b": 2}\n', b"\ndata: x\r", b"\ndata: tail"]
    assert [[line for line in lines if line] for lines in pc.sse_line_batches(reads)] == [
        ['data: {"a": 1}', 'data: {"b": 2}'], ["data: x"], [], ["data: tail"]]
