"""kombu's Redis transport as the lane workers use it: its ack emulation (the
unacked bookkeeping redelivery relies on), against the real Redis the
tests' broker uses."""

from __future__ import annotations

import json
import time
import uuid

from celery import current_app
from kombu import Exchange, Queue


def test_a_message_goes_through_and_its_ack_clears_the_unacked_bookkeeping(redis_client):
    # Publish, consume without acking (kombu's ack emulation records it),
    # then ack.
    name = f"sluice-broker-test-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with current_app.connection_for_write() as conn:
        with conn.Producer() as producer:
            producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        channel = conn.default_channel
        message = channel.basic_get(name, no_ack=False)
        assert message is not None and message.payload == {"n": 1}
        unacked, index = channel.unacked_key, channel.unacked_index_key
        tag = message.delivery_tag
        # kombu's own format: what restore_by_tag reads back after a lost worker
        raw, exchange, routing_key = json.loads(redis_client.hget(unacked, tag))
        assert (exchange, routing_key) == (name, name) and raw == message._raw
        assert abs(redis_client.zscore(index, tag) - time.time()) < 60
        message.ack()
        assert not redis_client.hexists(unacked, tag) and redis_client.zscore(index, tag) is None
        queue(channel).delete()


def test_a_rejected_message_leaves_the_bookkeeping_and_a_requeued_one_comes_back(redis_client):
    name = f"sluice-broker-test-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with current_app.connection_for_write() as conn:
        with conn.Producer() as producer:
            for n in (1, 2):
                producer.publish({"n": n}, exchange=queue.exchange, routing_key=name, declare=[queue])
        channel = conn.default_channel
        first, second = channel.basic_get(name, no_ack=False), channel.basic_get(name, no_ack=False)
        tags = [first.delivery_tag, second.delivery_tag]
        assert all(redis_client.hexists(channel.unacked_key, tag) for tag in tags)
        first.reject(requeue=False)
        second.reject(requeue=True)
        for tag in tags:
            assert not redis_client.hexists(channel.unacked_key, tag)
            assert redis_client.zscore(channel.unacked_index_key, tag) is None
        again = channel.basic_get(name, no_ack=True)
        assert again is not None and again.payload == {"n": 2}
        assert channel.basic_get(name, no_ack=True) is None
        queue(channel).delete()


def test_an_idle_lane_worker_takes_a_message_as_it_arrives_not_at_its_next_poll(platform, redis_client):
    # given the scheduled lane's worker idle for longer than its read of the
    # queue waits (llm_platform.celery.BROKER_POLL_S): its BRPOP times out
    # and is sent again while nothing arrives
    from gateway.core.lanes import queue_for_lane
    from llm_platform.celery import BROKER_POLL_S

    queue = queue_for_lane("scheduled")
    assert redis_client.llen(queue) == 0
    time.sleep(BROKER_POLL_S + 1)  # an idle span, not a wait for another process
    taken_in = []
    for _ in range(3):  # at three phases of its poll
        # when a message lands on its queue
        sent = time.monotonic()
        current_app.send_task("budgets.push_pool_configs", queue=queue)
        deadline = sent + 2 * BROKER_POLL_S
        while redis_client.llen(queue) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the queue with a deadline
        taken_in.append(time.monotonic() - sent)
        time.sleep(BROKER_POLL_S / 3)  # the next message at another phase of the poll
    # then the worker takes each one at once, not when its wait would have ended
    assert max(taken_in) < 1.0, taken_in
