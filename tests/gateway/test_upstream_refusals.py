"""A pool that refuses a request as malformed (its 400, 404, 413, 422) is
the caller's error, not the pool's failure: relayed as the caller's 4xx with
the pool's message, tokens refunded (the pool generated nothing), recorded
in the ledger as ``invalid_request``, not retried, no capacity signal."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest

from budgets.admission import keys
from budgets.admission.capacity import capacity_state

from tests.gateway.ledger import ledger_row

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Tell me about the weather."}]


def post_chat(platform, api_key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"})


def counters(redis_client, pool_id: int) -> dict[str, int]:
    return {k: int(v) for k, v in redis_client.hgetall(keys.pool_counters(pool_id)).items()}


def assert_refusal_recorded(redis_client, caller, response: httpx.Response, *, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    row = ledger_row(response.headers["x-request-id"])
    # the ledger keeps the code and the pool's own status (and words: exact in the stub test below)
    assert (row.status, row.attempts) == ("invalid_request", 1)
    assert row.error.startswith(f"{code} (pool answered {status}: ") and row.error.endswith(")")
    assert (row.actual_input_tokens, row.actual_output_tokens) == (0, 0)
    wid = caller.workload.id
    # the tokens come back; the request slot stays spent (the pool saw the call)
    assert counters(redis_client, caller.pool.id)[f"{wid}.debited_tok"] == 0
    assert counters(redis_client, caller.pool.id)[f"{wid}.admitted_req"] == 1
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0
    assert capacity_state(pool_id=caller.pool.id).factor == 1.0


def test_a_pool_400_is_the_callers_400_with_the_pools_message(platform, make_caller, redis_client):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    platform.sim_reset()
    # given a pool whose context window is smaller than the workload's caps allow
    platform.sim_capacity(kv_cache_tokens=30)
    try:
        response = post_chat(platform, caller.api_key,
                             {"model": "sim-small", "messages": HELLO, "max_tokens": 40, "sim": {"output_tokens": 40}})
        stats = platform.sim_stats()
    finally:
        platform.sim_reset()
    assert_refusal_recorded(redis_client, caller, response, status=400, code="context_length_exceeded")
    assert "maximum context length is 30 tokens" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages"
    assert response.headers["x-sluice-attempts"] == "1"
    assert stats["requests_total"] == 1  # not retried


def test_a_pool_404_is_the_callers_404(platform, make_caller, redis_client):
    # given a pool configured to serve a model its server does not have
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    pool.served_models = ["sim-small", "ghost-model"]
    pool.save(update_fields=["served_models"])
    caller = make_caller(pool=pool)
    platform.sim_reset()
    response = post_chat(platform, caller.api_key, {"model": "ghost-model", "messages": HELLO, "max_tokens": 5})
    assert_refusal_recorded(redis_client, caller, response, status=404, code="model_not_found")
    assert "ghost-model" in response.json()["error"]["message"]
    assert platform.sim_stats()["requests_total"] == 1


@pytest.mark.parametrize("status,relayed", [(422, 422), (413, 413), (401, 502), (409, 502)])
def test_only_malformed_request_statuses_are_relayed(platform, make_caller, redis_client, status, relayed):
    """A pool that refuses the gateway's own credentials (401) or answers
    oddly is the pool's failure (502); only 'your request is wrong' is the
    caller's. (No inference_sim knob answers 401/409/413/422: a one-line stub.)"""
    calls: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            body = json.dumps({"error": {"message": f"stub says {status} \u0000!", "type": "invalid_request_error",
                                         "param": "tools", "code": "stub code\u0000"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        caller = make_caller(pool=make_caller.pool(base_url=f"http://127.0.0.1:{server.server_port}/v1"))
        response = post_chat(platform, caller.api_key, {"model": "sim-small", "messages": HELLO, "max_tokens": 5})
    finally:
        server.shutdown()
    assert response.status_code == relayed, response.text
    row = ledger_row(response.headers["x-request-id"])
    assert row.error == f"{'stubcode' if relayed == status else 'upstream_error'} (pool answered {status}: stub says {status} !)"
    if relayed == status:
        assert_refusal_recorded(redis_client, caller, response, status=status, code="stubcode")
        assert response.json()["error"]["message"] == f"The inference pool refused the request: stub says {status} !"
        assert response.json()["error"]["param"] == "tools"
        assert calls == ["/v1/chat/completions"]
    else:
        assert row.status == "upstream_error"
        assert response.json()["error"]["code"] == "upstream_error"
