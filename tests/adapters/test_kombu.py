"""adapters/kombu.py: its channel's client reuse, and what it relies on in
kombu and redis-py, so that an upgrade that changes any of it fails here
first. Against the real Redis the tests' broker uses."""

from __future__ import annotations

import inspect
import threading

from celery import current_app
from kombu.transport import redis as kombu_redis

from adapters.kombu import Channel


def _counting_create_client(channel) -> list[bool]:
    """Record each call of the channel's ``_create_client`` (its
    ``asynchronous`` argument), still handing out what it would."""
    calls: list[bool] = []
    create = channel._create_client

    def counted(asynchronous: bool = False):
        calls.append(asynchronous)
        return create(asynchronous=asynchronous)

    channel._create_client = counted
    return calls


def test_kombu_builds_its_sync_clients_where_the_adapter_overrides_it():
    # given kombu's channel, as the adapter was written against
    parameters = inspect.signature(kombu_redis.Channel._create_client).parameters
    assert list(parameters) == ["self", "asynchronous"] and parameters["asynchronous"].default is False
    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        calls = _counting_create_client(channel)
        # when a command and the unacked bookkeeping take their client
        with channel.conn_or_acquire() as client:
            assert client is channel._sync_client
        with channel.qos.pipe_or_acquire() as pipe:
            assert pipe.connection_pool is channel.pool
        # then both went through _create_client, for a sync client
        assert calls == [False, False]


def test_kombu_builds_its_pool_lazily_and_drops_it_on_reconnect():
    # The adapter's client follows ``_pool``: kombu must still build it in
    # ``pool`` when it is None and set it back to None when it lets it go.
    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        pool = channel.pool
        assert channel._pool is pool
        client = channel._create_client()
        channel._disconnect_pools()
        assert channel._pool is None
        assert channel._create_client() is not client
        assert channel._pool is not None and channel._pool is not pool


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
        assert got[0].connection_pool is channel.pool
