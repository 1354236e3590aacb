"""The Batch API through the real platform with the official openai SDK:
files uploaded to Django's storage, a batch validated by a housekeeping
task, its lines fed by the pacer as jobs on the batch lane, run on the
simulated pool, settled into the ledger, and written back as OpenAI's output
and error files keyed by custom_id."""

from __future__ import annotations

import io
import os
import socket
import json
import time
from datetime import timedelta
from decimal import Decimal

import httpx
import openai
import pytest
from django.utils import timezone

from budgets.models import ModelPrice, UsageRecord
from gateway.models import Batch, Job

from tests.gateway.sdk_calls import sdk

pytestmark = pytest.mark.django_db(transaction=True)

SERVED = ["sim-small", "sim-large", "sim-embed"]


@pytest.fixture
def batcher(platform, make_caller):
    """A workload on the platform's simulator that may call sim-small and
    sim-embed (not sim-large), with prices on both."""
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=SERVED)
    since = timezone.now() - timedelta(days=1)
    for model, price_in, price_out in (("sim-small", "1", "2"), ("sim-embed", "0.02", "0")):
        ModelPrice.objects.create(model=model, pool=pool, input_per_million=Decimal(price_in),
                                  output_per_million=Decimal(price_out), effective_from=since)
    caller = make_caller(pool=pool, reserved_tpm=600_000, ceiling_tpm=800_000, rpm=6_000)
    caller.workload.allowed_models = ["sim-small", "sim-embed"]
    caller.workload.save(update_fields=["allowed_models"])
    return caller


def chat_line(custom_id: str, text: str = "hello", max_tokens: int = 8, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim-small", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     **body}}


def jsonl(items) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def batch_wait(client: openai.OpenAI, batch_id: str, *, until=("completed", "failed", "expired", "cancelled"),
               timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions", **extra):
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)


def test_a_chat_batch_completes_with_an_output_line_and_a_ledger_row_per_request(platform, batcher):
    client = sdk(platform, batcher.api_key)
    items = [chat_line(f"req-{i}", text=f"question number {i}") for i in range(20)]
    batch = submit(client, jsonl(items), metadata={"purpose": "nightly"})
    assert batch.status == "validating"
    assert batch.metadata == {"purpose": "nightly"}
    done = batch_wait(client, batch.id)
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 20, 0)
    assert done.error_file_id is None
    output = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(20)]
    request_ids = {line["response"]["request_id"] for line in output}
    rows = {row.request_id: row for row in UsageRecord.objects.filter(request_id__in=request_ids)}
    assert len(rows) == 20
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        row = rows[line["response"]["request_id"]]
        assert (row.actual_input_tokens, row.actual_output_tokens) == (
            body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
        assert row.status == "ok" and row.endpoint == "/v1/chat/completions"
    # Every line ran on the batch lane as a job of the batch.
    assert set(Job.objects.filter(batch_id=batch.id).values_list("status", flat=True)) == {"succeeded"}
    assert {row.lane for row in rows.values()} == {"batch"}


@pytest.mark.timeout(900)
def test_ten_thousand_lines_complete_with_ten_thousand_ledger_rows_and_matching_output(platform, batcher):
    client = sdk(platform, batcher.api_key)
    count = int(os.environ.get("SLUICE_TEST_BATCH_LINES", "10000"))
    items = [chat_line(f"line-{i:05d}", text=f"item {i}", max_tokens=4) for i in range(count)]
    batch = submit(client, jsonl(items))
    started = time.monotonic()
    done = batch_wait(client, batch.id, timeout_s=900)
    elapsed = time.monotonic() - started
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (count, count, 0)
    output = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [item["custom_id"] for item in items]
    request_ids = [line["response"]["request_id"] for line in output]
    assert len(set(request_ids)) == count
    rows = UsageRecord.objects.filter(request_id__in=request_ids, status="ok")
    assert rows.count() == count
    tokens = sum(line["response"]["body"]["usage"]["total_tokens"] for line in output)
    ledger = sum(r.actual_input_tokens + r.actual_output_tokens for r in rows.only("actual_input_tokens",
                                                                                   "actual_output_tokens"))
    assert ledger == tokens
    assert done.usage.total_tokens == tokens
    print(f"10,000 lines in {elapsed:.0f} s")


def test_an_embeddings_batch_runs_and_a_line_for_a_model_the_workload_may_not_use_goes_to_the_error_file(
        platform, batcher):
    client = sdk(platform, batcher.api_key)
    items = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "sim-embed", "input": f"document number {i}"}} for i in range(5)]
    items.insert(2, {"custom_id": "forbidden", "method": "POST", "url": "/v1/embeddings",
                     "body": {"model": "sim-large", "input": "not this model"}})
    done = batch_wait(client, submit(client, jsonl(items), endpoint="/v1/embeddings").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    output = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"doc-{i}" for i in range(5)]
    assert all(line["response"]["body"]["object"] == "list" for line in output)
    errors = lines_of(client, done.error_file_id)
    assert [line["custom_id"] for line in errors] == ["forbidden"]
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    rows = UsageRecord.objects.filter(request_id__in=[line["response"]["request_id"] for line in output])
    assert rows.count() == 5 and {row.endpoint for row in rows} == {"/v1/embeddings"}
    assert done.usage.total_tokens == sum(line["response"]["body"]["usage"]["total_tokens"] for line in output)


HOSTILE = {
    "not JSONL": (b"this is not json\n{\"also\": \n", "invalid_json_line", 1),
    "a line over the size limit": (
        jsonl([chat_line("ok")]) + json.dumps(chat_line("huge", text="x" * (1024 * 1024 + 10))).encode() + b"\n",
        "line_too_large", 2),
    "an unknown endpoint in a line": (
        jsonl([chat_line("a"), {**chat_line("b"), "url": "/v1/images/generations"}]), "invalid_url", 2),
    "duplicate custom_ids": (jsonl([chat_line("same"), chat_line("other"), chat_line("same")]),
                             "duplicate_custom_id", 3),
    "a line without custom_id": (jsonl([{"method": "POST", "url": "/v1/chat/completions", "body": {}}]),
                                 "missing_required_parameter", 1),
    "a GET line": (jsonl([{**chat_line("a"), "method": "GET"}]), "invalid_method", 1),
    "binary garbage": (bytes(range(256)) * 10 + b"\n", "invalid_json_line", 1),
    "a JSON array line": (b"[1, 2, 3]\n", "invalid_json_line", 1),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_fails_the_batch_with_openais_code_and_the_line_and_runs_nothing(platform, batcher, case):
    content, code, line = HOSTILE[case]
    client = sdk(platform, batcher.api_key)
    done = batch_wait(client, submit(client, content).id)
    assert done.status == "failed"
    assert (done.errors.data[0].code, done.errors.data[0].line) == (code, line)
    assert done.output_file_id is None and done.error_file_id is None
    assert not Job.objects.filter(batch_id=done.id).exists()
    assert not UsageRecord.objects.filter(workload=batcher.workload).exists()


def test_refused_lines_get_the_error_a_direct_call_would_and_the_rest_run(platform, batcher):
    client = sdk(platform, batcher.api_key)
    items = [chat_line("fine"), chat_line("bad-temperature", temperature=9),
             {**chat_line("stream"), "body": {**chat_line("stream")["body"], "stream": True}},
             {**chat_line("no-messages"), "body": {"model": "sim-small"}}]
    done = batch_wait(client, submit(client, jsonl(items)).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 3)
    errors = {line["custom_id"]: line["response"] for line in lines_of(client, done.error_file_id)}
    assert set(errors) == {"bad-temperature", "stream", "no-messages"}
    assert all(response["status_code"] == 400 for response in errors.values())
    assert errors["stream"]["body"]["error"]["code"] == "stream_unsupported"


@pytest.mark.parametrize("body, param", [
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "file-x", "endpoint": "/v1/images", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "24h",
      "metadata": {"k": 1}}, "metadata"),
    ({"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "24h", "extra": 1}, "extra"),
])
def test_a_bad_batch_request_is_a_400_naming_its_parameter(platform, batcher, body, param):
    response = httpx.post(f"{platform.base_url}/v1/batches", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {batcher.api_key}"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_uploads_are_checked(platform, batcher):
    client = sdk(platform, batcher.api_key)
    with pytest.raises(openai.BadRequestError) as empty:
        client.files.create(file=("e.jsonl", io.BytesIO(b"")), purpose="batch")
    assert empty.value.code == "empty_file"
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="fine-tune")
    assert purpose.value.code == "invalid_purpose"
    headers = {"Authorization": f"Bearer {batcher.api_key}"}
    missing = httpx.post(f"{platform.base_url}/v1/files", data={"purpose": "batch"}, headers=headers, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    broken = httpx.post(f"{platform.base_url}/v1/files", content=b"--x\r\nContent-Disposition: form-data; na",
                        headers={**headers, "Content-Type": "multipart/form-data; boundary=x"}, timeout=30)
    assert broken.status_code == 400 and broken.json()["error"]["param"] in ("file", "purpose")
    no_boundary = httpx.post(f"{platform.base_url}/v1/files", content=b"abc", timeout=30,
                             headers={**headers, "Content-Type": "multipart/form-data"})
    assert no_boundary.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_files_and_batches_are_the_workloads_own(platform, batcher, make_caller):
    client = sdk(platform, batcher.api_key)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    other = sdk(platform, make_caller(pool=batcher.pool).api_key)
    for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                 lambda: other.files.delete(uploaded.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in other.batches.list()] == []
    assert [f.id for f in other.files.list()] == []
    # the owner still has both; its file's bytes are what it sent
    assert client.files.content(uploaded.id).content == jsonl([chat_line("a")])
    assert client.files.retrieve(uploaded.id).bytes == len(jsonl([chat_line("a")]))
    batch_wait(client, batch.id)
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_batches_list_newest_first_in_pages(platform, batcher):
    client = sdk(platform, batcher.api_key)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    ids = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2).iter_pages().__next__().data] == ids[::-1][:2]
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # the SDK follows the pages


def slow_line(custom_id: str) -> dict:
    # 2,000 ms of simulated latency: 0.4 s at the session simulator's time scale.
    return chat_line(custom_id, sim={"latency_ms": 2000, "output_tokens": 3})


def test_cancel_stops_new_lines_and_bills_only_what_ran(platform, batcher):
    client = sdk(platform, batcher.api_key)
    items = [slow_line(f"c-{i}") for i in range(300)]
    batch = submit(client, jsonl(items))
    batch_wait(client, batch.id, until=("in_progress",))
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = batch_wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    ran = lines_of(client, done.output_file_id)
    stopped = lines_of(client, done.error_file_id)
    assert 5 <= len(ran) < 300
    assert len(ran) + len(stopped) == 300
    assert {line["error"]["code"] for line in stopped} == {"batch_cancelled"}
    # billed: exactly the lines that ran
    rows = UsageRecord.objects.filter(workload=batcher.workload, status="ok")
    assert sorted(r.request_id for r in rows) == sorted(line["response"]["request_id"] for line in ran)
    assert done.usage.total_tokens == sum(line["response"]["body"]["usage"]["total_tokens"] for line in ran)
    # a second cancel answers the batch as it is
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_a_batch_past_its_window_expires_its_lines_not_started(platform, batcher):
    client = sdk(platform, batcher.api_key)
    batch = submit(client, jsonl([slow_line(f"e-{i}") for i in range(300)]))
    batch_wait(client, batch.id, until=("in_progress",))
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now())
    done = batch_wait(client, batch.id)
    assert done.status == "expired" and done.expired_at
    ran = lines_of(client, done.output_file_id)
    expired = lines_of(client, done.error_file_id)
    assert len(ran) + len(expired) == 300 and len(expired) > 0
    assert {line["error"]["code"] for line in expired if line["error"]} == {"batch_expired"}


def test_the_plan_says_at_creation_when_the_budget_cannot_finish_within_the_window(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=SERVED)
    tiny = make_caller(pool=pool, reserved_tpm=30_000, ceiling_tpm=30_000, rpm=1)  # 3,000 lines: 50 h
    client = sdk(platform, tiny.api_key)
    batch = submit(client, jsonl([chat_line(f"p-{i}") for i in range(3000)]))
    plan = batch.model_extra["sluice"]["plan"]
    assert plan["fits_window"] == "no" and plan["basis"] == "file size"
    assert "Cannot finish within the completion window" in plan["note"]
    client.batches.cancel(batch.id)


def test_a_batch_survives_its_pacer_and_its_worker_being_killed_and_runs_no_line_twice(
        platform, batcher, redis_client, tmp_path):
    from llm_platform import processes
    from tests.platform_harness import Process

    client = sdk(platform, batcher.api_key)
    count = 200
    batch = submit(client, jsonl([slow_line(f"r-{i:03d}") for i in range(count)]))
    batch_wait(client, batch.id, until=("in_progress",))

    def completed() -> int:
        return client.batches.retrieve(batch.id).request_counts.completed

    deadline = time.monotonic() + 60
    while completed() < 10:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # when the pacer dies without a chance to clean up, and comes back
    platform.pacer.kill()
    time.sleep(1.0)
    platform.start_pacer()
    # and the batch lane's worker dies mid-call, replaced by one whose broker
    # hands unacknowledged messages back after 6 s
    env = {**platform.env, "SLUICE_VISIBILITY_TIMEOUT_S": "6", "SLUICE_TASK_TIME_LIMIT_S": "5",
           "SLUICE_UNACKED_RESTORE_INTERVAL_S": "1"}
    platform.workers["batch"].kill()
    platform.workers.pop("batch")
    redis_client.hdel("sluice:workers:ready", f"batch@{socket.gethostname()}")
    replacement = Process("batch-replacement", processes.worker_command(lane="batch", concurrency=8), env,
                          tmp_path).start()
    try:
        done = batch_wait(client, batch.id, timeout_s=240)
    finally:
        replacement.stop()
        platform.start_worker("batch")
        platform.wait_workers_ready(["batch"])
    # then every line ran and was billed once
    assert done.status == "completed", done.request_counts
    output = lines_of(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == [f"r-{i:03d}" for i in range(count)]
    rows = UsageRecord.objects.filter(workload=batcher.workload, status="ok")
    assert rows.count() == count
    assert sorted(r.request_id for r in rows) == sorted(line["response"]["request_id"] for line in output)
    assert done.usage.total_tokens == sum(line["response"]["body"]["usage"]["total_tokens"] for line in output)
