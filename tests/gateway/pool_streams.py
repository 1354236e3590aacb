"""One streamed pool call made as a lane worker makes it
(gateway/worker/streaming.py ``pool_stream``), for the tests of the
worker's half of a stream against a test pool."""

from __future__ import annotations

import time

from gateway.core.request.records import Outcome, RequestRecord
from gateway.worker import pool_client as pc
from gateway.worker.streaming import pool_stream


def stream_record(request_id: str, base_url: str, stream_wake: str = "") -> RequestRecord:
    return RequestRecord(
        request_id=request_id, tenant_id=1, workload_id=2, pool_id=0, pool_base_url=base_url, pool_api_key_env="",
        model="m", lane="interactive", borrowed=False, estimated_input_tokens=5, estimated_output_tokens=8,
        admitted_ms=0, deadline_ms=0, payload={}, stream=True, stream_usage=True, tokenizer="cl100k_base",
        stream_wake=stream_wake)


def stream_call(request_id: str, base_url: str, model: str, stream_wake: str = "") -> Outcome:
    """Stream ``model``'s answer from the pool at ``base_url`` into the request's Redis Stream
    (``stream_wake``: the waiting web process's notice stream its record names)."""
    client = pc.pool_client(base_url=base_url, api_key_env="")
    return pool_stream(client, stream_record(request_id, base_url, stream_wake), started=time.monotonic(),
                       extra_body=None,
                       payload={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True})
