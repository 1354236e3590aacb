"""The broker transport (llm_platform/broker.py): kombu's Redis channel with
one synchronous redis-py client per connection pool, against the real Redis
the tests' broker uses."""

from __future__ import annotations

import json
import threading
import time
import uuid

from celery import current_app
from kombu import Connection, Exchange, Queue
from kombu.transport import resolve_transport

from budgets.admission.redis_client import Commands
from llm_platform.broker import ARRIVAL_SENDS, Channel, Transport


def test_every_redis_broker_url_resolves_to_it_and_tls_and_sentinel_keep_kombus():
    assert resolve_transport("redis") is Transport
    assert Connection("redis://127.0.0.1:6379/0").transport_cls == "redis"
    assert type(Connection("redis://127.0.0.1:6379/0").transport) is Transport
    assert type(Connection("redis+socket:///tmp/x.sock").transport) is Transport
    assert type(Connection("rediss://127.0.0.1:6379/0").transport) is not Transport
    assert type(Connection("sentinel://127.0.0.1:26379").transport) is not Transport
    # and the app's own connection
    with current_app.connection_for_write() as conn:
        assert type(conn.transport) is Transport


def test_a_channel_hands_out_one_sync_client_per_pool_and_a_new_one_for_a_new_pool():
    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        first = channel._create_client()
        assert channel._create_client() is first
        with channel.conn_or_acquire() as client:
            assert client is first
        # the asynchronous client (kombu's BRPOP connection) is still its own each time
        assert channel._create_client(asynchronous=True) is not channel._create_client(asynchronous=True)
        # a reconnect replaces the pool: the client follows it
        channel._pool = None
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool


def test_threads_racing_for_the_first_client_all_get_the_same_one():
    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        channel._pool = None
        channel._sync_client = None
        start = threading.Barrier(8)
        got = []

        def take() -> None:
            start.wait()
            got.append(channel._create_client())

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 8 and len({id(c) for c in got}) == 1


def test_a_message_goes_through_and_its_ack_clears_the_unacked_bookkeeping(redis_client):
    # Publish, consume without acking (kombu's ack emulation records it),
    # then ack: both steps go through the shared client.
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


def _consume_one(conn, queue, on_message) -> None:
    with conn.Consumer(queue, callbacks=[on_message], accept=["json"]):
        conn.drain_events(timeout=5)


def test_a_delivered_message_is_handed_over_before_its_entry_and_arrival_replies_are_read(redis_client):
    # The message's unacked entry and its task's arrival work (a round trip
    # of its own) are sent before the hand-over and read after it; an ack
    # made during the hand-over waits for the entry first, so nothing is left.
    name = f"sluice-broker-test-{uuid.uuid4().hex[:8]}"
    task = f"sluice.test.arrival.{name}"
    counter = f"{name}:arrivals"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    arrivals: list = []

    def arrival(*, args, kwargs):
        arrivals.append((args, kwargs))
        sent = Commands().command("INCR", counter).send(redis_client)
        arrivals.append(sent)
        return sent

    ARRIVAL_SENDS[task] = arrival
    seen = {}
    try:
        with current_app.connection_for_write() as conn:
            with conn.Producer() as producer:
                producer.publish([["req_x", 0], {"call": "1:2:interactive:0"}, {}], exchange=queue.exchange,
                                 routing_key=name, declare=[queue], serializer="json",
                                 headers={"task": task, "id": "t1", "retries": 0, "eta": None})
            channel = conn.default_channel

            def on_message(body, message):
                seen["tag"] = tag = message.delivery_tag
                seen["entry_out"] = tag in channel.qos._entries
                seen["arrival_unread"] = not arrivals[-1].read
                message.ack()

            _consume_one(conn, queue, on_message)
            assert seen == {"tag": seen["tag"], "entry_out": True, "arrival_unread": True}
            assert arrivals[0] == (["req_x", 0], {"call": "1:2:interactive:0"})
            assert arrivals[-1].read and redis_client.get(counter) == "1"
            assert not channel.qos._entries
            assert not redis_client.hexists(channel.unacked_key, seen["tag"])
            assert redis_client.zscore(channel.unacked_index_key, seen["tag"]) is None
            queue(channel).delete()
    finally:
        ARRIVAL_SENDS.pop(task, None)
        redis_client.delete(counter)


def test_a_retry_or_a_message_for_later_starts_no_arrival_work(redis_client):
    name = f"sluice-broker-test-{uuid.uuid4().hex[:8]}"
    task = f"sluice.test.arrival.{name}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    arrivals: list = []
    ARRIVAL_SENDS[task] = lambda *, args, kwargs: arrivals.append(args)
    try:
        with current_app.connection_for_write() as conn:
            with conn.Producer() as producer:
                for headers in ({"retries": 1, "eta": None}, {"retries": 0, "eta": "2030-01-01T00:00:00+00:00"}):
                    producer.publish([["req_y"], {}, {}], exchange=queue.exchange, routing_key=name,
                                     declare=[queue], serializer="json", headers={"task": task, **headers})
            got = []
            for _ in range(2):
                _consume_one(conn, queue, lambda body, message: (got.append(body), message.ack()))
            assert len(got) == 2 and arrivals == []
            channel = conn.default_channel
            assert not any(name in entry for entry in redis_client.hvals(channel.unacked_key))
            queue(channel).delete()
    finally:
        ARRIVAL_SENDS.pop(task, None)
