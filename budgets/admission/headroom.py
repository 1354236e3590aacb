"""A pool's headroom now (budgets/admission/headroom.lua's contract), for
ordering replicas of a route: the pool with the most free capacity first."""

from __future__ import annotations

from budgets.admission import keys
from budgets.redis.scripts import LuaScript, ScriptCall

HEADROOM = LuaScript(__package__, "headroom.lua")


def headroom_call(*, pool_id: int) -> ScriptCall[float]:
    """The pool's free fraction, 0.0 (down, failing, full) to 1.0 (idle)."""
    return ScriptCall(script=HEADROOM,
                      keys=[keys.pool_config(pool_id), keys.pool_buckets(pool_id), keys.pool_leases(pool_id),
                            keys.pool_capacity(pool_id)],
                      args=[], parse=lambda raw: int(raw) / 1000)
