"""Waking the pacer (gateway/worker/pacer.py) when work for it arrives.

The pacer does not poll: it waits in BLPOP on ``keys.PACER_WAKE`` until the
earliest item it knows of is due (at most a second), and its held-release
thread on ``keys.HELD_WAKE``. Whoever adds an item that may be due sooner
(a delayed job, a callback retry, a held request) pushes a wake-up with the
same write, on the same round trip: Redis runs a
connection's commands in order, so the pacer that pops the wake-up finds
the item. One element is enough however many writers push (LTRIM keeps the
list at one), and one pacer woken is enough however many run. A wake-up
lost (Redis restarted between the two, a writer's pipeline cut) costs at
most the pacer's capped wait, never the item."""

from __future__ import annotations

from gateway.core import keys


def pacer_wake_commands(pipe, key: str = keys.PACER_WAKE) -> None:
    """Queue the wake-up on ``pipe`` (a ``Commands`` or a redis-py pipeline),
    after the write that adds the work; ``key``: the waiter's
    (``keys.HELD_WAKE`` for the pacer's held-release thread)."""
    pipe.lpush(key, 1)
    pipe.ltrim(key, 0, 0)
