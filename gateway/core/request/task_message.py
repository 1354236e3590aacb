"""A lane's Celery message written in the same Redis pipeline as the
request's record: one round trip instead of two, without Celery's and
kombu's per-message publishing work (routing, signals, the producer pool,
the message envelope built in three layers), which was a fifth of the web
process's CPU per admitted request (bench/PROFILE.md, round 3).

The message is exactly what ``send_task`` pushes on Celery's Redis broker
from the web side (which never loads the worker's task module, so the
message carries no time limits: the worker applies its configured ones):
task protocol 2 (headers, a ``[args, kwargs, embed]`` body) in kombu's Redis
envelope (base64 body, ``delivery_info`` naming the queue), LPUSHed on the
queue's list. The lanes stay Celery queues consumed by Celery workers:
Flower, ``celery inspect`` and redelivery see a message like any other.
``tests/gateway/test_task_message.py`` compares it with the one Celery
itself pushes, field by field, so an upgrade that changes the format fails
there first.

Used only where the broker is the Redis that holds the records
(``CELERY_BROKER_URL`` unset; never on a Redis Cluster, whose broker is a
separate plain Redis) and ``SLUICE_DIRECT_PUBLISH`` is on; otherwise the
caller sends with ``send_task``."""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid

from celery import current_app
from django.conf import settings


def direct_publish() -> bool:
    """Whether lane messages go out in the records' pipeline."""
    return settings.SLUICE_DIRECT_PUBLISH and settings.CELERY_BROKER_IS_REDIS_URL


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
