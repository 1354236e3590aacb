"""Idempotency-Key on POST /v1/chat/completions."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from budgets.models import UsageRecord

from tests.gateway.ledger import ledger_rows

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "once, please"}], "max_tokens": 12}


def post(platform, api_key, body, key):
    return httpx.post(f"{platform.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key})


@pytest.mark.redis_cluster
def test_same_key_same_body_runs_once_and_replays(platform, make_caller):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    platform.sim_reset()
    # when the same request is sent three times concurrently with one key
    with concurrent.futures.ThreadPoolExecutor(3) as executor:
        responses = list(executor.map(lambda _: post(platform, caller.api_key, BODY, "order-42"), range(3)))
    # then all get the same completion, and the pool saw one call
    assert {r.status_code for r in responses} == {200}
    assert len({r.json()["id"] for r in responses}) == 1
    assert sum(r.headers.get("x-sluice-idempotent-replay") == "true" for r in responses) == 2
    assert platform.sim_stats()["requests_total"] == 1
    assert len(ledger_rows(1, workload=caller.workload)) == 1


def test_same_key_other_body_is_409(platform, make_caller):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"))
    assert post(platform, caller.api_key, BODY, "k").status_code == 200
    response = post(platform, caller.api_key, {**BODY, "max_tokens": 13}, "k")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "idempotency_key_reused"


def test_a_refused_request_does_not_burn_its_key(platform, make_caller):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), reserved_tpm=400,
                         ceiling_tpm=400, prompt_tokens_cap=50, max_tokens_cap=50)  # 100-token bucket
    assert post(platform, caller.api_key, {**BODY, "max_tokens": 50}, "a").status_code == 200
    refused = post(platform, caller.api_key, {**BODY, "max_tokens": 50}, "b")
    assert refused.status_code == 429
    # the key was released: the same request with the same key may try again
    assert post(platform, caller.api_key, {**BODY, "max_tokens": 50}, "b").status_code in {200, 429}
    assert UsageRecord.objects.filter(workload=caller.workload).count() <= 2
