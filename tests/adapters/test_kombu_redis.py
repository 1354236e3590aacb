"""The lane worker's batched pickup (adapters/kombu_redis.py) against the
real Redis, through kombu's own consumer path (``drain_events``: the BRPOP
and its read, as the worker's event loop runs them): the messages behind
the first are taken in the same turn, up to the QoS's room; each is
recorded unacknowledged exactly as kombu's stock ``QoS.append`` records one;
the ack clears it; and kombu's own restore sweep brings back what a killed
worker never acked. On a Redis database of the test's own: the sweep
restores every stale entry of its database."""

from __future__ import annotations

import json
import time
import uuid

import kombu
import kombu.transport
import pytest
from django.conf import settings
from kombu import Exchange, Queue

from adapters import kombu_redis
from adapters.kombu_redis import TAKE_MAX, lane_pickup_install


def broker_url() -> str:
    url = settings.REDIS_URL
    return url.replace("unix://", "redis+socket://") if url.startswith("unix://") else url


@pytest.fixture
def lane_queue(redis_of_its_own):
    name = f"sluice-pickup-test-{uuid.uuid4().hex[:8]}"
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def publish(queue: Queue, count: int, *, transport=None) -> None:
    with kombu.Connection(broker_url(), transport=transport) as conn, conn.Producer() as producer:
        for n in range(count):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])


def one_turn(conn: kombu.Connection, queue: Queue, *, prefetch: int) -> list:
    """What one read of the consumer's loop hands to its callback."""
    got: list = []
    consumer = conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)], accept=["json"])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    conn.drain_events(timeout=5)
    return got


def test_one_turn_takes_the_messages_behind_the_first_up_to_the_room(redis_of_its_own, lane_queue):
    # given ten messages waiting on a lane's queue
    publish(lane_queue, 10)
    with kombu.Connection(broker_url(), transport=kombu_redis.Transport) as conn:
        # when a consumer with room for four reads once
        got = one_turn(conn, lane_queue, prefetch=4)
        # then it has four, in the order they were sent, and six still wait
        assert [message.payload for message in got] == [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]
        assert redis_of_its_own.llen(lane_queue.name) == 6
        assert got[0].channel.qos.can_consume_max_estimate() == 0


def test_a_turn_takes_at_most_take_max_behind_the_first(redis_of_its_own, lane_queue):
    publish(lane_queue, TAKE_MAX + 10)
    with kombu.Connection(broker_url(), transport=kombu_redis.Transport) as conn:
        got = one_turn(conn, lane_queue, prefetch=1_000)
        assert len(got) == TAKE_MAX + 1
        assert redis_of_its_own.llen(lane_queue.name) == 10 - 1


def test_taken_messages_are_recorded_as_kombus_own_append_records_one_and_the_ack_clears_them(
        redis_of_its_own, lane_queue):
    # given one message taken by kombu's stock transport, and three by the batched pickup
    publish(lane_queue, 1)
    with kombu.Connection(broker_url(), transport="redis") as stock:
        assert stock.transport_cls is not kombu_redis.Transport
        (reference,) = one_turn(stock, lane_queue, prefetch=1)
        unacked, index = reference.channel.unacked_key, reference.channel.unacked_index_key
        stock_entry = json.loads(redis_of_its_own.hget(unacked, reference.delivery_tag))
        reference.ack()
    publish(lane_queue, 3)
    with kombu.Connection(broker_url(), transport=kombu_redis.Transport) as conn:
        got = one_turn(conn, lane_queue, prefetch=3)
        assert len(got) == 3
        # then each has the entry kombu's restore reads back: [payload, exchange, routing key], stamped now
        for message in got:
            payload, exchange, routing_key = json.loads(redis_of_its_own.hget(unacked, message.delivery_tag))
            assert payload == message._raw
            assert [exchange, routing_key] == stock_entry[1:] == [lane_queue.name, lane_queue.name]
            assert abs(redis_of_its_own.zscore(index, message.delivery_tag) - time.time()) < 60
        # and the ack removes each (kombu's own ack)
        for message in got:
            message.ack()
        assert redis_of_its_own.hlen(unacked) == 0 and redis_of_its_own.zcard(index) == 0
        assert got[0].channel.qos.can_consume_max_estimate() == 3


def test_messages_taken_by_a_worker_that_died_are_restored_by_kombus_sweep(redis_of_its_own, lane_queue):
    # given three messages taken in one turn and never acked (the worker killed:
    # no restore at shutdown)
    publish(lane_queue, 3)
    conn = kombu.Connection(broker_url(), transport=kombu_redis.Transport)
    got = one_turn(conn, lane_queue, prefetch=3)
    assert len(got) == 3 and redis_of_its_own.llen(lane_queue.name) == 0
    got[0].channel.qos._delivered.clear()
    conn.release()
    # when kombu's stock sweep runs past the visibility timeout
    with kombu.Connection(broker_url(), transport="redis",
                          transport_options={"visibility_timeout": 0}) as other:
        other.default_channel.qos.restore_visible(num=100, interval=1)
    # then all three are back on the queue, whole, and the bookkeeping is empty
    restored = [json.loads(item) for item in redis_of_its_own.lrange(lane_queue.name, 0, -1)]
    assert sorted(item["properties"]["delivery_tag"] for item in restored) == sorted(m.delivery_tag for m in got)
    assert sorted(item["body"] for item in restored) == sorted(m._raw["body"] for m in got)
    unacked = got[0].channel.unacked_key
    assert redis_of_its_own.hlen(unacked) == 0


@pytest.fixture
def transport_aliases():
    saved = dict(kombu.transport.TRANSPORT_ALIASES)
    yield
    kombu.transport.TRANSPORT_ALIASES.clear()
    kombu.transport.TRANSPORT_ALIASES.update(saved)
    kombu.transport._transport_cache.pop("redis", None)


def test_once_installed_the_redis_schemes_resolve_to_the_batched_transport(transport_aliases):
    assert kombu.Connection("redis://127.0.0.1:6379/0").transport_cls != kombu_redis.Transport
    lane_pickup_install()
    for url in ("redis://127.0.0.1:6379/0", "redis+socket:///tmp/redis.sock"):
        assert type(kombu.Connection(url).transport) is kombu_redis.Transport


def test_a_message_the_take_cannot_read_is_left_on_the_queue_and_the_take_stops_before_it(
        redis_of_its_own, lane_queue):
    # given two messages, then something that is not kombu's, then one more
    publish(lane_queue, 2)
    redis_of_its_own.lpush(lane_queue.name, "not a kombu message")
    publish(lane_queue, 1)
    with kombu.Connection(broker_url(), transport=kombu_redis.Transport) as conn:
        # when a consumer with room for ten reads once
        got = one_turn(conn, lane_queue, prefetch=10)
        # then it has the two before it, and the rest waits in order, nothing lost
        assert [message.payload for message in got] == [{"n": 0}, {"n": 1}]
        waiting = redis_of_its_own.lrange(lane_queue.name, 0, -1)
        assert waiting[-1] == "not a kombu message" and len(waiting) == 2
        assert json.loads(waiting[0])["properties"]["delivery_tag"] not in {m.delivery_tag for m in got}
        assert redis_of_its_own.hlen(got[0].channel.unacked_key) == 2
