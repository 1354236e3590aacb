"""What an attacker's probe found at the door, each refused with a clear
OpenAI-shaped 4xx before any budget, job or pool is touched: bodies no pool
request can carry (lone surrogates, NUL), numbers and nesting that break
Python's json, unknown fields, the simulator's test switches on a pool that
is not a simulator, and every /v1 error that used to be an HTML page."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from django.test import override_settings

from budgets.admission import keys
from budgets.admission.capacity import capacity_state
from budgets.errors import Rejected
from budgets.models import UsageRecord
from gateway.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Hello there."}]


@pytest.fixture
def caller(platform, make_caller):
    return make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))


def post(platform, path: str, api_key: str, *, content: bytes | None = None, json_body: dict | None = None,
         headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{platform.base_url}{path}", content=content, json=json_body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
                               **(headers or {})})


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_nothing_spent(redis_client, pool_id: int) -> None:
    assert redis_client.hgetall(keys.pool_counters(pool_id)) == {}
    assert UsageRecord.objects.count() == 0
    assert Job.objects.count() == 0


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def body(**fields) -> bytes:
    return json.dumps({"model": "sim-small", "messages": HELLO, **fields}).encode()


def tool(description: str = "Look up the weather.", **function) -> dict:
    return {"type": "function", "function": {"name": "weather", "description": description,
                                             "parameters": {"type": "object", "properties": {}}, **function}}


# (name, raw body, status, code, param): the request path's door
DOOR = [
    ("lone surrogate in content", body(messages=[{"role": "user", "content": "a \ud800 b"}]), 400, "invalid_string",
     "messages[0].content"),
    ("lone surrogate in a tool", body(tools=[tool("\udfff")]), 400, "invalid_string", "tools[0].function.description"),
    ("lone surrogate in a name", body(messages=[{"role": "user", "content": "x", "name": "\ud83d"}]), 400,
     "invalid_string", "messages[0].name"),
    ("lone surrogate in a key", body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"properties": {"\ud800": {}}}}}), 400, "invalid_string",
     "response_format.json_schema.schema.properties"),
    ("NUL in content", body(messages=[{"role": "user", "content": "a\u0000b"}]), 400, "invalid_string",
     "messages[0].content"),
    ("5,000-digit max_tokens", b'{"model": "sim-small", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}", 400,
     "invalid_json", None),
    ("5,000-digit seed", b'{"model": "sim-small", "seed": -' + b"1" * 5000 + b', "messages": []}', 400, "invalid_json",
     None),
    ("seed above int64", body(seed=2**63), 400, "invalid_json", None),
    ("100k-deep JSON", nested(100_000).encode(), 400, "invalid_json", None),
    ("900-deep tools", b'{"model": "sim-small", "messages": [], "tools": ' + nested(900).encode() + b"}", 400,
     "invalid_json", None),
    ("65-deep schema", body(tools=[tool(parameters=json.loads("[" * 62 + "]" * 62))]), 400, "invalid_json", None),
    ("NaN", b'{"model": "sim-small", "messages": [], "temperature": NaN}', 400, "invalid_json", None),
    ("1e999", b'{"model": "sim-small", "messages": [], "temperature": 1e999}', 400, "invalid_json", None),
    ("unknown field", body(model_overrides={"x": 1}), 400, "unknown_parameter", "model_overrides"),
    ("unknown message field", body(messages=[{"role": "user", "content": "x", "priority": 9}]), 400,
     "unknown_parameter", "messages[0]"),
    ("audio part", body(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), 400,
     "unsupported_content_part", "messages[0].content[0]"),
    ("tool without a name", body(tools=[{"type": "function", "function": {"description": "x"}}]), 400, None,
     "tools[0].function.name"),
    ("tools not a list", body(tools={"weather": {}}), 400, None, "tools"),
    ("bad response_format", body(response_format={"type": "xml"}), 400, None, "response_format.type"),
    ("bad tool_choice", body(tool_choice="sometimes"), 400, None, "tool_choice"),
    ("tool_calls not a list", body(messages=[{"role": "assistant", "content": None, "tool_calls": "x"}]), 400, None,
     "messages[0].tool_calls"),
    ("sim field unknown", body(sim={"gpu_melt": True}), 400, "unknown_parameter", "sim"),
    ("sim fail_status not an outage", body(sim={"fail_status": 418}), 400, None, "sim.fail_status"),
    ("logit_bias junk", body(logit_bias={"abc": 500}), 400, None, "logit_bias"),
]


@pytest.mark.parametrize("name,raw,status,code,param", DOOR, ids=[d[0] for d in DOOR])
def test_hostile_chat_bodies_are_refused_at_the_door(platform, caller, redis_client, name, raw, status, code, param):
    response = post(platform, "/v1/chat/completions", caller.api_key, content=raw)
    error = assert_openai_error(response, status, code)
    if param is not None:
        assert error["param"] == param
    assert_nothing_spent(redis_client, caller.pool.id)


@pytest.mark.parametrize("name,raw", [
    ("NUL in content", body(messages=[{"role": "user", "content": "\u0000"}])),
    ("NUL in an unknown field", body(note="\u0000")),
    ("NUL in the callback URL", body(callback_url="http://example.test/\u0000")),
    ("lone surrogate", body(messages=[{"role": "user", "content": "\ud800"}])),
    ("5,000-digit max_tokens", b'{"model": "sim-small", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}"),
    ("deep", b'{"model": "sim-small", "messages": ' + nested(5000).encode() + b"}"),
])
def test_hostile_job_bodies_are_refused_before_a_job_exists(platform, caller, redis_client, name, raw):
    response = post(platform, "/v1/jobs", caller.api_key, content=raw)
    assert_openai_error(response, 400)
    assert_nothing_spent(redis_client, caller.pool.id)


def test_a_bad_host_is_refused_before_a_job_is_created(platform, caller, redis_client):
    response = post(platform, "/v1/jobs", caller.api_key, json_body={"model": "sim-small", "messages": HELLO},
                    headers={"Host": "evil.example"})
    assert_openai_error(response, 400, "invalid_host")
    assert_nothing_spent(redis_client, caller.pool.id)
    response = post(platform, "/v1/chat/completions", caller.api_key, json_body={"model": "sim-small",
                                                                                 "messages": HELLO},
                    headers={"Host": "evil.example"})
    assert_openai_error(response, 400, "invalid_host")
    assert_nothing_spent(redis_client, caller.pool.id)


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("POST", "/v1/chat/completion", 404, "not_found"),
    ("GET", "/v1", 404, "not_found"),
    ("GET", "/v1/jobs/not-a-uuid", 404, "not_found"),
    ("GET", "/v1/jobs/%ff%fe", 404, "not_found"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    ("DELETE", "/v1/jobs/8d5b0e4c-1f0a-4c47-9a51-6f1f2a0d3c11", 405, "method_not_allowed"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("POST", "/healthz", 405, "method_not_allowed"),
])
def test_every_v1_error_is_openai_json(platform, caller, method, path, status, code):
    response = httpx.request(method, f"{platform.base_url}{path}", timeout=10,
                             headers={"Authorization": f"Bearer {caller.api_key}"})
    assert_openai_error(response, status, code)
    if status == 405:
        assert response.headers["allow"]


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(platform, caller):
    # Only the headers are sent: the answer must not wait for 3 MB that never come.
    with socket.create_connection(("127.0.0.1", platform.web_port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + caller.api_key.encode() + b"\r\nContent-Length: 3000000\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(payload)["error"]["code"] == "body_too_large"


def test_a_chunked_body_over_the_limit_is_413_json(platform, caller, redis_client):
    def chunks():
        yield b'{"model": "sim-small", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"a" * 100_000  # 4 MB in all, no Content-Length
        yield b'"}]}'

    try:
        response = httpx.post(f"{platform.base_url}/v1/chat/completions", content=chunks(), timeout=30,
                              headers={"Authorization": f"Bearer {caller.api_key}"})
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pytest.fail("the gateway hung up without answering")
    assert_openai_error(response, 413, "body_too_large")
    assert_nothing_spent(redis_client, caller.pool.id)


# -- the simulator's test switches ------------------------------------------------


def test_sim_switches_on_a_real_pool_are_refused_and_change_nothing(platform, make_caller, redis_client):
    """The probe: three calls with fail_status 429 / Retry-After 600 cut the
    pool-wide capacity to 0.25 and imposed a 600 s backoff on every tenant."""
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", is_simulator=False)
    caller = make_caller(pool=pool)
    platform.sim_reset()
    for _ in range(3):
        response = post(platform, "/v1/chat/completions", caller.api_key, json_body={
            "model": "sim-small", "messages": HELLO, "sim": {"fail_status": 429, "fail_retry_after": 600}})
        error = assert_openai_error(response, 400, "sim_controls_disabled")
        assert error["param"] == "sim"
    assert capacity_state(pool_id=pool.id).factor == 1.0
    assert platform.sim_stats()["requests_total"] == 0
    assert_nothing_spent(redis_client, pool.id)
    # and jobs likewise
    response = post(platform, "/v1/jobs", caller.api_key, json_body={"model": "sim-small", "messages": HELLO,
                                                                     "sim": {"output_tokens": 3}})
    assert_openai_error(response, 400, "sim_controls_disabled")
    assert Job.objects.count() == 0
    # while the same pool without switches works
    ok = post(platform, "/v1/chat/completions", caller.api_key, json_body={"model": "sim-small", "messages": HELLO,
                                                                           "max_tokens": 5})
    assert ok.status_code == 200, ok.text


def test_sim_switches_need_the_setting_as_well_as_a_simulator_pool(make_caller):
    from gateway.core.request.chat import request_check, validate_chat_request
    from gateway.core.request.context import context_for_workload

    caller = make_caller(pool=make_caller.pool(is_simulator=True))
    chat = validate_chat_request({"model": "sim-small", "messages": HELLO, "sim": {"output_tokens": 3}})
    with override_settings(SLUICE_SIM_CONTROLS=False):
        ctx = context_for_workload(caller.workload)
        assert ctx.sim_controls is False
        with pytest.raises(Rejected) as refused:
            request_check(ctx, chat)
        assert (refused.value.status, refused.value.reason) == (400, "sim_controls_disabled")
    with override_settings(SLUICE_SIM_CONTROLS=True):
        ctx = context_for_workload(caller.workload)
        assert ctx.sim_controls is True
        request_check(ctx, chat)  # allowed


# -- every token counted ---------------------------------------------------------------


def test_a_prompt_hidden_in_a_tool_description_counts_against_the_cap(platform, make_caller, redis_client):
    """The probe: ~200k tokens in tools[0].function.description were admitted
    and estimated at 8-17 tokens, while the same text in content was refused."""
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), prompt_tokens_cap=8_000)
    hidden = "lorem " * 200_000
    for where in ({"tools": [tool(hidden)]},
                  {"messages": [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": hidden}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": hidden}}},
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] + [
                      {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}] * 8}]}):
        response = post(platform, "/v1/chat/completions", caller.api_key,
                        json_body={"model": "sim-small", "messages": HELLO, **where})
        error = assert_openai_error(response, 400, "context_length_exceeded")
        assert error["param"] == "messages"
    assert_nothing_spent(redis_client, caller.pool.id)


def test_the_estimate_the_caller_sees_includes_tools_and_agrees_with_the_pool(platform, caller):
    import llm_tokens

    tools = [tool("Look up the weather for a city, in Celsius.")]
    response = post(platform, "/v1/chat/completions", caller.api_key, json_body={
        "model": "sim-small", "messages": HELLO, "tools": tools, "max_tokens": 5})
    assert response.status_code == 200, response.text
    expected = llm_tokens.count_chat_tokens(HELLO, request={"tools": tools})
    assert expected > llm_tokens.count_chat_tokens(HELLO) + 20
    assert response.headers["x-sluice-estimated-prompt-tokens"] == str(expected)
    assert response.json()["usage"]["prompt_tokens"] == expected


def raw_request(platform, head: bytes, payload: bytes = b"") -> int:
    """Send bytes no HTTP client would; the status line's code."""
    with socket.create_connection(("127.0.0.1", platform.web_port), timeout=10) as conn:
        conn.sendall(head + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        answer = b""
        while b"\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


@pytest.mark.parametrize("header", [
    b"Idempotency-Key: a\x00b", b"Idempotency-Key: a\x01b", b"Idempotency-Key: caf\xe9", b"X-Session-Id: s\x00",
    b"X-Session-Id: \xff\xfe", b"Authorization: Bearer sk-\x00", b"Authorization: Bearer \xe9\xe9",
])
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/jobs"])
def test_odd_bytes_in_headers_are_never_a_500(platform, caller, redis_client, header, path):
    payload = json.dumps({"model": "sim-small", "messages": HELLO, "max_tokens": 3}).encode()
    auth = b"" if header.startswith(b"Authorization") else b"Authorization: Bearer " + caller.api_key.encode() + b"\r\n"
    status = raw_request(platform, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + auth + header + b"\r\n", payload)
    assert 200 <= status < 500, status
