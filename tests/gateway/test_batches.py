"""The Batch API through the real platform with the official openai SDK:
files uploaded to Django's storage, a batch validated by a housekeeping
task, its lines fed by the pacer as jobs on the batch lane, run on the
simulated pool, settled into the ledger, and written back as OpenAI's output
and error files keyed by custom_id."""

from __future__ import annotations

import io
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
