"""A pool's reachability against a real Redis: probes recorded by probe.lua,
folded into admission (admit.lua reads the capacity hash it reads anyway):
a pool that failed its probes admits nothing, others carry on, and the mark
lapses by itself when probing stops."""

from __future__ import annotations

import time
import uuid

import pytest

from budgets.admission import keys
from budgets.admission.buckets import admit, settle
from budgets.admission.pool_status import pool_probe_record_call, pool_status
from budgets.errors import Rejected

pytestmark = pytest.mark.django_db(transaction=True)

LEASE_MS = 600_000


def try_admit(caller, *, tokens: int = 100):
    try:
        return admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=uuid.uuid4().hex,
                     input_tokens=0, output_tokens=tokens, lease_ttl_ms=LEASE_MS)
    except Rejected as rejected:
        return rejected


def probe(pool, *, ok: bool, interval_s: float = 5.0, failures_to_down: int = 2, detail: str = "") -> float:
    return pool_probe_record_call(pool_id=pool.id, ok=ok, detail=detail or ("HTTP 200" if ok else "ConnectError"),
                                  latency_ms=3, interval_s=interval_s, failures_to_down=failures_to_down).run()


def test_failures_in_a_row_mark_the_pool_down_and_one_success_clears_it(make_caller, redis_client):
    pool = make_caller.pool()
    # never probed: available (fail open)
    assert pool_status(pool_id=pool.id).available is True
    assert pool_status(pool_id=pool.id).probed is False
    # one failure is not enough
    assert probe(pool, ok=False) == 0.0
    first = pool_status(pool_id=pool.id)
    assert (first.available, first.probed, first.last_probe_ok, first.failures_in_a_row) == (True, True, False, 1)
    # the second marks it down for three intervals from now
    before_ms = time.time() * 1000
    down_until = probe(pool, ok=False, detail="ConnectError: refused")
    assert before_ms + 15_000 - 1_000 < down_until < before_ms + 15_000 + 1_000
    status = pool_status(pool_id=pool.id)
    assert (status.available, status.failures_in_a_row, status.detail) == (False, 2, "ConnectError: refused")
    capacity = redis_client.hgetall(keys.pool_capacity(pool.id))
    assert float(capacity["down_until_ms"]) == down_until
    assert float(capacity["probe_next_ms"]) == pytest.approx(down_until - 10_000, abs=1)
    # one success clears it
    assert probe(pool, ok=True) == 0.0
    status = pool_status(pool_id=pool.id)
    assert (status.available, status.last_probe_ok, status.failures_in_a_row) == (True, True, 0)
    assert "down_until_ms" not in redis_client.hgetall(keys.pool_capacity(pool.id))


def test_a_pool_marked_down_rejects_its_workloads_with_503_and_others_carry_on(make_caller, redis_client):
    # given two pools, one of which failed its probes
    dead = make_caller(pool=make_caller.pool())
    alive = make_caller(pool=make_caller.pool())
    probe(dead.pool, ok=False)
    probe(dead.pool, ok=False)
    probe(alive.pool, ok=True)
    # when each workload asks for budget
    refused = try_admit(dead)
    admitted = try_admit(alive)
    # then the dead pool's workload is told to come back after the next probe,
    # and nothing was debited for it
    assert isinstance(refused, Rejected)
    assert (refused.reason, refused.status, refused.error_type) == ("pool_unavailable", 503, "service_unavailable")
    assert 4_000 < refused.retry_after_ms <= 5_000
    assert refused.retry_after_s == 5
    counters = redis_client.hgetall(keys.pool_counters(dead.pool.id))
    assert counters.get(f"{dead.workload.id}.admitted_req") is None
    assert redis_client.zcard(keys.pool_leases(dead.pool.id)) == 0
    assert not isinstance(admitted, Rejected)
    # and once a probe succeeds the same workload is admitted again
    probe(dead.pool, ok=True)
    assert not isinstance(try_admit(dead), Rejected)


def test_a_request_too_large_for_ever_is_still_told_so_on_a_down_pool(make_caller):
    caller = make_caller(reserved_tpm=24_000, ceiling_tpm=24_000)  # bucket capacity 6,000 tokens
    probe(caller.pool, ok=False, failures_to_down=1)
    rejected = try_admit(caller, tokens=50_000)
    assert (rejected.reason, rejected.status, rejected.retry_after_ms) == ("request_too_large", 413, None)


def test_the_down_mark_lapses_when_probing_stops(make_caller):
    # given a pool marked down by a prober probing every 0.2 s, which then stops
    caller = make_caller()
    probe(caller.pool, ok=False, interval_s=0.2, failures_to_down=1)
    assert try_admit(caller).reason == "pool_unavailable"
    # then within three intervals the pool admits again (fail open)
    deadline = time.monotonic() + 5
    while isinstance(outcome := try_admit(caller), Rejected):
        assert outcome.reason == "pool_unavailable"
        assert time.monotonic() < deadline, "the down mark never lapsed"
        time.sleep(0.05)
    assert pool_status(pool_id=caller.pool.id).available is True


def test_requests_admitted_before_the_pool_went_down_still_settle(make_caller, redis_client):
    caller = make_caller()
    admission = admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id="req_before",
                      input_tokens=0, output_tokens=500, lease_ttl_ms=LEASE_MS)
    probe(caller.pool, ok=False, failures_to_down=1)
    settled = settle(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=admission.request_id,
                     actual_input_tokens=0, actual_output_tokens=120)
    assert settled.settled is True
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0
    counters = redis_client.hgetall(keys.pool_counters(caller.pool.id))
    assert int(counters[f"{caller.workload.id}.debited_tok"]) == 120
