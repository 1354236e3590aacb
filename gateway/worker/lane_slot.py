"""What gates one pool call in the worker: one of the lane's slots on the
pool for the length of the call (the adaptive long-lane limit,
gateway/core/protection/concurrency.py), and the provider's reset when its last answer
said it has no room (budgets/admission/provider_limits.py); and, after the
call, what it tells the lane limit.

A request that finds its lane's slots all taken waits, polling Redis with a
short backoff, until a slot frees or its deadline passes. Past its deadline
it calls the pool anyway (fail open): the limit may delay a long request, it
must never fail one that FIFO would have completed. A stopping worker stops
waiting the same way (its call is then cut off or finished by the shutdown
grace, gateway/worker/shutdown.py)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from budgets.admission.provider_limits import ProviderTake, SentMark, provider_take_call
from budgets.redis.clients import redis_now_ms
from budgets.redis.composition import RoundTrip, Step, answered
from budgets.redis.scripts import ScriptCall
from gateway.core.protection.circuit import CircuitVerdict, circuit_gate, circuit_gate_call, circuit_record_call
from gateway.core.protection.concurrency import (SIGNAL_LANE, lane_limit_call, lane_limited, slot_acquire_call,
                                                 slot_release, slot_wait_end)
from gateway.core.lanes import BATCH, SCHEDULED
from gateway.core.request.records import Outcome, RequestRecord
from gateway.worker.shutdown import pause

logger = logging.getLogger(__name__)

POLL_FIRST_S = 0.005
POLL_MAX_S = 0.05


def slot_wait(*, pool_id: int, lane: str, holder: str, deadline_ms: float,
              rng: random.Random | None = None) -> bool:
    """Take a slot, waiting for one up to ``deadline_ms`` (Redis clock).
    True: a slot is held (release it); False: none was (the deadline passed
    or the worker is stopping), and the call goes ahead without one."""
    rng = rng or random.Random()
    delay = POLL_FIRST_S
    call = slot_acquire_call(pool_id=pool_id, lane=lane, holder=holder)
    while True:
        grant = call.run()
        if grant.taken:
            return True
        if deadline_ms and grant.now_ms >= deadline_ms:
            logger.info("request %s: no %s slot before its deadline (%d held, limit %.2f); calling anyway",
                        holder, lane, grant.held, grant.limit)
            slot_wait_end(pool_id=pool_id, lane=lane, holder=holder)
            return False
        # Waiters are served in the order they first asked
        # (gateway/core/protection/slot_acquire.lua);
        # the jitter only spreads their polls. A slot that is free but spaced
        # is asked again when the spacing says, jittered the same way.
        if not pause(grant.spacing_wait_ms / 1000 + rng.uniform(0, delay)):
            slot_wait_end(pool_id=pool_id, lane=lane, holder=holder)
            return False
        delay = min(POLL_MAX_S, delay * 2)


class CircuitOpen(Exception):
    """The pool's circuit said wait, and the request has another pool of
    its route to move to (gateway/worker/failover.py) instead of waiting."""


@dataclass
class SlotHold:
    """One pool call's slot: whether it got one, and how many of the lane's
    slots were in use when it ended (its own included; 0 without a slot);
    and the call's mark from its take of the provider's room (None: it went
    untaken), which goes with the call: its answer's x-ratelimit-* statement
    is ordered and corrected by it (budgets/admission/provider_limits.lua)."""

    held: bool = False
    in_use: int = 0
    mark: SentMark | None = None


@dataclass(frozen=True)
class GateAsked:
    """The circuit's gate and the provider's take, already asked for this
    call (with the delivery's claim: gateway/worker/execution.py): the take
    is None when the gate said wait (it was not run)."""

    verdict: CircuitVerdict
    take: ProviderTake | None


def call_gate_steps(*, pool_id: int, tokens: int, lane: str, borrowed: bool, holder: str,
                    only_if=None) -> tuple[Step, Step]:
    """The ``gate`` (the pool's circuit) and the ``take`` (the provider's
    room) of one pool call: the room is taken only if the gate says go.
    ``only_if``: the gate's own condition, in a longer round trip."""
    return (Step("gate", circuit_gate_call(pool_id=pool_id, holder=holder), only_if=only_if),
            Step("take", _take_call(pool_id=pool_id, tokens=tokens, lane=lane, borrowed=borrowed),
                 only_if=answered("gate", "go")))


def _take_call(*, pool_id: int, tokens: int, lane: str, borrowed: bool) -> ScriptCall[ProviderTake]:
    return provider_take_call(pool_id=pool_id, tokens=tokens, sheddable=borrowed or lane in SHEDDABLE_LANES)


@contextmanager
def lane_slot(record: RequestRecord, *, taken: SentMark | None = None, asked: GateAsked | None = None,
              move_if_open: bool = False) -> Iterator[SlotHold]:
    """Hold one of the record's lane slots on its pool during a pool call
    (nothing for lanes that are not limited). ``taken``: the mark of the
    provider's room already taken for this call (a held request's release);
    ``asked``: its gate and take already asked (a lane that is not limited);
    ``move_if_open``: raise CircuitOpen instead of waiting for the circuit."""
    hold = SlotHold()
    if lane_limited(record.lane):
        hold.held = slot_wait(pool_id=record.pool_id, lane=record.lane, holder=record.request_id,
                              deadline_ms=record.deadline_ms)
    try:
        hold.mark = call_gate_wait(record, taken=taken, asked=asked, move_if_open=move_if_open)
        yield hold
    finally:
        if hold.held:
            hold.in_use = 1 + slot_release(pool_id=record.pool_id, lane=record.lane, holder=record.request_id)


CIRCUIT_POLL_MAX_S = 0.1
# Work that gives way to protected work in the provider's window.
SHEDDABLE_LANES = (BATCH.name, SCHEDULED.name)


def call_gate_wait(record: RequestRecord, *, taken: SentMark | None = None,
                   asked: GateAsked | None = None, move_if_open: bool = False) -> SentMark | None:
    """The circuit's gate and the provider's room, asked in one round trip
    (the room taken only if the gate said go); whichever says wait is then
    waited for as ``circuit_wait`` and ``provider_room_wait`` wait. Returns
    the take's mark (None: the call goes untaken, past its deadline).
    ``taken``: room already taken for this call when it was released from
    the held set (gateway/core/protection/held.py): only the gate is asked, unless it
    says wait (the circuit opened again), and then the room is taken anew.
    ``asked``: the gate and the take already asked (not asked again)."""
    if taken is not None:
        if circuit_gate(pool_id=record.pool_id, holder=record.request_id).go:
            return taken
        if move_if_open:
            raise CircuitOpen(record.request_id)
        circuit_wait(record)
        return provider_room_wait(record)
    if asked is None:
        answers = RoundTrip(*call_gate_steps(
            pool_id=record.pool_id, tokens=record.estimated_input_tokens + record.estimated_output_tokens,
            lane=record.lane, borrowed=record.borrowed, holder=record.request_id)).run()
        asked = GateAsked(verdict=answers["gate"], take=answers["take"])
    if not asked.verdict.go:
        if move_if_open:
            raise CircuitOpen(record.request_id)
        circuit_wait(record)
        return provider_room_wait(record)
    return provider_room_wait(record, first=asked.take)


def circuit_wait(record: RequestRecord) -> None:
    """Wait while the pool's circuit is open (gateway/core/protection/circuit.py), or
    half-open with another call as its trial; never past the request's
    deadline (then it goes anyway, and fails or succeeds as the pool says)."""
    while True:
        verdict = circuit_gate(pool_id=record.pool_id, holder=record.request_id)
        if verdict.go:
            return
        if record.deadline_ms and redis_now_ms() >= record.deadline_ms:
            return
        if not pause(min(CIRCUIT_POLL_MAX_S, max(0.005, verdict.wait_ms / 1000))):
            return


def _pool_failed(outcome: Outcome) -> bool:
    """The pool failed the call (a 5xx, no answer, a timeout); a 429 or a
    refusal of the request itself is an answer."""
    if outcome.upstream_status:
        return outcome.upstream_status >= 500
    return outcome.status == "upstream_error"


def _provider_take(record: RequestRecord) -> ScriptCall[ProviderTake]:
    return _take_call(pool_id=record.pool_id, tokens=record.estimated_input_tokens + record.estimated_output_tokens,
                      lane=record.lane, borrowed=record.borrowed)


def provider_room_wait(record: RequestRecord, *, first: ProviderTake | None = None) -> SentMark | None:
    """Take the call's share of the room the provider said it has
    (budgets/admission/provider_take.lua), waiting for it if there is none,
    never past the request's deadline: a call sent into a full window is
    refused, and the refusal counts against us at the provider.
    ``first``: what a take just answered (it is not asked again first).
    Returns the take's mark, None when the call goes untaken."""
    call = _provider_take(record)
    taken = first
    while True:
        if taken is None:
            taken = call.run()
        if taken.wait_ms <= 0:
            return taken.mark
        wait_ms, taken = taken.wait_ms, None
        if record.deadline_ms:
            left_ms = record.deadline_ms - redis_now_ms()
            if left_ms <= 0:
                return None  # past its deadline it goes anyway: the limit delays, never fails
            wait_ms = min(wait_ms, left_ms)
        if not pause(max(0.005, wait_ms / 1000)):
            return None


def lane_signal(record: RequestRecord, outcome: Outcome, *, hold: SlotHold) -> None:
    """What one pool answer tells the lane limits and the circuit, in one round trip."""
    RoundTrip(*lane_signal_steps(record, outcome, hold=hold)).run()


def lane_signal_steps(record: RequestRecord, outcome: Outcome, *, hold: SlotHold) -> list[Step]:
    """What one pool answer tells the pool's circuit breaker (``circuit``:
    every answer, or its absence) and the lane limits (``lane_limit``: a
    short call's latency per token, a limited lane's success, or a 429).
    Steps for the caller to run in a round trip with its own."""
    if _pool_failed(outcome):
        code = str((outcome.body or {}).get("error", {}).get("code", ""))
        steps = [Step("circuit", circuit_record_call(
            pool_id=record.pool_id, holder=record.request_id, ok=False,
            detail=f"HTTP {outcome.upstream_status}" if outcome.upstream_status else code))]
    else:
        # Any answer, a 429 included, says the pool is there.
        steps = [Step("circuit", circuit_record_call(pool_id=record.pool_id, holder=record.request_id, ok=True))]
    if outcome.upstream_status == 429:
        steps.append(Step("lane_limit", lane_limit_call(pool_id=record.pool_id, event="throttle", value=0, extra=0)))
    elif outcome.status != "ok":
        pass
    elif record.lane == SIGNAL_LANE:
        steps.append(Step("lane_limit", lane_limit_call(
            pool_id=record.pool_id, event="short", value=outcome.upstream_ms / (outcome.output_tokens + 1),
            extra=record.admitted_ms, duration_ms=outcome.upstream_ms)))
    elif lane_limited(record.lane):
        steps.append(Step("lane_limit", lane_limit_call(
            pool_id=record.pool_id, event="long", value=record.lane, extra=hold.in_use,
            duration_ms=outcome.upstream_ms)))
    return steps
