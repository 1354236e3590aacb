"""Streaming through the lanes, end to end against real processes: the
official openai SDK (sync and async) -> gateway (uvicorn) -> admission ->
lane worker -> inference_sim streaming over HTTP -> Redis Stream -> the
waiting web process -> the caller; then settlement, ledger and buckets,
checked to the token."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time

import httpx
import openai
import pytest

import llm_tokens
from budgets.models import UsageRecord
from gateway.core import keys as gateway_keys
from inference_sim.text import completion_text

from tests.gateway.ledger import ledger_row, sole_ledger_row
from tests.gateway.sdk_calls import counters, sdk

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Stream a greeting to the gateway, please."}]
PROMPT_TOKENS = llm_tokens.count_chat_tokens(HELLO)


def settled_counters(redis_client, caller, *, tokens: int, timeout_s: float = 10.0) -> dict[str, int]:
    """The workload's bucket counters once settlement reached them (it runs
    just before the ledger row and the end of the stream)."""
    wid = caller.workload.id
    deadline = time.monotonic() + timeout_s
    while True:
        found = counters(redis_client, caller.pool.id)
        if found.get(f"{wid}.used_tok", 0) >= tokens or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def assert_settled_on(redis_client, caller, row: UsageRecord, *, input_tokens: int, output_tokens: int) -> None:
    """The ledger row and the workload's bucket counters both say these tokens."""
    assert (row.actual_input_tokens, row.actual_output_tokens) == (input_tokens, output_tokens)
    wid = caller.workload.id
    found = settled_counters(redis_client, caller, tokens=input_tokens + output_tokens)
    assert found[f"{wid}.debited_tok"] == input_tokens + output_tokens
    assert found[f"{wid}.used_tok"] == input_tokens + output_tokens
    assert found["P.debited_tok"] == input_tokens + output_tokens


@pytest.mark.redis_cluster
def test_the_sync_sdk_streams_text_and_usage_as_the_pool_produced_them(platform, caller, redis_client):
    before = platform.sim_stats()
    with sdk(platform, caller.api_key).chat.completions.with_streaming_response.create(
        model="sim-small", messages=HELLO, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"sim": {"output_tokens": 17}},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        assert response.headers["x-sluice-lane"] == "interactive"
        assert response.headers["x-sluice-max-tokens-applied"] == "40"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion_text(17)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # the usage chunk is last, and it is the pool's
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, 17)
    after = platform.sim_stats()
    assert after["completion_tokens"] - before["completion_tokens"] == 17
    assert after["prompt_tokens"] - before["prompt_tokens"] == PROMPT_TOKENS
    row = ledger_row(request_id)
    assert (row.status, row.usage_source) == ("ok", "pool")
    # time to first token: after the queue wait, before the request was settled
    assert row.ttft_ms is not None and row.queue_wait_ms <= row.ttft_ms <= row.total_ms
    assert_settled_on(redis_client, caller, row, input_tokens=PROMPT_TOKENS, output_tokens=17)


def test_the_async_sdk_streams_through_sluice_unchanged(platform, caller, redis_client):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{platform.base_url}/v1", api_key=caller.api_key, max_retries=0,
                                    timeout=60)
        stream = await client.chat.completions.create(
            model="sim-small", messages=HELLO, max_tokens=40, stream=True, stream_options={"include_usage": True},
            extra_body={"sim": {"output_tokens": 9}})
        chunks = [chunk async for chunk in stream]
        await client.close()
        return chunks

    chunks = asyncio.run(run())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion_text(9)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, 9)
    row = sole_ledger_row()
    assert (row.status, row.usage_source) == ("ok", "pool")
    assert_settled_on(redis_client, caller, row, input_tokens=PROMPT_TOKENS, output_tokens=9)


def test_without_include_usage_no_usage_chunk_reaches_the_caller_but_the_pools_usage_is_billed(platform, caller,
                                                                                                 redis_client):
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=40, stream=True, extra_body={"sim": {"output_tokens": 5}})
    chunks = list(stream)
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == completion_text(5)
    row = sole_ledger_row()
    assert row.usage_source == "pool"
    assert_settled_on(redis_client, caller, row, input_tokens=PROMPT_TOKENS, output_tokens=5)


def test_the_raw_events_are_openais_and_end_with_done(platform, caller):
    with httpx.stream("POST", f"{platform.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {caller.api_key}"},
                      json={"model": "sim-small", "messages": HELLO, "max_tokens": 10, "stream": True,
                            "sim": {"output_tokens": 3}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_refusal_before_the_stream_starts_is_the_usual_json_error(platform, make_caller, redis_client):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=200, max_tokens_cap=400)
    client = sdk(platform, caller.api_key)
    # a ceiling bucket of 15 s x 4,000 TPM = 1,000 tokens, spent down by two
    # calls estimated at prompt + 400
    for _ in range(2):
        client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400,
                                       extra_body={"sim": {"output_tokens": 400}})
    with pytest.raises(openai.RateLimitError) as excinfo:
        client.chat.completions.create(model="sim-small", messages=HELLO, max_tokens=400, stream=True)
    assert excinfo.value.response.headers["content-type"].startswith("application/json")
    assert excinfo.value.code == "workload_tpm"
    assert "retry-after" in excinfo.value.response.headers
    # a prompt over the cap: 413/400 context_length_exceeded, as JSON
    small = make_caller(pool=pool, prompt_tokens_cap=5)
    with pytest.raises(openai.BadRequestError) as excinfo:
        sdk(platform, small.api_key).chat.completions.create(model="sim-small", messages=HELLO, stream=True)
    assert excinfo.value.code == "context_length_exceeded"
    assert UsageRecord.objects.count() == 2  # the two unstreamed calls only


def test_a_pool_refusal_before_the_first_chunk_is_json_and_charges_nothing(platform, caller, redis_client):
    with pytest.raises(openai.APIStatusError) as excinfo:
        sdk(platform, caller.api_key).chat.completions.create(
            model="sim-small", messages=HELLO, max_tokens=10, stream=True, extra_body={"sim": {"fail_status": 500}})
    assert excinfo.value.response.headers["content-type"].startswith("application/json")
    assert excinfo.value.code == "upstream_error"
    row = sole_ledger_row()
    assert (row.status, row.actual_input_tokens, row.actual_output_tokens) == ("upstream_error", 0, 0)
    wid = caller.workload.id
    found = counters(redis_client, caller.pool.id)
    assert (found[f"{wid}.debited_tok"], found[f"{wid}.used_tok"], found["P.debited_tok"]) == (0, 0, 0)


@pytest.mark.redis_cluster
def test_a_caller_that_disconnects_cancels_the_pool_call_within_a_second_and_pays_what_was_produced(
        platform, caller, redis_client):
    # a long generation (1,000 tokens: seconds), still running when the caller leaves
    before = platform.sim_stats()
    with httpx.stream("POST", f"{platform.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {caller.api_key}"},
                      json={"model": "sim-small", "messages": HELLO, "max_tokens": 1000, "stream": True,
                            "sim": {"output_tokens": 1000}}) as response:
        request_id = response.headers["x-request-id"]
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received >= 5:
                break
    closed = time.monotonic()
    # the pool stops generating within a second
    while platform.sim_stats()["aborted"] == before["aborted"]:
        assert time.monotonic() - closed < 1.0, "the pool call was not cancelled within a second"
        time.sleep(0.02)
    row = ledger_row(request_id)
    assert (row.status, row.usage_source) == ("cancelled", "counted")
    # charged the tokens produced: counted from the chunks the worker relayed
    chunks = redis_client.xrange(gateway_keys.request_stream(request_id))
    texts = [json.loads(f["d"])["choices"][0]["delta"].get("content") or "" for _, f in chunks if "d" in f]
    produced = llm_tokens.count_text_tokens("".join(texts))
    assert 4 <= produced < 1000
    # the stream and the cancel flag expire with the request's other keys
    assert 0 < redis_client.pttl(gateway_keys.request_stream_cancel(request_id)) <= platform_result_ttl_ms()
    assert 0 < redis_client.pttl(gateway_keys.request_stream(request_id)) <= platform_result_ttl_ms()
    assert_settled_on(redis_client, caller, row, input_tokens=row.estimated_input_tokens, output_tokens=produced)


def test_an_upstream_error_mid_stream_is_an_error_event_and_charges_what_was_produced(platform, caller, redis_client):
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"sim": {"output_tokens": 30, "fail_after_tokens": 6}})
    texts = []
    with pytest.raises(openai.APIError) as excinfo:
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts) == completion_text(6)
    assert "stream broke off" in excinfo.value.message
    row = sole_ledger_row()
    assert (row.status, row.usage_source, row.error) == ("upstream_error", "counted", "upstream_stream_error")
    assert_settled_on(redis_client, caller, row, input_tokens=row.estimated_input_tokens, output_tokens=6)


def test_the_stream_key_expires_with_the_requests_other_keys(platform, caller, redis_client):
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=10, stream=True, extra_body={"sim": {"output_tokens": 2}})
    list(stream)
    request_id = sole_ledger_row().request_id
    ttl = redis_client.pttl(gateway_keys.request_stream(request_id))
    assert 0 < ttl <= platform_result_ttl_ms()


def test_a_streams_appends_and_its_end_name_it_on_its_web_processs_notice_stream(platform, caller, redis_client):
    # given a stream relayed through the platform's web process and a lane worker
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=10, stream=True, extra_body={"sim": {"output_tokens": 5}})
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 5
    request_id = sole_ledger_row().request_id
    # then its record names the web process's notice stream (its shared read's wake key)
    wake = redis_client.hget(gateway_keys.request_record(request_id), "stream_wake")
    assert wake.startswith("sluice:web:") and wake.endswith(":wake")
    # and the worker's appends and the end marker named the request there (the
    # thread path names one request a notice; the hub one per pass, here alone)
    named = [fields["r"].split() for _, fields in redis_client.xrange(wake) if "r" in fields]
    assert sum(1 for ids in named if request_id in ids) >= 2
    assert 0 < redis_client.pttl(wake) <= 60_000


def platform_result_ttl_ms() -> int:
    from django.conf import settings

    return settings.SLUICE_RESULT_TTL_S * 1000


def test_a_job_that_asks_to_stream_is_refused_in_openais_shape(platform, caller):
    response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=10,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "stream": True})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "stream_unsupported"
    assert response.json()["error"]["param"] == "stream"


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event_and_is_settled_once(platform, caller,
                                                                                             redis_client):
    # given a long stream (1,000 tokens: seconds) whose first chunks arrived
    client = sdk(platform, caller.api_key)
    stream = client.chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=1000, stream=True, extra_body={"sim": {"output_tokens": 1000}})
    texts = []
    try:
        with pytest.raises(openai.APIError) as excinfo:
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "")
                if len(texts) == 5:
                    # when its worker is SIGKILLed mid-stream
                    platform.workers["interactive"].kill()
                    killed_at = time.monotonic()
        # then the caller gets an error event (never a hang) within the
        # heartbeat's TTL plus an interval or two
        answered_in = time.monotonic() - killed_at
    finally:
        platform.start_worker("interactive")
        platform.wait_workers_ready(["interactive"])
    assert answered_in < 10.0
    assert excinfo.value.code == "worker_lost"
    assert 5 <= len(texts) < 1000
    # and it is settled once, on its estimate: nobody knows how far the pool got
    row = sole_ledger_row()
    assert (row.status, row.usage_source) == ("worker_lost", "estimate")
    assert UsageRecord.objects.count() == 1
    assert_settled_on(redis_client, caller, row, input_tokens=row.estimated_input_tokens,
                      output_tokens=row.estimated_output_tokens)
    assert row.estimated_output_tokens == 1000


def test_a_caller_that_leaves_before_the_first_chunk_cancels_the_stream_too(platform, caller, redis_client):
    # given a warm path (the caller's key known) and a stream whose pool
    # takes 1.2 s (6 simulated seconds) to start
    list(sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=5, stream=True, extra_body={"sim": {"output_tokens": 1}}))
    first = sole_ledger_row()
    before = platform.sim_stats()
    with pytest.raises(httpx.ReadTimeout):
        # when the caller gives up after 0.6 s, queued on the pool, before any chunk
        httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=httpx.Timeout(10, read=0.6),
                   headers={"Authorization": f"Bearer {caller.api_key}"},
                   json={"model": "sim-small", "messages": HELLO, "max_tokens": 500, "stream": True,
                         "sim": {"output_tokens": 500, "latency_ms": 6_000}})
    # then the worker closes the pool call at its first chunk
    deadline = time.monotonic() + 10
    while (row := UsageRecord.objects.exclude(request_id=first.request_id).first()) is None:
        assert time.monotonic() < deadline, "no ledger row"
        time.sleep(0.05)
    assert (row.status, row.usage_source) == ("cancelled", "counted")
    assert row.actual_output_tokens <= 1
    deadline = time.monotonic() + 5
    while platform.sim_stats()["aborted"] != before["aborted"] + 1:
        assert time.monotonic() < deadline, "the pool call was not closed"
        time.sleep(0.05)
    # both streams' tokens, as their ledger rows say
    both = row.actual_input_tokens + row.actual_output_tokens + first.actual_input_tokens + first.actual_output_tokens
    found = settled_counters(redis_client, caller, tokens=both)
    assert found[f"{caller.workload.id}.debited_tok"] == found[f"{caller.workload.id}.used_tok"] == both


def test_ledger_and_buckets_match_the_usage_the_pool_reported_for_concurrent_streams(platform, caller, redis_client):
    platform.sim_reset()
    lengths = [3, 11, 29, 64, 1, 47, 20, 8]

    def call(n: int) -> list:
        messages = [{"role": "user", "content": f"Stream number {n}: " + "tell me more " * n}]
        return list(sdk(platform, caller.api_key).chat.completions.create(
            model="sim-small", messages=messages, max_tokens=64, stream=True, stream_options={"include_usage": True},
            extra_body={"sim": {"output_tokens": n}}))

    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        streams = list(executor.map(call, lengths))
    stats = platform.sim_stats()
    pool_total = stats["prompt_tokens"] + stats["completion_tokens"]
    assert stats["completed"] == len(lengths)
    assert stats["completion_tokens"] == sum(lengths)
    assert sum(chunks[-1].usage.total_tokens for chunks in streams) == pool_total
    deadline = time.monotonic() + 10
    while UsageRecord.objects.filter(workload=caller.workload).count() < len(lengths):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rows = list(UsageRecord.objects.filter(workload=caller.workload))
    assert {(r.status, r.usage_source) for r in rows} == {("ok", "pool")}
    assert sum(r.actual_input_tokens + r.actual_output_tokens for r in rows) == pool_total
    wid = caller.workload.id
    found = settled_counters(redis_client, caller, tokens=pool_total)
    assert found[f"{wid}.debited_tok"] == found[f"{wid}.used_tok"] == pool_total


def test_a_worker_stopped_mid_stream_ends_it_within_its_grace_charged_what_was_produced(platform, make_caller,
                                                                                         redis_client):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, max_tokens_cap=4_000)
    # given a stream far longer than the worker's stop grace (3,000 tokens: ~12 s)
    stream = sdk(platform, caller.api_key).chat.completions.create(
        model="sim-small", messages=HELLO, max_tokens=3_000, stream=True, extra_body={"sim": {"output_tokens": 3_000}})
    lane = stream.response.headers["x-sluice-lane"]  # a long request: interactive-long
    worker = platform.workers[lane]
    texts = []
    try:
        with pytest.raises(openai.APIError) as excinfo:
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "")
                if len(texts) == 5:
                    # when its worker is told to stop (SIGTERM, as an orchestrator sends it)
                    stopping = time.monotonic()
                    worker.popen.send_signal(signal.SIGTERM)
        ended_in = time.monotonic() - stopping
        worker.popen.wait(timeout=20)
        stopped_in = time.monotonic() - stopping
    finally:
        platform.start_worker(lane)
        platform.wait_workers_ready([lane])
    # then the stream ends with an error event once the grace (3 s) is over,
    # and the worker exits within 5 s
    assert 2.5 < ended_in < 5.0
    assert stopped_in < 5.0
    assert excinfo.value.code == "worker_shutdown"
    # charged the tokens it relayed, counted: not the 3,000 it might have run
    row = sole_ledger_row()
    assert (row.status, row.usage_source, row.error) == ("upstream_error", "counted", "worker_shutdown")
    chunks = redis_client.xrange(gateway_keys.request_stream(row.request_id))
    texts = [json.loads(f["d"])["choices"][0]["delta"].get("content") or "" for _, f in chunks if "d" in f]
    produced = llm_tokens.count_text_tokens("".join(texts))
    assert 5 <= produced < 3_000
    assert_settled_on(redis_client, caller, row, input_tokens=row.estimated_input_tokens, output_tokens=produced)


def test_a_non_streamed_answer_has_no_time_to_first_token_in_the_ledger(platform, caller):
    raw = sdk(platform, caller.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=HELLO, max_tokens=40, extra_body={"sim": {"output_tokens": 3}})
    row = ledger_row(raw.headers["x-request-id"])
    assert (row.status, row.usage_source, row.ttft_ms) == ("ok", "pool", None)


def test_a_stream_ends_while_the_database_holds_its_ledger_row_which_lands_after(platform, caller, redis_client):
    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    locker = psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "password", "host", "port")},
                             autocommit=False)
    try:
        # given the ledger's table locked by another connection: a row's
        # insert waits (up to the platform's lock_timeout, 10 s)
        locker.execute(f"LOCK TABLE {UsageRecord._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        # when a caller streams
        started = time.monotonic()
        with sdk(platform, caller.api_key).chat.completions.with_streaming_response.create(
            model="sim-small", messages=HELLO, max_tokens=40, stream=True, stream_options={"include_usage": True},
            extra_body={"sim": {"output_tokens": 7}},
        ) as response:
            request_id = response.headers["x-request-id"]
            chunks = list(response.parse())
        ended_s = time.monotonic() - started
        # then its stream ends, usage last, without waiting for the row (with
        # the end marker after the row, it waited for the lock), and the
        # row's insert waits on the lock
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, 7)
        assert ended_s < 5, f"the stream ended after {ended_s:.1f} s"
        waiting = ("SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND granted = false "
                   "AND relation = %s::regclass")
        deadline = time.monotonic() + 3
        while locker.execute(waiting, [UsageRecord._meta.db_table]).fetchone()[0] < 1:
            assert time.monotonic() < deadline, "no insert waited on the lock"
            time.sleep(0.02)
    finally:
        locker.rollback()
        locker.close()
    # and once the lock is gone its row lands, settled on the pool's usage
    row = ledger_row(request_id)
    assert (row.status, row.usage_source) == ("ok", "pool")
    assert_settled_on(redis_client, caller, row, input_tokens=PROMPT_TOKENS, output_tokens=7)
