"""The whole path through real processes: the official openai SDK -> gateway
(uvicorn) -> admission (Redis) -> lane (Celery worker) -> inference_sim over
HTTP -> settlement -> ledger (PostgreSQL)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

import llm_tokens
from budgets.admission import keys
from budgets.models import UsageRecord

from tests.gateway.ledger import ledger_row, ledger_rows
from tests.gateway.sdk_calls import counters, sdk

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Say hello to the gateway, please."}]


@pytest.mark.redis_cluster
def test_openai_sdk_gets_a_completion_with_exact_usage(platform, caller):
    client = sdk(platform, caller.api_key)
    raw = client.chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=40, extra_body={"sim": {"output_tokens": 17}}
    )
    completion = raw.parse()
    assert completion.usage.prompt_tokens == llm_tokens.count_chat_tokens(HELLO)
    assert completion.usage.completion_tokens == 17
    assert completion.choices[0].message.content
    assert raw.headers["x-sluice-max-tokens-applied"] == "40"
    assert raw.headers["x-sluice-lane"] == "interactive"
    assert raw.headers["x-sluice-estimated-prompt-tokens"] == str(completion.usage.prompt_tokens)
    assert int(raw.headers["x-ratelimit-limit-tokens"]) == 100_000


def test_max_tokens_above_the_cap_is_clamped_and_echoed(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, max_tokens_cap=50)
    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=5_000
    )
    completion = raw.parse()
    assert raw.headers["x-sluice-max-tokens-applied"] == "50"
    assert completion.usage.completion_tokens <= 50
    row = ledger_row(raw.headers["x-request-id"])
    assert UsageRecord.objects.count() == 1
    assert row.estimated_output_tokens == 50


def test_missing_max_tokens_uses_the_workload_default(platform, caller):
    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(model="sim-small", messages=HELLO)
    assert raw.headers["x-sluice-max-tokens-applied"] == "64"


def test_over_budget_raises_rate_limit_error_with_headers_and_retry_after_works(platform, make_caller):
    # given a ceiling bucket of 15 s x 4,000 TPM = 1,000 tokens
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=200, max_tokens_cap=400)
    client = sdk(platform, caller.api_key)
    prompt_tokens = llm_tokens.count_chat_tokens(HELLO)
    # when it spends the bucket down with requests estimated at prompt + 400
    client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400,
                                   extra_body={"sim": {"output_tokens": 400}})
    client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400,
                                   extra_body={"sim": {"output_tokens": 400}})
    with pytest.raises(openai.RateLimitError) as excinfo:
        client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400)
    # then the SDK sees a 429 with every header it needs to back off
    error = excinfo.value
    headers = error.response.headers
    assert error.status_code == 429
    assert error.code == "workload_tpm"
    assert error.body["code"] == "workload_tpm"
    retry_after_ms = int(headers["retry-after-ms"])
    assert int(headers["retry-after"]) == -(-retry_after_ms // 1000)
    assert headers["x-ratelimit-limit-tokens"] == "4000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < prompt_tokens + 400
    assert headers["x-ratelimit-limit-requests"] == "1000"
    assert "x-ratelimit-remaining-requests" in headers and "x-ratelimit-reset-tokens" in headers
    # and waiting Retry-After is enough
    time.sleep(retry_after_ms / 1000)
    ok = client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400)
    assert ok.usage.prompt_tokens == prompt_tokens


def test_prompt_over_the_cap_is_rejected_and_costs_nothing(platform, make_caller, redis_client):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, prompt_tokens_cap=20)
    long_prompt = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(openai.BadRequestError) as excinfo:
        sdk(platform, caller.api_key).chat.completions.create(model="sim-small", messages=long_prompt)
    assert excinfo.value.code == "context_length_exceeded"
    assert excinfo.value.body["param"] == "messages"
    assert counters(redis_client, pool.id) == {}
    assert UsageRecord.objects.count() == 0


MALFORMED = [
    ("not json", b"{not json", 400, "invalid_json"),
    ("json array", b"[1, 2]", 400, "invalid_json"),
    ("no messages", b'{"model": "sim-small"}', 400, None),
    ("empty messages", b'{"model": "sim-small", "messages": []}', 400, None),
    ("message not object", b'{"model": "sim-small", "messages": ["hi"]}', 400, None),
    ("bad role", b'{"model": "sim-small", "messages": [{"role": "wizard", "content": "x"}]}', 400, None),
    ("content number", b'{"model": "sim-small", "messages": [{"role": "user", "content": 5}]}', 400, None),
    ("no model", b'{"messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("model number", b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("max_tokens string", b'{"model": "sim-small", "max_tokens": "10", "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("max_tokens negative", b'{"model": "sim-small", "max_tokens": -5, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("max_tokens zero", b'{"model": "sim-small", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("max_tokens absurd", b'{"model": "sim-small", "max_tokens": 99999999999, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("max_tokens bool", b'{"model": "sim-small", "max_tokens": true, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("temperature out of range", b'{"model": "sim-small", "temperature": 9, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("n above one", b'{"model": "sim-small", "n": 3, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("stream not a boolean", b'{"model": "sim-small", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("include_usage not a boolean", b'{"model": "sim-small", "stream": true, "stream_options": {"include_usage": 1}, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("stream_options unknown key", b'{"model": "sim-small", "stream": true, "stream_options": {"nope": true}, "messages": [{"role": "user", "content": "x"}]}', 400, None),
    ("unknown model", b'{"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
    ("invalid utf-8", b'{"model": "sim-small", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_json"),
]


@pytest.mark.parametrize("name,body,status,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_get_openai_shaped_4xx_and_cost_nothing(platform, caller, redis_client, name, body, status, code):
    response = httpx.post(f"{platform.base_url}/v1/chat/completions", content=body, timeout=10,
                          headers={"Authorization": f"Bearer {caller.api_key}", "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code:
        assert error["code"] == code
    assert counters(redis_client, caller.pool.id) == {}
    assert UsageRecord.objects.count() == 0


def test_body_too_large_is_413(platform, caller):
    huge = b'{"model": "sim-small", "messages": [{"role": "user", "content": "' + b"a" * 3_000_000 + b'"}]}'
    response = httpx.post(f"{platform.base_url}/v1/chat/completions", content=huge, timeout=30,
                          headers={"Authorization": f"Bearer {caller.api_key}"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


def test_missing_or_revoked_keys_are_401(platform, caller):
    from tenants.models import ApiKey
    from tenants.services import api_key_revoke

    assert httpx.post(f"{platform.base_url}/v1/chat/completions", json={}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk(platform, "sk-sluice-wrong").chat.completions.create(model="sim-small", messages=HELLO)
    api_key_revoke(api_key=ApiKey.objects.get(workload=caller.workload))
    time.sleep(0.6)  # the gateway caches keys for SLUICE_AUTH_CACHE_S (0.5 s in tests)
    with pytest.raises(openai.AuthenticationError):
        sdk(platform, caller.api_key).chat.completions.create(model="sim-small", messages=HELLO)


def test_models_lists_the_pool_models(platform, caller):
    models = sdk(platform, caller.api_key).models.list()
    assert sorted(m.id for m in models.data) == ["sim-large", "sim-small"]


@pytest.mark.redis_cluster
def test_i5_and_ledger_match_the_usage_the_pool_reported(platform, caller, redis_client):
    # given a quiet simulator
    platform.sim_reset()
    client = sdk(platform, caller.api_key)
    lengths = [3, 11, 29, 64, 1, 47, 20, 8, 33, 50, 5, 12]

    def call(n: int):
        messages = [{"role": "user", "content": f"Request number {n}: " + "tell me more " * n}]
        return client.chat.completions.create(model="sim-small", messages=messages, max_tokens=64,
                                              extra_body={"sim": {"output_tokens": n}})

    # when twelve concurrent requests go through the whole path
    with concurrent.futures.ThreadPoolExecutor(6) as executor:
        completions = list(executor.map(call, lengths))
    # then the simulator, the buckets and the ledger agree to the token
    stats = platform.sim_stats()
    pool_total = stats["prompt_tokens"] + stats["completion_tokens"]
    assert stats["completed"] == len(lengths)
    assert stats["completion_tokens"] == sum(lengths)
    assert sum(c.usage.total_tokens for c in completions) == pool_total
    wid = caller.workload.id
    bucket_counters = counters(redis_client, caller.pool.id)
    assert bucket_counters[f"{wid}.debited_tok"] == pool_total
    assert bucket_counters[f"{wid}.used_tok"] == pool_total
    rows = ledger_rows(len(lengths), workload=caller.workload)
    assert len(rows) == len(lengths)
    assert all(r.status == "ok" for r in rows)
    assert sum(r.actual_input_tokens + r.actual_output_tokens for r in rows) == pool_total
    assert sum(r.estimated_output_tokens for r in rows) == 64 * len(lengths)
    assert all(r.cost == 0 for r in rows)  # no price configured in this test
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0


@pytest.mark.redis_cluster
def test_replayed_settlement_writes_nothing_twice(platform, caller, redis_client):
    from gateway.worker.execution import request_finish
    from gateway.core.request.records import Outcome, RequestRecord
    from gateway.core import keys as gateway_keys

    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=30, extra_body={"sim": {"output_tokens": 9}})
    request_id = raw.headers["x-request-id"]
    before = counters(redis_client, caller.pool.id)
    record = RequestRecord.from_redis(redis_client.hgetall(gateway_keys.request_record(request_id)))
    outcome = Outcome.from_json(redis_client.get(gateway_keys.request_response(request_id)))
    # when the worker's finishing step runs again (a redelivered task)
    request_finish(record=record, outcome=outcome, pool_called=True)
    # then there is still one ledger row, and the buckets did not move
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert counters(redis_client, caller.pool.id) == before
    assert redis_client.llen(gateway_keys.request_result(request_id)) == 0  # not pushed a second time


@pytest.mark.redis_cluster
def test_a_request_whose_deadline_passes_in_the_queue_never_reaches_the_pool(platform, make_caller, redis_client):
    # given the interactive lane's worker is down
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, queue_timeout_s=1.0, reserved_tpm=60_000)
    buckets_before = redis_client.hgetall(keys.pool_buckets(pool.id))
    platform.stop_worker("interactive")
    platform.sim_reset()
    try:
        # when a request waits past its queue timeout
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as excinfo:
            sdk(platform, caller.api_key).chat.completions.create(model="sim-small", messages=HELLO, max_tokens=20)
        waited = time.monotonic() - started
    finally:
        platform.start_worker("interactive")
        platform.wait_workers_ready(["interactive"])
    # then the gateway answered 503 queue_timeout at the deadline
    assert excinfo.value.status_code == 503
    assert excinfo.value.code == "queue_timeout"
    assert int(excinfo.value.response.headers["retry-after"]) >= 1
    assert 1.0 <= waited < 5.0
    # and once the worker drains the queue (on the broker, which is not the
    # data Redis on a cluster), nothing reached the pool
    from gateway.core.metrics import queue_depths

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and queue_depths()["interactive"] > 0:
        time.sleep(0.1)
    time.sleep(0.5)
    assert platform.sim_stats()["requests_total"] == 0
    # and the buckets are as they were: full refund, request slot included
    wid = caller.workload.id
    assert counters(redis_client, pool.id)[f"{wid}.debited_tok"] == 0
    assert counters(redis_client, pool.id)[f"{wid}.admitted_req"] == 0
    buckets_after = redis_client.hgetall(keys.pool_buckets(pool.id))
    for name in (f"{wid}.E.tok", f"{wid}.Q.tok", "P.tok", f"{wid}.E.req"):
        before = float(buckets_before[f"{name}.l"]) if f"{name}.l" in buckets_before else None
        after = float(buckets_after[f"{name}.l"])
        cap = float(redis_client.hget(keys.pool_config(pool.id), f"{name}.cap"))
        assert after == pytest.approx(before if before is not None else cap)
    row = UsageRecord.objects.get(workload=caller.workload)
    assert row.status == "queue_timeout"
    assert row.actual_input_tokens == 0 and row.actual_output_tokens == 0


@pytest.mark.redis_cluster
def test_worker_that_finds_the_deadline_passed_refunds_and_records(platform, make_caller, redis_client):
    """The other side of the race: the worker dequeues after the deadline,
    before the web side gave up. It owns the refund; the pool is never called."""
    from gateway.core import keys as gateway_keys
    from gateway.worker.execution import request_execute
    from gateway.core.request.records import RequestRecord
    from budgets.admission.buckets import admit

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool)
    platform.sim_reset()
    admission = admit(pool_id=pool.id, workload_id=caller.workload.id, request_id="req_late", input_tokens=12,
                      output_tokens=30, lease_ttl_ms=60_000)
    record = RequestRecord(
        request_id="req_late", tenant_id=caller.tenant.id, workload_id=caller.workload.id, pool_id=pool.id,
        pool_base_url=pool.base_url, pool_api_key_env="", model="sim-small", lane="interactive", borrowed=False,
        estimated_input_tokens=12, estimated_output_tokens=30, admitted_ms=admission.admitted_ms - 5_000,
        deadline_ms=admission.admitted_ms - 1, payload={"model": "sim-small", "messages": HELLO, "max_tokens": 30},
    )
    redis_client.hset(gateway_keys.request_record("req_late"), mapping=record.to_redis())
    assert request_execute(request_id="req_late") == "expired"
    assert request_execute(request_id="req_late") == "expired"  # a redelivery changes nothing
    assert platform.sim_stats()["requests_total"] == 0
    assert counters(redis_client, pool.id)[f"{caller.workload.id}.debited_tok"] == 0
    assert UsageRecord.objects.get(request_id="req_late").status == "queue_timeout"
    assert redis_client.llen(gateway_keys.request_result("req_late")) == 1
