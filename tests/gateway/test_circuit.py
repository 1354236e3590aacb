"""The pool's circuit breaker (gateway/core/protection/circuit.lua) against a real
Redis: closed -> open after failures in a row, half-open with exactly one
trial, closed at once when the trial succeeds, open again when it fails; and
the worker waiting while it is open."""

from __future__ import annotations

import threading
import time

from budgets.redis.clients import redis_now_ms
from gateway.core.protection.circuit import circuit_gate, circuit_record, circuit_state
from gateway.core.request.records import RequestRecord
from gateway.worker.lane_slot import circuit_wait

POOL = 57


def _open(breaker) -> None:
    for n in range(3):
        circuit_record(pool_id=POOL, holder=f"f{n}", ok=False, detail="HTTP 503")


def _half_open_now(redis_client) -> None:
    """Let the open period end (as if its time had passed)."""
    from gateway.core import keys

    redis_client.hset(keys.pool_circuit(POOL), "open_until_ms", 0)


def test_failures_in_a_row_open_it_and_a_success_between_resets_the_count(redis_client, breaker):
    states = [circuit_record(pool_id=POOL, holder="a", ok=False, detail="HTTP 503") for _ in range(2)]
    circuit_record(pool_id=POOL, holder="b", ok=True)
    states += [circuit_record(pool_id=POOL, holder="c", ok=False, detail="HTTP 502") for _ in range(3)]
    assert states == ["closed", "closed", "closed", "closed", "open"]
    state = circuit_state(pool_id=POOL)
    assert (state.state, state.opened, state.why) == ("open", 1, "3 calls in a row failed, the last: HTTP 502")


def test_while_open_no_call_goes(redis_client, breaker):
    _open(breaker)
    verdict = circuit_gate(pool_id=POOL, holder="r1")
    assert (verdict.go, verdict.state) == (False, "open")
    assert 599_000 < verdict.wait_ms <= 600_000


def test_half_open_lets_exactly_one_trial_and_its_success_closes_for_everyone(redis_client, breaker):
    # given an open circuit whose open period has ended
    _open(breaker)
    _half_open_now(redis_client)

    # when two calls ask
    trial = circuit_gate(pool_id=POOL, holder="trial")
    other = circuit_gate(pool_id=POOL, holder="other")

    # then only the first goes; once it succeeds, everyone does
    assert (trial.go, trial.state) == (True, "half-open")
    assert (other.go, other.state) == (False, "half-open")
    assert circuit_gate(pool_id=POOL, holder="trial").go  # the trial asking again keeps its turn
    assert circuit_record(pool_id=POOL, holder="trial", ok=True) == "closed"
    assert circuit_gate(pool_id=POOL, holder="other").go


def test_a_failed_trial_opens_it_again(redis_client, breaker):
    _open(breaker)
    _half_open_now(redis_client)
    assert circuit_gate(pool_id=POOL, holder="trial").go
    assert circuit_record(pool_id=POOL, holder="trial", ok=False, detail="HTTP 503") == "open"
    assert not circuit_gate(pool_id=POOL, holder="next").go
    assert circuit_state(pool_id=POOL).opened == 2


def test_hundred_threads_at_a_half_open_circuit_send_one_trial(redis_client, breaker):
    from tests.hammer import _hammer

    _open(breaker)
    _half_open_now(redis_client)
    results = _hammer(threads=100, attempts=1, barrier_at=time.time() + 0.2,
                      attempt=lambda n: (n, circuit_gate(pool_id=POOL, holder=f"h{n}").go))
    assert sum(go for _, go in results) == 1


def _record(request_id: str, deadline_ms: float) -> RequestRecord:
    return RequestRecord(request_id=request_id, tenant_id=1, workload_id=1, pool_id=POOL, pool_base_url="",
                         pool_api_key_env="", model="sim-small", lane="interactive", borrowed=False,
                         estimated_input_tokens=1, estimated_output_tokens=1, admitted_ms=redis_now_ms(),
                         deadline_ms=deadline_ms, payload={})


def test_a_worker_waits_while_open_and_goes_when_the_trial_succeeds(redis_client, breaker):
    # given an open circuit, half-open with another call as the trial
    _open(breaker)
    _half_open_now(redis_client)
    assert circuit_gate(pool_id=POOL, holder="trial").go
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (circuit_wait(_record("held", redis_now_ms() + 60_000)), done.set()))
    waiter.start()
    assert not done.wait(0.3)  # still waiting: the trial has not answered

    # when the trial succeeds
    circuit_record(pool_id=POOL, holder="trial", ok=True)

    # then the held call goes
    assert done.wait(10)
    waiter.join()


def test_a_worker_past_its_deadline_goes_anyway(redis_client, breaker):
    _open(breaker)
    started = time.monotonic()
    circuit_wait(_record("late", redis_now_ms() + 200))
    assert time.monotonic() - started < 5


def test_failed_trials_double_the_open_period_up_to_its_cap_and_a_close_resets_it(redis_client, breaker):
    # given open periods of 1 s, at most 4 s
    breaker.SLUICE_CIRCUIT_OPEN_S = 1.0
    breaker.SLUICE_CIRCUIT_OPEN_MAX_S = 4.0

    def open_for_ms() -> float:
        from gateway.core import keys

        return float(redis_client.hget(keys.pool_circuit(POOL), "open_until_ms")) - redis_now_ms()

    def fail_a_trial(n: int) -> None:
        _half_open_now(redis_client)
        assert circuit_gate(pool_id=POOL, holder=f"trial-{n}").go
        assert circuit_record(pool_id=POOL, holder=f"trial-{n}", ok=False, detail="HTTP 503") == "open"

    _open(breaker)
    periods = [open_for_ms()]
    for n in range(3):
        fail_a_trial(n)
        periods.append(open_for_ms())
    # then each failed trial doubles it, and 4 s is the most
    assert [round(p / 1000) for p in periods] == [1, 2, 4, 4]
    # and once a trial succeeds, the next outage starts again from 1 s
    _half_open_now(redis_client)
    assert circuit_gate(pool_id=POOL, holder="ok").go
    assert circuit_record(pool_id=POOL, holder="ok", ok=True) == "closed"
    _open(breaker)
    assert round(open_for_ms() / 1000) == 1
