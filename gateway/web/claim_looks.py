"""The looks of the requests a web process waits for, in round trips
shared by the requests that look at the same time.

Once a heartbeat interval, every request waiting for its outcome (an
unstreamed answer, a stream's first chunk, a stream gone quiet) asks
gateway/core/request/claim.lua whether its worker is still there
(gateway/web/dispatch.py ``_await_outcome``). A thousand streams waiting on
a full pool are a thousand such looks a second, each a round trip of the
one event loop that also admits and relays. Here the looks asked for in one
turn of the loop go to Redis together: one round trip
(budgets/redis/composition.py ``RoundTrip``: one script, each look its own
step with its own keys and answer), at most ``LOOKS_AT_ONCE`` in one. A
look alone is sent alone, as before, one turn of the loop later: under a
light load nothing is held back, and the more the loop has to do, the more
looks share each turn. On a Redis Cluster the steps of different requests
are in different slots and run one after another (what RoundTrip does
there).

Each look is the claim script's own WATCH step, unchanged: a look whose claim
moved the state (a take-over) is its requester's to act on, as when it was
sent alone. A failed round trip fails every look in it with its error; a
requester that stopped waiting (its caller left) leaves its look's answer
unread, as a request cancelled during its own round trip did."""

from __future__ import annotations

import asyncio

from budgets.redis.clients import get_async_redis
from budgets.redis.composition import RoundTrip, Step
from gateway.core.request.records import WATCH, Claim, RequestRecord, claim_call, heartbeat_holder
from gateway.web.per_loop import PerLoop

# Looks in one round trip at most: a script of that many claims holds Redis
# for well under a millisecond.
LOOKS_AT_ONCE = 32


class _Looks:
    """One event loop's looks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.asked: list[tuple[RequestRecord, asyncio.Future]] = []
        self.sending: set[asyncio.Task] = set()

    def ask(self, record: RequestRecord) -> asyncio.Future:
        answer = self.loop.create_future()
        if not self.asked:
            self.loop.call_soon(self._send_asked)  # once this turn's other looks have asked too
        self.asked.append((record, answer))
        return answer

    def _send_asked(self) -> None:
        asked, self.asked = self.asked, []
        for start in range(0, len(asked), LOOKS_AT_ONCE):
            task = self.loop.create_task(_send(asked[start:start + LOOKS_AT_ONCE]))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)


async def _send(looks: list[tuple[RequestRecord, asyncio.Future]]) -> None:
    holder = heartbeat_holder("web")
    trip = RoundTrip(*(Step(str(i), claim_call(WATCH, record, holder=holder)) for i, (record, _) in enumerate(looks)))
    try:
        # On the blocking client, as the waits these looks punctuate: a
        # Redis that hangs a few seconds delays the answers instead of failing them.
        answers = await trip.run_async(get_async_redis(blocking=True))
    except asyncio.CancelledError:
        for _, answer in looks:
            answer.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - each requester hears it, as from its own round trip
        for _, answer in looks:
            if not answer.done():
                answer.set_exception(exc)
        return
    for i, (_, answer) in enumerate(looks):
        if not answer.done():  # its requester stopped waiting
            answer.set_result(answers[str(i)])


_looks: PerLoop[_Looks] = PerLoop()


async def claim_look(record: RequestRecord) -> Claim:
    """The claim script's WATCH step for ``record``, sent with the other looks of
    this turn of the loop; raises what the round trip raised."""
    looks = _looks.get(lambda: _Looks(asyncio.get_running_loop()))
    return await looks.ask(record)
