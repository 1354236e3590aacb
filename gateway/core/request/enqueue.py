"""Putting an admitted request on its lane, for the synchronous API (the web
side, async) and for jobs (the API view and the pacer, sync): build the
request's record, store it in Redis, enqueue its id on the lane's Celery
queue by task name (the web side never imports the worker's task module;
with the broker on the records' Redis, the message goes in the record's own
pipeline: adapters/celery.py), and refund if that fails (gateway/core/request/settlement.py). A request taken over
from a lost worker goes back on its lane as its next delivery
(``record_requeue``)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from celery import current_app
from django.conf import settings

from adapters.celery import task_message
from budgets.admission.buckets import Admission
from budgets.admission.estimation import Estimate
from budgets.redis.clients import get_redis
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.protection.concurrency import lane_limited
from gateway.core.request.context import CallerContext
from gateway.core.request.endpoints import CHAT_COMPLETIONS
from gateway.core.errors import budget_unavailable
from gateway.core.protection.held import held_commands
from gateway.core.lanes import lane_for, queue_for_lane
from gateway.core.metrics import arrival_commands
from gateway.core.observability import admission_observe
from gateway.core.request.records import RequestRecord, ttl_ms
from gateway.core.request.settlement import request_refund, request_refund_async

logger = logging.getLogger(__name__)

# The worker side's task (gateway/worker/tasks.py): a stable name, so queued
# messages survive a deploy that moves code.
EXECUTE_REQUEST_TASK = "gateway.execute_request"


def direct_publish() -> bool:
    """Whether lane messages go out in the records' own round trip, written
    by Sluice (adapters/celery.py): only where the broker is the Redis that
    holds the records (never on a Redis Cluster, whose broker is a separate
    plain Redis) and SLUICE_DIRECT_PUBLISH is on; otherwise ``send_task``."""
    return settings.SLUICE_DIRECT_PUBLISH and settings.CELERY_BROKER_IS_REDIS_URL

def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def record_build(ctx: CallerContext, *, request_id: str, model: str, payload: dict, estimate: Estimate,
                 admission: Admission, deadline_ms: float, retry_deadline_ms: float, session_id: str = "",
                 job_id: str = "", fallback_pool_ids: tuple[int, ...] = (),
                 endpoint: str = CHAT_COMPLETIONS) -> RequestRecord:
    """The record of a request of ``endpoint`` admitted on ``ctx``'s pool;
    ``fallback_pool_ids``: the pools after it in its route
    (gateway/core/request/routing.py)."""
    lane = lane_for(workload_class=ctx.workload_class, estimated_tokens=estimate.total_tokens,
                    borrowed=admission.borrowed)
    price = ctx.prices.get(model)
    return RequestRecord(
        request_id=request_id, tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, pool_id=ctx.pool_id,
        pool_base_url=ctx.pool_base_url, pool_api_key_env=ctx.pool_api_key_env, model=model, lane=lane,
        borrowed=admission.borrowed, estimated_input_tokens=estimate.input_tokens,
        estimated_output_tokens=estimate.output_tokens, admitted_ms=admission.admitted_ms,
        deadline_ms=deadline_ms, payload=payload, session_id=session_id, job_id=job_id,
        retry_deadline_ms=retry_deadline_ms,
        price_input_per_million=str(price.input_per_million) if price else "",
        price_output_per_million=str(price.output_per_million) if price else "",
        price_id=(price.price_id or 0) if price else 0,
        spend_month=admission.spend_month, api_key_id=ctx.api_key_id or 0, held=admission.held,
        overflow=ctx.overflow, fallback_pools=",".join(str(pool_id) for pool_id in fallback_pool_ids),
        pool_slug=ctx.pool_slug, endpoint=endpoint,
    )


@dataclass(frozen=True)
class CallHint:
    """What a worker needs to ask the circuit's gate and take the provider's
    room for a request's pool call before it has read the record, so that
    both go in the round trip of its claim (gateway/worker/execution.py):
    carried by the lane message as its ``call`` kwarg, checked by the worker
    against the record it reads."""

    pool_id: int
    tokens: int
    lane: str
    borrowed: bool

    @classmethod
    def of(cls, record: RequestRecord) -> CallHint:
        return cls(pool_id=record.pool_id, tokens=record.estimated_input_tokens + record.estimated_output_tokens,
                   lane=record.lane, borrowed=record.borrowed)

    @classmethod
    def parse(cls, text: str) -> CallHint | None:
        """None for an empty or malformed hint (the worker then asks after its claim)."""
        try:
            pool_id, tokens, lane, borrowed = text.split(":")
            return cls(pool_id=int(pool_id), tokens=int(tokens), lane=lane, borrowed=borrowed == "1")
        except ValueError:
            return None

    def text(self) -> str:
        return f"{self.pool_id}:{self.tokens}:{self.lane}:{1 if self.borrowed else 0}"


def call_hint(record: RequestRecord) -> dict[str, str]:
    """The lane message's kwargs with the record's ``CallHint``; none for a
    lane whose call waits for a slot first (gateway/worker/lane_slot.py):
    its gate is asked when it has one."""
    return {} if lane_limited(record.lane) else {"call": CallHint.of(record).text()}


def _record_commands(pipe, record: RequestRecord, *, lease_ms: int, publish: bool) -> None:
    """The record, the arrival's metrics and (``publish``) the lane's message,
    queued on ``pipe`` (a ``Commands`` or a redis-py pipeline): Redis runs
    them in order on one connection, so the message is never there before
    its record."""
    pipe.hset(keys.request_record(record.request_id), mapping=record.to_redis())
    pipe.pexpire(keys.request_record(record.request_id), max(ttl_ms(), lease_ms))
    arrival_commands(pipe, pool_id=record.pool_id, lane=record.lane, request_id=record.request_id,
                     expires_ms=record.admitted_ms + lease_ms)
    if record.held:
        held_commands(pipe, record)  # not on its lane yet: gateway/core/protection/held.py
    elif publish:
        queue = queue_for_lane(record.lane)
        pipe.lpush(queue, task_message(task=EXECUTE_REQUEST_TASK, task_id=record.request_id, queue=queue,
                                       args=[record.request_id], kwargs=call_hint(record)))


def record_enqueue(record: RequestRecord, *, lease_ms: int) -> None:
    """Store the record and enqueue its id on its lane, or refund and raise a
    503: nothing may run without its record, nothing admitted may leak."""
    direct = direct_publish()
    try:
        commands = Commands()
        _record_commands(commands, record, lease_ms=lease_ms, publish=direct)
        commands.run()
        if not direct and not record.held:
            current_app.send_task(EXECUTE_REQUEST_TASK, args=[record.request_id], kwargs=call_hint(record),
                                  queue=queue_for_lane(record.lane), task_id=record.request_id)
    except Exception as exc:  # Redis or the broker
        logger.warning("could not enqueue %s: %s", record.request_id, exc)
        try:
            request_refund(record)
        except Exception:  # the lease expires by itself
            logger.warning("could not refund %s", record.request_id, exc_info=True)
        raise budget_unavailable() from exc
    admission_observe(record=record)


async def record_enqueue_async(record: RequestRecord, *, lease_ms: int) -> None:
    """``record_enqueue`` for the async web side: with the lane's message in
    the record's pipeline, one await on the async client and no thread hop;
    through Celery's (blocking) send_task otherwise."""
    if not direct_publish() and not record.held:
        await sync_to_async(record_enqueue, thread_sensitive=False)(record, lease_ms=lease_ms)
        return
    try:
        commands = Commands()
        _record_commands(commands, record, lease_ms=lease_ms, publish=True)
        await commands.run_async()
    except Exception as exc:  # Redis
        logger.warning("could not enqueue %s: %s", record.request_id, exc)
        try:
            await request_refund_async(record)
        except Exception:  # the lease expires by itself
            logger.warning("could not refund %s", record.request_id, exc_info=True)
        raise budget_unavailable() from exc
    admission_observe(record=record)


def record_requeue(record: RequestRecord, *, generation: int) -> bool:
    """Enqueue delivery ``generation`` of a request whose worker was lost
    (claim.lua moved it to ``queued:<generation>``). A failed send is only
    logged: the request then misses its start-by time and is settled as
    lost by whoever watches it next."""
    try:
        lane_publish(request_id=record.request_id, lane=record.lane, task_id=f"{record.request_id}.{generation}",
                     kwargs={"generation": generation})
    except Exception:  # the broker
        logger.warning("could not requeue %s (delivery %s)", record.request_id, generation, exc_info=True)
        return False
    return True


def lane_publish(*, request_id: str, lane: str, task_id: str, kwargs: dict) -> None:
    """Put a request already admitted and recorded on its lane: a lost
    worker's next delivery, a held request released (gateway/core/protection/held.py)."""
    queue = queue_for_lane(lane)
    if direct_publish():
        get_redis().lpush(queue, task_message(task=EXECUTE_REQUEST_TASK, task_id=task_id, queue=queue,
                                              args=[request_id], kwargs=kwargs))
    else:
        current_app.send_task(EXECUTE_REQUEST_TASK, args=[request_id], kwargs=kwargs, queue=queue, task_id=task_id)
