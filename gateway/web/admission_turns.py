"""Turns at the door: how many requests a web process's event loop admits at
once, and who goes next when that many are in.

A web process reads, checks and admits every /v1 request on its one event
loop. Each await of a request's admission (the bucket's round trip, the
record's write) sends it to the back of the loop's ready queue, behind one
step of every other request in flight. When a thousand requests of one
workload arrive together, a request of anyone else that lands among them
waits for all of theirs: seconds, for a refusal that takes a millisecond of
CPU. Here at most ``SLUICE_WEB_ADMISSIONS_AT_ONCE`` requests (32) are past
the door at once, from the moment their whole body has arrived (a caller
that trickles its body holds no turn: llm_platform/asgi.py reads it first)
until their admission is settled: enqueued on their lane (``turn_leave``, called by
gateway/web/dispatch.py), or answered (a refusal, an error: the app
returns). The others wait before any of their work starts, one line per
key, and a freed turn goes to the tenants in turn, then to each tenant's
keys in turn, first come first served within a key: another tenant's
request, or another of its workloads', takes the next turn instead of the
thousandth. A loop that holds only that many admissions also turns
faster, so each of their awaits comes back sooner.

Whose a request is comes from what the process already knows of its key
(gateway/web/auth.py, ``caller_line``): nothing is looked up to queue it.
A key Sluice issued waits as its tenant's, in its own line within the
tenant (a workload's calls use its keys); every other request (no key, a
made-up or revoked one) shares one line, so a flood of made-up keys is one
turn in the rotation, never one per key.

No request waits at the door longer than ``SLUICE_REDIS_BUSY_WAIT_S``,
what the request path waits for a busy Redis: past that it goes on
without a turn, as every request did before this gate. A Redis that hangs
holds the turns for that long at most, and never stretches into a line
a thousand turns long. A request whose caller leaves while it waits
gives its place up; one handed a turn as it is cancelled hands the turn
on. ``SLUICE_WEB_ADMISSIONS_AT_ONCE=0`` turns the gate off.

``/metrics`` shows how many requests wait at the doors now
(``sluice_web_door_waiting``) and how many waited their whole bound
(``sluice_web_door_waited_out_total``): a door that is often full says the
web processes admit more slowly than callers arrive."""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque

from django.conf import settings

from gateway.core.observability import door_waited_out_observe, door_waiting_observe
from gateway.web.auth import caller_line
from gateway.web.per_loop import PerLoop

# (tenant, key) as gateway/web/auth.py's caller_line gives them.
Caller = tuple[object, object]

# Every request whose key the process cannot place.
UNKNOWN: Caller = (None, None)


class Turn:
    """A request's turn past the door; ``leave`` is idempotent."""

    __slots__ = ("door", "held")

    def __init__(self, door: Door | None, held: bool) -> None:
        self.door = door
        self.held = held

    def leave(self) -> None:
        if self.held:
            self.held = False
            self.door._hand_on()


class _TenantLine:
    """One tenant's waiters: a line per key, served in turn."""

    __slots__ = ("lines", "turns")

    def __init__(self) -> None:
        self.lines: dict[object, deque[asyncio.Future]] = {}
        self.turns: deque[object] = deque()

    def add(self, line_key: object, waiter: asyncio.Future) -> None:
        line = self.lines.get(line_key)
        if line is None:
            line = self.lines[line_key] = deque()
            self.turns.append(line_key)
        line.append(waiter)

    def next(self) -> asyncio.Future | None:
        """The first waiter still waiting of the key whose turn it is."""
        while self.turns:
            line_key = self.turns.popleft()
            line = self.lines[line_key]
            while line and line[0].done():  # gave up (cancelled, or waited too long)
                line.popleft()
            if not line:
                del self.lines[line_key]
                continue
            waiter = line.popleft()
            if line:
                self.turns.append(line_key)
            else:
                del self.lines[line_key]
            return waiter
        return None


class Door:
    """The turns of one event loop."""

    def __init__(self, *, at_once: int, wait_max_s: float) -> None:
        self.at_once = at_once
        self.wait_max_s = wait_max_s
        self.inside = 0
        self.tenants: dict[object, _TenantLine] = {}
        self.turns: deque[object] = deque()

    @property
    def waiting(self) -> int:
        return sum(not waiter.done() for tenant in self.tenants.values() for line in tenant.lines.values()
                   for waiter in line)

    def enter_now(self) -> Turn | None:
        """A turn at once, if one is free and nobody waits."""
        if self.inside < self.at_once and not self.turns:
            self.inside += 1
            return Turn(self, True)
        return None

    async def enter(self, caller: Caller) -> Turn:
        """A turn for ``caller``, at once if one is free and nobody waits;
        else when the rotation comes to it, or without one after ``wait_max_s``."""
        turn = self.enter_now()
        if turn is not None:
            return turn
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        tenant_id, line_key = caller
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            tenant = self.tenants[tenant_id] = _TenantLine()
            self.turns.append(tenant_id)
        tenant.add(line_key, waiter)
        timer = loop.call_later(self.wait_max_s, _give_up, waiter)
        door_waiting_observe(1)
        try:
            handed = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._hand_on()  # handed a turn as it was cancelled: the next one takes it
            else:
                waiter.cancel()
            raise
        finally:
            timer.cancel()
            door_waiting_observe(-1)
        return Turn(self, handed)

    def _hand_on(self) -> None:
        """A turn was left: to the next waiter in the rotation, or free."""
        while self.turns:
            tenant_id = self.turns.popleft()
            tenant = self.tenants[tenant_id]
            waiter = tenant.next()
            if tenant.turns:
                self.turns.append(tenant_id)
            else:
                del self.tenants[tenant_id]
            if waiter is not None:
                waiter.set_result(True)
                return
        self.inside -= 1


def _give_up(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)  # goes on without a turn; its place is skipped
        door_waited_out_observe()


_doors: PerLoop[Door] = PerLoop()
_turn: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("admission_turn", default=None)


def door() -> Door | None:
    """This event loop's door (None with the gate off)."""
    at_once = settings.SLUICE_WEB_ADMISSIONS_AT_ONCE
    if at_once <= 0:
        return None
    return _doors.get(lambda: Door(at_once=at_once, wait_max_s=settings.SLUICE_REDIS_BUSY_WAIT_S),
                      fits=lambda found: found.at_once == at_once)


def _authorization(scope: dict) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def admission_turns(app):
    """``app`` (the /v1 handler) behind the door, for the requests that admit."""

    async def through_the_door(scope, receive, send):
        found = door()
        if found is None:
            return await app(scope, receive, send)
        # Whose it is matters only to a request that waits.
        turn = found.enter_now() or await found.enter(caller_line(_authorization(scope)) or UNKNOWN)
        token = _turn.set(turn)
        try:
            return await app(scope, receive, send)
        finally:
            turn.leave()
            _turn.reset(token)

    return through_the_door


def turn_leave() -> None:
    """This request's admission is settled (it is on its lane, or it waits
    for another request): its turn goes to the next one."""
    turn = _turn.get()
    if turn is not None:
        turn.leave()
