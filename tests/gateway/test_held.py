"""Work held through an outage (gateway/core/protection/held.py) against a real Redis:
admission holds what it admits while the pool's circuit is open, and a
retry of a held body after; the release gives held work only the provider's
room above its reserve, each entry once however many pacers ask, one at a
time as the circuit's trial while it is open, and never past its deadline."""

from __future__ import annotations

import threading
import time

import pytest

from budgets.admission import keys as budget_keys
from budgets.admission.buckets import admit_call
from budgets.redis.clients import redis_now_ms
from gateway.core import keys
from gateway.core.protection.circuit import circuit_gate, circuit_record
from gateway.core.protection.held import held_release_call, mark_parse, mark_text

pytestmark = pytest.mark.django_db(transaction=True)

POOL = 61


def _open_circuit(pool_id: int) -> None:
    for n in range(3):
        circuit_record(pool_id=pool_id, holder=f"f{n}", ok=False, detail="HTTP 503")


def _chat(platform, caller, n: int):
    """One small chat completion through the platform, answered in full."""
    import httpx

    return httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {caller.api_key}"},
                      json={"model": "sim-small", "max_tokens": 8, "sim": {"output_tokens": 4},
                            "messages": [{"role": "user", "content": f"Question {n}."}]})


def _open_until(redis_client, pool_id: int, *, trial_in_ms: int) -> None:
    """The pool's circuit open, its trial due in ``trial_in_ms``."""
    _open_circuit(pool_id)
    redis_client.hset(keys.pool_circuit(pool_id), "open_until_ms", redis_now_ms() + trial_in_ms)


def _admit(caller, request_id: str, digest: str = ""):
    return admit_call(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=request_id,
                      input_tokens=10, output_tokens=10, lease_ttl_ms=60_000, body_digest=digest).run()


def test_admission_holds_while_the_circuit_is_open_and_a_retried_body_after(make_caller, redis_client, breaker):
    caller = make_caller()
    pool_id = caller.pool.id
    # given a closed circuit: nothing is held, whatever the body
    assert not _admit(caller, "req_a", digest="d1").held
    assert not redis_client.exists(budget_keys.held_body(pool_id, caller.workload.id, "d1"))
    # when the circuit opens
    _open_circuit(pool_id)
    assert redis_client.hget(budget_keys.pool_capacity(pool_id), "hold") == "1"
    # then what is admitted is held, and its body is remembered for a lease's length
    assert _admit(caller, "req_b", digest="d2").held
    ttl = redis_client.pttl(budget_keys.held_body(pool_id, caller.workload.id, "d2"))
    assert 59_000 < ttl <= 60_000
    assert _admit(caller, "req_c").held  # no digest (a job): held while open too
    # when the trial succeeds and the circuit closes
    assert circuit_record(pool_id=pool_id, holder="trial", ok=True) == "closed"
    assert not redis_client.hexists(budget_keys.pool_capacity(pool_id), "hold")
    # then the same body again (a client's retry) is still held, another is not
    assert _admit(caller, "req_d", digest="d2").held
    assert not _admit(caller, "req_e", digest="d3").held
    assert not _admit(caller, "req_f").held
    # and admitting the same request again answers as the first time did
    assert _admit(caller, "req_d", digest="zz").held
    assert not _admit(caller, "req_e", digest="d2").held


def _hold(redis_client, request_id: str, *, tokens: int = 100, deadline_ms: float | None = None) -> None:
    deadline_ms = deadline_ms if deadline_ms is not None else redis_now_ms() + 60_000
    redis_client.zadd(keys.pool_held(POOL), {f"{request_id}|interactive|{tokens}": deadline_ms})


def _provider_says(redis_client, *, remaining_requests: int, limit_requests: int = 100,
                   remaining_tokens: int | None = None, limit_tokens: int = 100_000, sent: int = 40) -> None:
    """The provider's last statement, as provider_limits.lua keeps it, with its resets a minute away."""
    reset_ms = redis_now_ms() + 60_000
    fields = {"prov_rem_req": remaining_requests, "prov_limit_req": limit_requests, "prov_reset_req_ms": reset_ms,
              "prov_reserve": 0.1, "prov_sent": sent, "prov_sent_tok": sent * 100}
    if remaining_tokens is not None:
        fields.update(prov_rem_tok=remaining_tokens, prov_limit_tok=limit_tokens, prov_reset_tok_ms=reset_ms)
    redis_client.hset(budget_keys.pool_capacity(POOL), mapping=fields)


def test_release_takes_the_providers_room_less_what_fresh_work_needs(redis_client, breaker):
    # given 20 held requests, a provider with 15 calls of room, and fresh work
    # arriving at 30 a minute: the next 10 s of it (5 calls) stay for it
    breaker.SLUICE_HELD_PACE_S = 10.0
    for n in range(20):
        _hold(redis_client, f"req_{n}", deadline_ms=redis_now_ms() + 60_000 + n)
    _provider_says(redis_client, remaining_requests=15, limit_requests=1_000)
    redis_client.hset(budget_keys.pool_capacity(POOL),
                      mapping={"fresh_r": 30 / 60_000, "fresh_t": redis_now_ms() + 60_000})
    # when the pacer releases
    left, released = held_release_call(pool_id=POOL).run()
    # then 10 go, earliest deadline first, each with its own mark after the last sent
    assert [r.request_id for r in released] == [f"req_{n}" for n in range(10)]
    assert [(r.mark.sent, r.mark.sent_tokens) for r in released] == [(41 + n, 4_000 + 100 * (n + 1))
                                                                     for n in range(10)]
    assert left == 10
    capacity = redis_client.hgetall(budget_keys.pool_capacity(POOL))
    assert float(capacity["prov_rem_req"]) == 5
    assert (int(capacity["prov_sent"]), int(capacity["prov_sent_tok"])) == (50, 5_000)
    # and nothing more until the provider states more room
    assert held_release_call(pool_id=POOL).run() == (10, [])
    _provider_says(redis_client, remaining_requests=7, limit_requests=1_000, sent=50)
    assert [r.request_id for r in held_release_call(pool_id=POOL).run()[1]] == ["req_10", "req_11"]


def test_release_takes_the_token_room_too(redis_client, breaker):
    _hold(redis_client, "req_big", tokens=5_000, deadline_ms=redis_now_ms() + 60_000)
    _hold(redis_client, "req_small", tokens=100, deadline_ms=redis_now_ms() + 60_001)
    # 4,900 tokens of room: the 5,000-token call does not fit, and nothing passes it
    _provider_says(redis_client, remaining_requests=100, remaining_tokens=4_900)
    assert held_release_call(pool_id=POOL).run() == (2, [])
    _provider_says(redis_client, remaining_requests=100, remaining_tokens=5_100)
    left, released = held_release_call(pool_id=POOL).run()
    assert ([r.request_id for r in released], left) == (["req_big", "req_small"], 0)


def test_release_leaves_the_rate_of_fresh_arrivals_to_them(redis_client, breaker):
    # given ample room in the provider's window (1,000 a minute) and fresh
    # work arriving at 840 a minute: 160 a minute are spare
    breaker.SLUICE_HELD_PACE_S = 10.0
    now_ms = redis_now_ms()
    for n in range(50):
        _hold(redis_client, f"req_{n}", deadline_ms=now_ms + 60_000 + n)
    _provider_says(redis_client, remaining_requests=1_000, limit_requests=1_000)
    # (its time a minute ahead of the clock: the rate does not decay while the test runs)
    redis_client.hset(budget_keys.pool_capacity(POOL), mapping={"fresh_r": 840 / 60_000, "fresh_t": now_ms + 60_000})
    # then the first release takes the pace's 10 s of spare (26 calls), and then nothing
    assert len(held_release_call(pool_id=POOL).run()[1]) == 26
    assert held_release_call(pool_id=POOL).run()[1] == []
    # and 3 s later, 8 more (2.67 a second)
    level_at = float(redis_client.hget(budget_keys.pool_capacity(POOL), "held_t"))
    redis_client.hset(budget_keys.pool_capacity(POOL), "held_t", level_at - 3_000)
    assert len(held_release_call(pool_id=POOL).run()[1]) == 8
    # and when fresh work takes the provider's whole limit, nothing goes
    redis_client.hset(budget_keys.pool_capacity(POOL), mapping={"fresh_r": 1_000 / 60_000, "held_t": 0})
    assert held_release_call(pool_id=POOL).run() == (16, [])


def test_admission_averages_the_rate_of_fresh_arrivals_and_leaves_retries_out(make_caller, redis_client, breaker):
    # given a pool whose fresh rate is averaged over 10 s
    breaker.SLUICE_HELD_PACE_S = 10.0
    caller = make_caller()
    capacity = budget_keys.pool_capacity(caller.pool.id)
    # when 30 requests of 20 tokens are admitted at once, one of them a held body
    redis_client.set(budget_keys.held_body(caller.pool.id, caller.workload.id, "seen"), "1")
    for n in range(30):
        _admit(caller, f"req_{n}", digest="seen" if n == 7 else f"d{n}")
    # then the fresh rate is 29 arrivals over 10 s, in requests and in tokens, per ms
    fresh = redis_client.hgetall(capacity)
    assert float(fresh["fresh_r"]) == pytest.approx(29 / 10_000, rel=0.01)
    assert float(fresh["fresh_rt"]) == pytest.approx(29 * 20 / 10_000, rel=0.01)
    # and while the circuit is open, what arrives fresh still counts (it is
    # held, but it is new work), and a retry of it does not
    _open_circuit(caller.pool.id)
    for n in range(30, 40):
        assert _admit(caller, f"req_{n}", digest=f"d{n}").held
    assert _admit(caller, "req_again", digest="d31").held
    assert float(redis_client.hget(capacity, "fresh_r")) == pytest.approx(39 / 10_000, rel=0.01)


def test_a_provider_that_states_nothing_gets_the_held_work_at_once(redis_client, breaker):
    for n in range(3):
        _hold(redis_client, f"req_{n}")
    left, released = held_release_call(pool_id=POOL).run()
    assert (left, len(released)) == (0, 3)
    assert [r.mark.sent for r in released] == [1, 2, 3]


def test_entries_past_their_deadline_are_dropped_not_released(redis_client, breaker):
    _hold(redis_client, "req_late", deadline_ms=redis_now_ms() - 1)
    _hold(redis_client, "req_live")
    left, released = held_release_call(pool_id=POOL).run()
    assert ([r.request_id for r in released], left) == (["req_live"], 0)


def test_while_open_one_held_request_goes_as_the_trial_when_one_is_due(redis_client, breaker):
    # given an open circuit with held work
    _open_circuit(POOL)
    _hold(redis_client, "req_1", deadline_ms=redis_now_ms() + 60_000)
    _hold(redis_client, "req_2", deadline_ms=redis_now_ms() + 60_001)
    # then nothing goes while it is open
    assert held_release_call(pool_id=POOL).run() == (2, [])
    # when its open period ends
    redis_client.hset(keys.pool_circuit(POOL), "open_until_ms", 0)
    left, released = held_release_call(pool_id=POOL).run()
    # then one goes, untaken (its worker's gate makes it the trial), and no second meanwhile
    assert ([(r.request_id, r.mark) for r in released], left) == ([("req_1", None)], 1)
    assert held_release_call(pool_id=POOL).run() == (1, [])
    assert circuit_gate(pool_id=POOL, holder="req_1").go
    assert held_release_call(pool_id=POOL).run() == (1, [])
    # and once the trial succeeds, the rest is released as room allows
    circuit_record(pool_id=POOL, holder="req_1", ok=True)
    assert [r.request_id for r in held_release_call(pool_id=POOL).run()[1]] == ["req_2"]


def test_pacers_releasing_at_once_release_each_entry_once_within_the_room(redis_client, breaker):
    # given 200 held requests and room for 30
    for n in range(200):
        _hold(redis_client, f"req_{n}", deadline_ms=redis_now_ms() + 60_000 + n)
    _provider_says(redis_client, remaining_requests=30, limit_requests=1_000)
    released: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def pacer() -> None:
        start.wait()
        for _ in range(5):
            _, out = held_release_call(pool_id=POOL, most=4).run()
            with lock:
                released.extend(r.request_id for r in out)

    threads = [threading.Thread(target=pacer) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # then exactly 30 went, each once, the earliest deadlines
    assert sorted(released, key=lambda r: int(r.split("_")[1])) == [f"req_{n}" for n in range(30)]
    assert redis_client.zcard(keys.pool_held(POOL)) == 170
    assert float(redis_client.hget(budget_keys.pool_capacity(POOL), "prov_rem_req")) == 0


def test_a_mark_travels_as_text_and_back():
    released = held_release_call(pool_id=POOL).parse([1, "req_x|batch|12", "7 900 1234.500"])
    assert released[0] == 1
    mark = released[1][0].mark
    assert mark_parse(mark_text(mark)) == mark
    assert (released[1][0].lane, mark.sent, mark.sent_tokens, mark.at_ms) == ("batch", 7, 900, 1234.5)
    assert mark_parse("") is None


def test_requests_admitted_while_open_wait_off_their_lane_and_each_calls_once_when_it_closes(
        platform, make_caller, redis_client, breaker):
    import concurrent.futures

    from gateway.core.lanes import queue_for_lane
    from tests.gateway.ledger import ledger_rows

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, queue_timeout_s=30.0)
    platform.sim_reset()
    # given the pool's circuit open, its trial not due for 4 s
    _open_until(redis_client, pool.id, trial_in_ms=4_000)
    with concurrent.futures.ThreadPoolExecutor(6) as executor:
        # when six requests arrive while it is open
        futures = [executor.submit(_chat, platform, caller, n) for n in range(6)]
        deadline = redis_now_ms() + 3_000
        while redis_client.zcard(keys.pool_held(pool.id)) < 6:
            assert redis_now_ms() < deadline, "the requests were not held"
            time.sleep(0.02)
        # then they wait in the pool's held set, none on its lane, none at the pool
        assert redis_client.llen(queue_for_lane("interactive")) == 0
        assert platform.sim_stats()["requests_total"] == 0
        # and when the trial is due, one goes as the trial, its success closes
        # the circuit, and the rest follow: every caller answered, each call made once
        statuses = [future.result().status_code for future in futures]
    assert statuses == [200] * 6
    assert platform.sim_stats()["requests_total"] == 6
    assert redis_client.zcard(keys.pool_held(pool.id)) == 0
    rows = ledger_rows(6, workload=caller.workload)
    assert sorted((r.status, r.attempts) for r in rows) == [("ok", 1)] * 6


def test_held_requests_are_released_while_the_database_holds_the_pacers_step(
        platform, make_caller, redis_client, breaker):
    import concurrent.futures
    import uuid

    import psycopg
    from django.db import connection

    from gateway.models import Job

    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    caller = make_caller(pool=pool, queue_timeout_s=30.0)
    platform.sim_reset()
    params = connection.get_connection_params()
    locker = psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "password", "host", "port")},
                             autocommit=False)
    try:
        # given the pacer's step held by the database: a job due now whose
        # row it reads, the jobs table locked by another connection (its
        # query waits up to the platform's lock_timeout, 10 s)
        locker.execute(f"LOCK TABLE {Job._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        job_id = str(uuid.uuid4())
        redis_client.zadd(keys.DELAYED_JOBS, {job_id: redis_now_ms() - 1})
        deadline = time.monotonic() + 5
        while redis_client.zscore(keys.DELAYED_JOBS, job_id) is not None:  # the pacer took it: its step waits
            assert time.monotonic() < deadline, "the pacer did not take the due job"
            time.sleep(0.02)
        # and the pool's circuit open, its trial due in a second
        _open_until(redis_client, pool.id, trial_in_ms=1_000)
        with concurrent.futures.ThreadPoolExecutor(4) as executor:
            # when four requests arrive and are held
            futures = [executor.submit(_chat, platform, caller, n) for n in range(4)]
            # then every caller is answered while the lock still holds the
            # pacer's step (well inside its 10 s lock_timeout: with the held
            # releases in that step, none is answered before it gives up)
            statuses = [future.result(timeout=8).status_code for future in futures]
        assert statuses == [200] * 4
        assert redis_client.zcard(keys.pool_held(pool.id)) == 0
        assert locker.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND granted = false "
                              "AND relation = %s::regclass", [Job._meta.db_table]).fetchone()[0] >= 1
    finally:
        locker.rollback()
        locker.close()
