"""A lane's Celery message, written by Sluice itself: the exact message
``send_task`` would push on Celery's Redis broker, built without Celery's and
kombu's per-message publishing work (routing, signals, the producer pool,
the envelope built in three layers), so the web process can push it in the
same Redis round trip as the request's record.

Written against: Celery 5.7.0 and kombu 5.7.0 (task protocol 2 in kombu's
Redis envelope: base64 body ``[args, kwargs, embed]``, ``delivery_info``
naming the queue, LPUSHed on the queue's list).

Replaces: ``app.send_task(task, args, kwargs, queue=..., task_id=...)`` on
the web side (gateway/core/request/enqueue.py uses it where the broker is
the records' Redis and SLUICE_DIRECT_PUBLISH is on; elsewhere it calls
``send_task``). The lanes stay Celery queues consumed by Celery workers:
Flower, ``celery inspect`` and redelivery see a message like any other.

Measured gain: about a quarter of the CPU per admitted request (13.15 ms
without it, 10.02 ms with it, means of three alternated runs on a 2-core
machine that adds 10 million integers in 2.15 s). Reproduce it with
``SLUICE_DIRECT_PUBLISH=false python -m bench.cost --seed 1`` against the
same command without the variable, alternated on one machine.

Guarded by: tests/gateway/test_task_message.py, which compares the message
with the one Celery itself pushes, field by field, so an upgrade that
changes the format fails there first."""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid

from celery import current_app


def _origin() -> str:
    # celery.utils.nodenames.anon_nodename(): the sending process. Per call,
    # not cached: a forked web worker has its own pid. (reply_to below is
    # Celery's app.thread_oid, per thread as Celery fills it: where results
    # would go; our tasks ignore results.)
    return f"gen{os.getpid()}@{socket.gethostname()}"


def task_message(*, task: str, task_id: str, queue: str, args: list, kwargs: dict | None = None) -> str:
    """The broker message ``send_task(task, args, kwargs, queue=queue,
    task_id=task_id)`` would LPUSH on ``queue``."""
    kwargs = kwargs or {}
    body = json.dumps([args, kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    return json.dumps({
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None,
            "group": None, "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id,
            "parent_id": None, "argsrepr": repr(args), "kwargsrepr": repr(kwargs), "origin": _origin(),
            "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
        },
        "properties": {
            "correlation_id": task_id, "reply_to": current_app.thread_oid, "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0, "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    })
