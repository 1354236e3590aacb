"""A pool's circuit breaker (closed -> open -> half-open -> closed), kept in
Redis so every worker of every host sees one state (``circuit.lua`` holds
the rule). It is fed by the workers' own calls, not only by the background
prober: an outage opens it within a few calls, and the first call that
succeeds after it (the half-open trial) closes it, so admission returns to
the full rate as soon as the provider does.

While it is open, admitted requests wait in their worker for the trial's
verdict (bounded by their own deadline) instead of failing at once: an
outage shorter than a request's queue timeout costs it time, not its
answer."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.admission import keys as budget_keys
from budgets.redis.clients import get_redis
from budgets.redis.scripts import LuaScript, ScriptCall
from gateway.core import keys

CIRCUIT = LuaScript(__package__, "circuit.lua")


@dataclass(frozen=True)
class CircuitVerdict:
    go: bool
    wait_ms: float
    state: str


@dataclass(frozen=True)
class CircuitState:
    state: str
    failures_in_a_row: int
    opened: int
    why: str
    last_change_ms: float


def _call(*, pool_id: int, event: str, holder: str = "", detail: str = "") -> ScriptCall[CircuitVerdict]:
    return ScriptCall(
        script=CIRCUIT, keys=[keys.pool_circuit(pool_id), budget_keys.pool_capacity(pool_id)],
        args=[event, holder, detail[:200], settings.SLUICE_CIRCUIT_FAILURES, int(settings.SLUICE_CIRCUIT_OPEN_S * 1000),
              int(settings.SLUICE_UPSTREAM_TIMEOUT_S * 1000) + 5_000, int(settings.SLUICE_CIRCUIT_OPEN_MAX_S * 1000)],
        parse=lambda raw: CircuitVerdict(go=raw[0] == "go", wait_ms=float(raw[1]), state=raw[2]),
    )


def circuit_gate(*, pool_id: int, holder: str) -> CircuitVerdict:
    """May this call go now (closed, or it is the half-open trial)?"""
    return circuit_gate_call(pool_id=pool_id, holder=holder).run()


def circuit_gate_call(*, pool_id: int, holder: str) -> ScriptCall[CircuitVerdict]:
    """``circuit_gate`` as a call, to run with others (its answer's first element: 'go' or 'wait')."""
    return _call(pool_id=pool_id, event="gate", holder=holder)


def circuit_record(*, pool_id: int, holder: str, ok: bool, detail: str = "") -> str:
    """One call's outcome; returns the state after it."""
    return circuit_record_call(pool_id=pool_id, holder=holder, ok=ok, detail=detail).run().state


def circuit_record_call(*, pool_id: int, holder: str, ok: bool, detail: str = "") -> ScriptCall[CircuitVerdict]:
    return _call(pool_id=pool_id, event="ok" if ok else "fail", holder=holder, detail=detail)


def circuit_state(*, pool_id: int, client=None) -> CircuitState:
    raw = (client or get_redis()).hgetall(keys.pool_circuit(pool_id))
    return CircuitState(state=raw.get("state", "closed"), failures_in_a_row=int(raw.get("failures") or 0),
                        opened=int(raw.get("opened") or 0), why=raw.get("why", ""),
                        last_change_ms=float(raw.get("last_change_ms") or 0))
