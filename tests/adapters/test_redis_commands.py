"""Plain commands in one round trip (budgets.redis.composition
Commands): the same writes and replies as redis-py's pipeline on a plain
client, sync and async, with and without MULTI/EXEC; a refused command
raises after every reply is read (the connection stays in step); a closed
connection is replaced; cluster-like and single-connection clients go
through redis-py's own pipeline."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from budgets.redis.composition import Commands

KEY = "sluice:test:{commands}"


def _fill(pipe, n: int) -> None:
    pipe.hset(f"{KEY}:h", mapping={"a": n, "b": "ü x", "c": 1.5})
    pipe.pexpire(f"{KEY}:h", 60_000)
    pipe.hincrby(f"{KEY}:m", "k", 2)
    pipe.zadd(f"{KEY}:z", {"m1": 10.5, "m2": n})
    pipe.lpush(f"{KEY}:l", "first", "second")
    pipe.zrem(f"{KEY}:z", "m1", "nope")
    pipe.hdel(f"{KEY}:h", "c", "nope")


def _state(client) -> tuple:
    return (client.hgetall(f"{KEY}:h"), client.pttl(f"{KEY}:h") > 0, client.hget(f"{KEY}:m", "k"),
            client.zrange(f"{KEY}:z", 0, -1, withscores=True), client.lrange(f"{KEY}:l", 0, -1))


def _delete(client) -> None:
    client.delete(f"{KEY}:h", f"{KEY}:m", f"{KEY}:z", f"{KEY}:l")


@pytest.mark.parametrize("transaction", [False, True])
def test_the_writes_and_replies_are_redis_pys_pipelines(redis_client, transaction):
    # given the same commands, once through redis-py's pipeline and once as Commands
    pipe = redis_client.pipeline(transaction=transaction)
    _fill(pipe, 3)
    theirs, theirs_state = pipe.execute(), _state(redis_client)
    _delete(redis_client)
    ours = Commands(transaction=transaction)
    _fill(ours, 3)
    replies = ours.run(redis_client)
    # then Redis holds the same, and the replies are Redis's own (no callbacks: PEXPIRE's 1 is True's)
    assert _state(redis_client) == theirs_state
    assert replies == [3, 1, 2, 2, 2, 1, 1] and [int(r) for r in theirs] == replies


def test_an_empty_set_of_commands_sends_nothing(redis_client):
    assert Commands().run(redis_client) == [] and Commands(transaction=True).run(redis_client) == []


def test_a_refused_command_raises_after_every_reply_is_read_and_the_rest_ran(redis_client):
    # given a list whose second command Redis refuses (HINCRBY on a list)
    redis_client.lpush(f"{KEY}:l", "x")
    commands = Commands().hset(f"{KEY}:h", "a", 1).hincrby(f"{KEY}:l", "k", 1).lpush(f"{KEY}:l2", "y")
    # when it runs, the error is the one Redis sent
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        commands.run(redis_client)
    # and the others ran (no transaction), and the pooled connection answers the next call in step
    assert redis_client.hget(f"{KEY}:h", "a") == "1" and redis_client.lrange(f"{KEY}:l2", 0, -1) == ["y"]
    assert Commands().hincrby(f"{KEY}:m", "k", 5).run(redis_client) == [5]
    redis_client.delete(f"{KEY}:l2")


def test_in_a_transaction_a_runtime_error_raises_and_a_queueing_error_aborts_all(redis_client):
    redis_client.lpush(f"{KEY}:l", "x")
    # a runtime error: EXEC ran the rest, the error is raised
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        Commands(transaction=True).hincrby(f"{KEY}:l", "k", 1).hset(f"{KEY}:h", "a", 1).run(redis_client)
    assert redis_client.hget(f"{KEY}:h", "a") == "1"
    # a command Redis refuses while queueing (wrong arity): EXECABORT, nothing ran
    commands = Commands(transaction=True).hset(f"{KEY}:h", "b", 2)
    commands.commands.append(("HDEL", f"{KEY}:h"))
    with pytest.raises(redis.exceptions.ExecAbortError):
        commands.run(redis_client)
    assert redis_client.hget(f"{KEY}:h", "b") is None
    assert Commands(transaction=True).hincrby(f"{KEY}:m", "k", 1).run(redis_client) == [1]


def test_a_bad_argument_raises_data_error_as_redis_py_does(redis_client):
    with pytest.raises(redis.exceptions.DataError):
        Commands().hset(f"{KEY}:h", "a", None).run(redis_client)
    with pytest.raises(redis.exceptions.DataError):
        redis_client.hset(f"{KEY}:h", "a", None)


def test_a_connection_redis_closed_is_replaced(redis_client):
    client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    assert Commands().hincrby(f"{KEY}:m", "k", 1).run(client) == [1]
    assert redis_client.client_kill_filter(_id=client.client_id()) == 1
    assert Commands().hincrby(f"{KEY}:m", "k", 1).run(client) == [2]
    client.close()


def test_a_single_connection_client_uses_its_own_connection_through_redis_pys_pipeline(redis_client):
    client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, single_connection_client=True)
    # redis-py's callbacks apply there (PEXPIRE: True)
    assert Commands().hset(f"{KEY}:h", "a", 1).pexpire(f"{KEY}:h", 5000).run(client) == [1, True]
    client.close()


@pytest.mark.parametrize("transaction", [False, True])
def test_async_the_writes_replies_and_errors_are_the_sync_ones(redis_client, transaction):
    async def main() -> tuple:
        client = aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        try:
            ours = Commands(transaction=transaction)
            _fill(ours, 4)
            replies = await ours.run_async(client)
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                await Commands(transaction=transaction).hincrby(f"{KEY}:l", "k", 1).run_async(client)
            after = await Commands(transaction=transaction).hincrby(f"{KEY}:m", "k", 1).run_async(client)
            return replies, after
        finally:
            await client.aclose()

    replies, after = asyncio.run(main())
    assert replies == [3, 1, 2, 2, 2, 1, 1] and after == [3]
    assert redis_client.hgetall(f"{KEY}:h") == {"a": "4", "b": "ü x"}


def test_any_command_goes_as_redis_names_it_a_blocking_read_included(redis_client):
    # SET NX: OK the first time, None after
    assert Commands().command("SET", f"{KEY}:s", "v", "NX", "PX", 60_000).run(redis_client) == ["OK"]
    assert Commands().command("SET", f"{KEY}:s", "w", "NX", "PX", 60_000).run(redis_client) == [None]
    assert redis_client.get(f"{KEY}:s") == "v"
    redis_client.delete(f"{KEY}:s")
    blocking = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_timeout=None)

    async def pop() -> list:
        client = aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_timeout=None)
        try:
            waiting = asyncio.ensure_future(Commands().command("BLPOP", f"{KEY}:l", 5).run_async(client))
            await asyncio.sleep(0.05)
            await client.lpush(f"{KEY}:l", "answer")  # another connection of the same pool
            woken = await waiting
            empty = await Commands().command("BLPOP", f"{KEY}:l", 0.05).run_async(client)
            return [woken, empty]
        finally:
            await client.aclose()

    # a BLPOP wakes at the push with [key, value], and times out with None
    assert asyncio.run(pop()) == [[[f"{KEY}:l", "answer"]], [None]]
    assert Commands().command("BLPOP", f"{KEY}:l", 0.05).run(blocking) == [None]
    blocking.close()
