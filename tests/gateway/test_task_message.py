"""The lane message the web side writes itself (adapters/celery.py)
is the one Celery's send_task pushes on the Redis broker: compared field by
field with a message Celery publishes to a scratch queue of the same Redis.
Every test that runs a request through the real workers also consumes it."""

from __future__ import annotations

import base64
import json
import uuid

import pytest
from celery import current_app
from django.conf import settings

from gateway.core.request.enqueue import EXECUTE_REQUEST_TASK
from adapters.celery import task_message
from gateway.core.request.enqueue import direct_publish

QUEUE = "test-task-message"


def _decoded(raw: str) -> dict:
    message = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    uuid.UUID(message["properties"].pop("delivery_tag"))  # a fresh UUID each, in both
    return message


@pytest.mark.parametrize("args, kwargs", [(["req_0123abcd"], None), (["req_0123abcd"], {"generation": 2})])
def test_the_message_is_the_one_celery_pushes(redis_client, args, kwargs):
    # given the message Celery itself pushes for the same task, id and queue
    redis_client.delete(QUEUE)
    task_id = "req_0123abcd" if kwargs is None else "req_0123abcd.2"
    # (as the web side sends it: without the worker's task module, so without
    # the task's own time limits, which the worker applies from its config;
    # a test process that imported the worker's tasks would add them)
    current_app.send_task(EXECUTE_REQUEST_TASK, args=args, kwargs=kwargs, queue=QUEUE, task_id=task_id,
                          time_limit=None, soft_time_limit=None)
    celerys = redis_client.lpop(QUEUE)

    # when ours is built
    ours = task_message(task=EXECUTE_REQUEST_TASK, task_id=task_id, queue=QUEUE, args=args, kwargs=kwargs)

    # then they are the same message, and ours keys its fields as Celery does
    mine, theirs = _decoded(ours), _decoded(celerys)
    for part in ("headers", "properties"):
        differing = {k: (mine[part].get(k), theirs[part].get(k)) for k in mine[part].keys() | theirs[part].keys()
                     if mine[part].get(k) != theirs[part].get(k)}
        assert not differing, (part, differing)
    assert mine == theirs
    assert list(json.loads(ours)) == list(json.loads(celerys))
    assert list(json.loads(ours)["headers"]) == list(json.loads(celerys)["headers"])
    redis_client.delete(QUEUE, f"_kombu.binding.{QUEUE}", f"_kombu.binding_permanent.{QUEUE}")


def test_it_is_used_only_with_the_broker_on_the_records_redis(monkeypatch):
    assert direct_publish() is (settings.SLUICE_DIRECT_PUBLISH and settings.CELERY_BROKER_IS_REDIS_URL)
    monkeypatch.setattr(settings, "CELERY_BROKER_IS_REDIS_URL", False)
    assert direct_publish() is False
    monkeypatch.setattr(settings, "CELERY_BROKER_IS_REDIS_URL", True)
    monkeypatch.setattr(settings, "SLUICE_DIRECT_PUBLISH", False)
    assert direct_publish() is False
