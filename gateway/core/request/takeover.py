"""Taking a request over from a lost worker (SIGKILL, OOM, a host gone).

A worker renews a heartbeat of every call it runs (gateway/worker/heartbeat.py).
Whoever watches a request asks ``claim.lua``: the web process waiting for the
outcome, every heartbeat interval (gateway/web/dispatch.py), and the reaper,
for jobs and for calls whose web process is gone too (``lost_requests_reap``,
a beat task). When the heartbeat has gone quiet, claim.lua moves the request
to its next delivery, atomically against the old worker coming back, and the
one asker that moved it acts here: put it back on its lane, finish it with
the pool's stored answer, or settle it as ``worker_lost`` (charged on the
estimate: the pool may have run it)."""

from __future__ import annotations

import logging

from budgets.models import InferencePool
from budgets.redis.clients import SyncRedis, get_redis
from gateway.core import keys
from gateway.core.request.enqueue import record_requeue
from gateway.core.request.finish import request_finish
from gateway.core.lanes import LANE_NAMES
from gateway.core.request.records import (FINISH, LOST, REAP, REQUEUE, Claim, Outcome, RequestRecord, claim_call,
                                  heartbeat_generation, worker_lost_outcome)

logger = logging.getLogger(__name__)


def request_take_over(*, record: RequestRecord, claim: Claim, client: SyncRedis | None = None) -> None:
    """Do what a claim that moved the request away from a lost worker asks."""
    if not claim.changed:
        return  # someone else moved it, and acts on it
    if record.fallback_pools:
        # Its worker may have moved it to another pool of its route
        # (gateway/worker/failover.py): finish it where it is now, with the
        # record Redis holds, not the one admission built.
        stored = (client or get_redis()).hgetall(keys.request_record(record.request_id))
        record = RequestRecord.from_redis(stored) if stored else record
    if claim.verdict == REQUEUE:
        logger.warning("request %s: its worker was lost; delivery %s goes back on lane %s", record.request_id,
                       claim.generation, record.lane)
        record_requeue(record, generation=claim.generation)
    elif claim.verdict == FINISH:
        stored = (client or get_redis()).get(keys.request_response(record.request_id))
        # claim.lua said FINISH because the answer was stored; both expire together.
        outcome = Outcome.from_json(stored) if stored is not None else worker_lost_outcome(record)
        request_finish(record=record, outcome=outcome, pool_called=True)
    elif claim.verdict == LOST:
        logger.warning("request %s: its worker was lost and no delivery could start in time", record.request_id)
        request_finish(record=record, outcome=worker_lost_outcome(record), pool_called=True)


def _maybe_stranded(owner: str | None, heartbeat: str | None) -> bool:
    """Owner states in which a lost worker can leave a request stranded: a
    started delivery whose heartbeat has gone quiet, or a re-queued one. A
    delivery whose worker still renews its heartbeat ('<generation>|<holder>',
    of the owner's generation) is one claim.lua would leave as it is."""
    if not owner:
        return False
    state, _, generation = owner.partition(":")
    if state == "queued":
        return True
    return state == "worker" and heartbeat_generation(heartbeat) != generation


def lost_requests_reap(*, pool_ids: list[int]) -> int:
    """Take over every started or re-queued request of the pools whose worker
    is lost; returns how many moved. Requests still queued for their first
    delivery are left to their deadline (the web side or the worker).

    Each in-flight request's owner and heartbeat are read in one pipelined
    round trip, and only those that may be stranded are claimed (a record
    read and a claim.lua call each): a sweep over a thousand running calls
    is one round trip, not two thousand. A heartbeat that lapses after the
    read is the next sweep's."""
    client = get_redis()
    moved = 0
    for pool_id in pool_ids:
        for lane in LANE_NAMES:
            request_ids = client.zrange(keys.lane_in_flight(pool_id, lane), 0, -1)
            if not request_ids:
                continue
            pipe = client.pipeline(transaction=False)
            for request_id in request_ids:
                pipe.get(keys.request_owner(request_id))
                pipe.get(keys.request_heartbeat(request_id))
            answers = pipe.execute()
            candidates = [rid for rid, owner, heartbeat in zip(request_ids, answers[0::2], answers[1::2])
                          if _maybe_stranded(owner, heartbeat)]
            for request_id in candidates:
                try:
                    moved += _reap_one(client, request_id)
                except Exception:  # one request must not stop the pass; the next pass tries again
                    logger.exception("taking over request %s failed", request_id)
    return moved


def lost_requests_reap_all() -> int:
    """``lost_requests_reap`` over every pool (the pacer's sweep, and the task for a run by hand)."""
    return lost_requests_reap(pool_ids=list(InferencePool.objects.values_list("id", flat=True)))


def _reap_one(client: SyncRedis, request_id: str) -> int:
    data = client.hgetall(keys.request_record(request_id))
    if not data:
        return 0
    record = RequestRecord.from_redis(data)
    claim = claim_call(REAP, record).run(client)
    if not claim.changed:
        return 0
    request_take_over(record=record, claim=claim, client=client)
    return 1
