"""Work held through an outage, and given back as the provider makes room.

While a pool's circuit is open (gateway/core/protection/circuit.py), admission marks
what it admits as held (budgets/admission/admit.lua), and so it does for a
client's retry of a held request (the same body from the same workload, for
as long as a lease lasts). A held request is not put on its lane: it waits in
the pool's held set, earliest queue deadline first, and the pacer's
held-release thread (gateway/worker/pacer.py ``held_run``) moves it onto
its lane when the circuit is closed and the provider's window has room for
it beyond its reserve (``held_release.lua``).

Why not on the lane, as before: the lane is a FIFO list. An outage's backlog
queued there is served before everything that arrives after the provider is
back, and it goes out all at once, filling the provider's window for a
minute: the gateway's own memory of the outage then refused work the
provider would have taken (bench scenario 4, "retry storm"). Held apart and
paced by the provider's own statement of its room, the backlog takes what
the provider has spare and new work goes first.

A held request's caller waits as for any other; at its queue deadline the
web side gives it up and refunds it (gateway/core/request/claim.lua decides, as for
a request still on its lane), and the release drops it from the set."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from budgets.admission import keys as budget_keys
from budgets.admission.provider_limits import SentMark
from budgets.redis.scripts import LuaScript, ScriptCall
from gateway.core import keys
from gateway.core.pacer_wake import pacer_wake_commands
from gateway.core.request.records import RequestRecord

HELD_RELEASE = LuaScript(__package__, "held_release.lua")
# At most this many held requests go onto their lanes per pool and step.
RELEASE_BATCH = 100


@dataclass(frozen=True)
class Released:
    """One held request moved onto its lane, with the mark of the provider
    room taken for it (None: the circuit's trial, which takes its own)."""

    request_id: str
    lane: str
    mark: SentMark | None


def held_commands(pipe, record: RequestRecord) -> None:
    """Hold ``record`` (queued on ``pipe`` after its record is stored)."""
    member = f"{record.request_id}|{record.lane}|{record.estimated_input_tokens + record.estimated_output_tokens}"
    pipe.zadd(keys.pool_held(record.pool_id), {member: record.deadline_ms})
    pipe.sadd(keys.HELD_POOLS, record.pool_id)
    pacer_wake_commands(pipe, keys.HELD_WAKE)  # a releaser with no pool held waits long: look now


def mark_text(mark: SentMark) -> str:
    return f"{mark.sent} {mark.sent_tokens} {mark.at_ms:.3f}"


def mark_parse(text: str) -> SentMark | None:
    """A mark as ``mark_text`` writes it (and held_release.lua); None for ''."""
    if not text:
        return None
    sent, sent_tokens, at_ms = text.split(" ")
    return SentMark(int(sent), int(sent_tokens), float(at_ms))


def _released(raw) -> tuple[int, list[Released]]:
    out = []
    for i in range(1, len(raw), 2):
        request_id, lane, _ = raw[i].split("|")
        out.append(Released(request_id=request_id, lane=lane, mark=mark_parse(raw[i + 1])))
    return int(raw[0]), out


def held_release_call(*, pool_id: int, most: int = RELEASE_BATCH) -> ScriptCall[tuple[int, list[Released]]]:
    """Take held requests off the pool's set as the provider's room allows
    (or one as the circuit's trial): how many are left, and those released."""
    return ScriptCall(
        script=HELD_RELEASE,
        keys=[keys.pool_held(pool_id), budget_keys.pool_capacity(pool_id), keys.pool_circuit(pool_id)],
        args=[most, int(settings.SLUICE_CIRCUIT_OPEN_S * 1000), int(settings.SLUICE_HELD_PACE_S * 1000)],
        parse=_released,
    )
