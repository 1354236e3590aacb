"""A worker's first round trip of a delivery (gateway/core/request/records.py
record_claim_steps): the record read and, only when there is one, claimed
with the record's own deadlines, in one script: on a single Redis and on a
cluster (the keys share the request's tag)."""

from __future__ import annotations

import pytest

from budgets.redis.clients import redis_now_ms
from budgets.redis.composition import RoundTrip
from gateway.core import keys
from gateway.core.request.records import EXPIRED, WORKER, RequestRecord, record_claim_steps

pytestmark = pytest.mark.redis_cluster


def _record(request_id: str, *, deadline_ms: float, retry_deadline_ms: float = 0.0) -> RequestRecord:
    return RequestRecord(
        request_id=request_id, tenant_id=1, workload_id=2, pool_id=3, pool_base_url="http://pool/v1",
        pool_api_key_env="", model="m", lane="interactive", borrowed=False, estimated_input_tokens=1,
        estimated_output_tokens=1, admitted_ms=deadline_ms - 10_000, deadline_ms=deadline_ms,
        retry_deadline_ms=retry_deadline_ms, payload={"messages": []},
    )


def _store(redis_client, record: RequestRecord) -> None:
    redis_client.hset(keys.request_record(record.request_id), mapping=record.to_redis())


def test_no_record_no_claim(redis_client):
    answers = RoundTrip(*record_claim_steps("req_nothere", generation=0, holder="w@h:1")).run()
    data, claim = answers["record"], answers["claim"]
    assert data == {} and claim is None
    assert not redis_client.exists(keys.request_owner("req_nothere"))


def test_a_record_is_read_whole_and_claimed_on_its_own_deadlines(redis_client):
    now = redis_now_ms()
    fresh, late = _record("req_fresh", deadline_ms=now + 60_000), _record("req_late", deadline_ms=now - 1_000)
    for record in (fresh, late):
        _store(redis_client, record)
    answers = RoundTrip(*record_claim_steps("req_fresh", generation=0, holder="w@h:1")).run()
    data, claim = answers["record"], answers["claim"]
    assert RequestRecord.from_redis(data) == fresh
    assert (claim.verdict, claim.changed) == (WORKER, True)
    assert redis_client.get(keys.request_owner("req_fresh")) == "worker:0"
    # a record whose queue deadline has passed: the claim read it from the record
    claim = RoundTrip(*record_claim_steps("req_late", generation=0, holder="w@h:1")).run()["claim"]
    assert claim.verdict == EXPIRED
    redis_client.delete(*(keys.request_record(r) for r in ("req_fresh", "req_late")),
                        keys.request_owner("req_fresh"), keys.request_owner("req_late"),
                        keys.request_heartbeat("req_fresh"))
