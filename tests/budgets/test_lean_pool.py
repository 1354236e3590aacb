"""Sluice's Redis connection pools (budgets.admission.redis_client LeanPool,
LeanAsyncPool): redis-py's pools without their per-checkout metrics, and
every guarantee of a checkout kept, against a real Redis: a connection is
reused, one Redis closed while idle is replaced before it is handed out (no
error reaches the caller; the asyncio pool, like redis-py's, drops it at its
first failed read), one with unread data is not handed out as it is,
threads get connections of their own, a forked process gets a pool of its
own, and a connection given back twice or by another pool is ignored."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from budgets.admission.redis_client import LeanAsyncPool, LeanPool, get_async_redis, get_redis

KEY = "sluice:test:{leanpool}"


def _client() -> redis.Redis:
    return redis.Redis(connection_pool=LeanPool.from_url(settings.REDIS_URL, decode_responses=True))


def test_the_clients_sluice_builds_use_them():
    if settings.SLUICE_REDIS_CLUSTER:
        pytest.skip("a cluster client keeps redis-py's own pools per node")
    assert type(get_redis().connection_pool) is LeanPool
    assert type(get_redis(blocking=True).connection_pool) is LeanPool

    async def pool_type():
        return type(get_async_redis().connection_pool)

    assert asyncio.run(pool_type()) is LeanAsyncPool


def test_a_connection_is_reused_and_given_back(redis_client):
    client = _client()
    pool = client.connection_pool
    ids = {client.client_id() for _ in range(20)}
    assert len(ids) == 1
    assert len(pool._available_connections) == 1 and not pool._in_use_connections
    client.close()


def test_a_connection_redis_closed_while_idle_is_replaced_at_checkout(redis_client):
    client = _client()
    client.set(KEY, "1")
    first = client.client_id()
    assert redis_client.client_kill_filter(_id=first) == 1
    # the dead socket is found at checkout: the command itself never fails
    assert client.incr(KEY) == 2
    assert client.client_id() != first
    client.close()
    redis_client.delete(KEY)


def test_a_connection_with_unread_data_is_not_handed_out_as_it_is(redis_client):
    client = _client()
    pool = client.connection_pool
    conn = pool.get_connection()
    conn.send_command("PING")  # its reply is never read
    assert conn.can_read(timeout=5)  # the reply has arrived (into the parser's buffer)
    pool.release(conn)
    # the next checkout must not read that stale +PONG as its own reply
    assert client.echo("mine") == "mine"
    client.close()


def test_threads_get_connections_of_their_own(redis_client):
    client = _client()
    pool = client.connection_pool
    barrier = threading.Barrier(6)
    held, errors = [], []

    def hold():
        try:
            conn = pool.get_connection()
            held.append(conn)
            barrier.wait(5)  # all six out at once
            conn.send_command("PING")
            assert conn.read_response() in ("PONG", b"PONG")
            pool.release(conn)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=hold) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    assert len({id(c) for c in held}) == 6
    assert len(pool._available_connections) == 6 and not pool._in_use_connections
    client.close()


def test_a_forked_process_gets_a_pool_of_its_own(redis_client):
    client = _client()
    parent_id = client.client_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its connection's id, never the parent's socket
        try:
            os.write(write, str(client.client_id()).encode())
        finally:
            os._exit(0)
    os.close(write)
    child_id = int(os.read(read, 64) or 0)
    os.waitpid(pid, 0)
    os.close(read)
    assert child_id and child_id != parent_id
    assert client.client_id() == parent_id  # the parent's connection was left alone
    client.close()


def test_a_connection_given_back_twice_or_by_another_pool_is_ignored(redis_client):
    client, other = _client(), _client()
    pool = client.connection_pool
    conn = pool.get_connection()
    pool.release(conn)
    pool.release(conn)
    assert pool._available_connections == [conn]
    stranger = other.connection_pool.get_connection()
    pool.release(stranger)
    assert stranger not in pool._available_connections
    other.connection_pool.release(stranger)
    client.close()
    other.close()


def test_async_reuse_replacement_and_concurrent_checkouts(redis_client):
    async def run():
        client = aioredis.Redis(connection_pool=LeanAsyncPool.from_url(settings.REDIS_URL, decode_responses=True))
        pool = client.connection_pool
        first = await client.client_id()
        assert {await client.client_id() for _ in range(10)} == {first}
        assert redis_client.client_kill_filter(_id=first) == 1
        # As with redis-py's own asyncio pool, the stream does not show the
        # end of file before a read: the first command on the killed
        # connection may fail, and the connection is dropped, not reused.
        try:
            await client.echo("probe")
        except redis.exceptions.ConnectionError:
            pass
        assert await client.echo("after") == "after"
        assert await client.client_id() != first
        # concurrent commands each take a connection of their own
        replies = await asyncio.gather(*(client.execute_command("BLPOP", f"{KEY}:none", 0.2) for _ in range(5)))
        assert replies == [None] * 5
        assert len(pool._available_connections) == 5 and not pool._in_use_connections
        conn = await pool.get_connection()
        await pool.release(conn)
        await pool.release(conn)
        assert pool._available_connections.count(conn) == 1
        await client.aclose()

    asyncio.run(run())
