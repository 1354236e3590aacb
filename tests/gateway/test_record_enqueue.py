"""After its admission, an admitted request's record, its arrival's metrics
and its lane message go to Redis in one pipeline from the web process
(gateway/core/request/enqueue.py ``record_enqueue_async``), the message built in
Python (adapters/celery.py, the one send_task would push:
tests/gateway/test_task_message.py), never by a script. Real Redis, watched
with its own MONITOR, and the real admission."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from budgets.admission.estimation import Estimate
from gateway.core import keys
from gateway.core.request.routing import request_route_admit_async
from gateway.core.request.context import context_for_workload
from gateway.core.request.enqueue import EXECUTE_REQUEST_TASK, call_hint, record_build, record_enqueue_async
from gateway.core.lanes import queue_for_lane
from gateway.core.request.records import RequestRecord
from adapters.celery import task_message
from gateway.core.request.enqueue import direct_publish
from tests.gateway.stored import RedisMonitor

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("not direct_publish()", reason="the broker is not on the records' Redis")]

MODEL = "sim-large"
QUEUE_S = 10.0
LEASE_MS = 120_000


def test_the_record_its_metrics_and_its_lane_message_go_in_one_pipeline_after_admission(make_caller,
                                                                                       redis_of_its_own):
    redis_client = redis_of_its_own  # no lane worker of the session reads its queues
    # given a request admitted on its workload's own reservation
    caller = make_caller()
    ctx = context_for_workload(caller.workload)
    request_id = f"req_{uuid.uuid4().hex}"
    estimate = Estimate(input_tokens=100, output_tokens=50, max_tokens_requested=50, clamped=False)
    admission = asyncio.run(request_route_admit_async(ctx.route(MODEL), request_id=request_id, model=MODEL,
                                                      estimate_for=lambda _on_pool: estimate,
                                                      lease_ms=LEASE_MS)).admission
    record = record_build(ctx, request_id=request_id, model=MODEL, payload={"model": MODEL, "messages": []},
                          estimate=estimate, admission=admission,
                          deadline_ms=admission.admitted_ms + QUEUE_S * 1000,
                          retry_deadline_ms=admission.admitted_ms + (QUEUE_S + 30) * 1000)
    queue = queue_for_lane(record.lane)

    # when it is enqueued
    monitor = RedisMonitor(redis_client)
    try:
        asyncio.run(record_enqueue_async(record, lease_ms=LEASE_MS))
    finally:
        commands = monitor.stop()

    # then the record, the lane's in-flight entry and the message are there
    record_key = keys.request_record(request_id)
    assert RequestRecord.from_redis(redis_client.hgetall(record_key)) == record
    assert redis_client.pttl(record_key) > 100_000
    assert redis_client.zscore(keys.lane_in_flight(ctx.pool_id, record.lane), request_id) == (
        admission.admitted_ms + LEASE_MS)
    # written by the web process's own commands, the record before the message, no script among them
    mine = [c for kind, c in commands if request_id in c]
    assert [c.split(" ", 1)[0] for c in mine] == ["HSET", "PEXPIRE", "ZADD", "LPUSH"]
    assert not any(kind == "lua" for kind, c in commands if request_id in c)
    # and the message is the Python-built one for its lane (the one send_task would push)
    pushed = [c for c in mine if c.startswith(f"LPUSH {queue} ")]
    assert len(pushed) == 1
    message = json.loads(pushed[0].split(" ", 2)[2])
    expected = json.loads(task_message(task=EXECUTE_REQUEST_TASK, task_id=request_id, queue=queue,
                                       args=[request_id], kwargs=call_hint(record)))
    assert message["headers"]["id"] == request_id and message["headers"]["task"] == EXECUTE_REQUEST_TASK
    assert message["properties"]["delivery_info"]["routing_key"] == queue
    assert message["body"] == expected["body"] and message["headers"] == expected["headers"]
    assert redis_client.lrem(queue, 1, pushed[0].split(" ", 2)[2]) == 1  # no worker reads this database
