"""One script call on the sync client (budgets.redis.scripts
ScriptCall.run, its own EVALSHA on a pooled connection) answers exactly as
redis-py's registered script does, loads the script again after SCRIPT FLUSH,
replaces a connection Redis closed, and fails where redis-py fails."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis
import redis.asyncio as aioredis
from django.conf import settings

from budgets.redis.clients import get_redis
from budgets.redis.scripts import LuaScript, ScriptCall, lua_script
from budgets.errors import BudgetUnavailable

MIXED = LuaScript.of_source("test/mixed.lua", """
redis.call('HINCRBY', KEYS[1], 'n', 1)
return {tonumber(ARGV[1]) * 2, ARGV[2], {ARGV[3], 7}, false, redis.call('HGET', KEYS[1], 'n')}
""")
FAILING = LuaScript.of_source("test/failing.lua", "return redis.call('INCR', KEYS[1], 'one too many')")


def _call(script: LuaScript, args: list) -> ScriptCall:
    return ScriptCall(script=script, keys=["sluice:test:{script}"], args=args, parse=lambda raw: raw)


def test_the_answer_is_what_redis_pys_registered_script_returns(redis_client):
    # given one script and the same arguments (numbers, text with spaces and
    # non-ASCII, an empty string)
    args = [21, "a b ü", ""]
    # when it runs through ScriptCall and through redis-py's own Script
    ours = _call(MIXED, args).run()
    theirs = lua_script(get_redis(), MIXED.source)(keys=["sluice:test:{script}"], args=args)
    # then both answers have the same shape and values (the counter moved on by one)
    assert ours == [42, "a b ü", ["", 7], None, "1"]
    assert theirs == [42, "a b ü", ["", 7], None, "2"]


def test_the_script_is_loaded_again_after_script_flush(redis_client):
    # given a script Redis knows, then forgets
    assert _call(MIXED, [1, "x", "y"]).run()[4] == "1"
    redis_client.script_flush()
    assert redis_client.script_exists(MIXED.sha) == [False]
    # when it is called again
    answer = _call(MIXED, [1, "x", "y"]).run()
    # then it ran once more (loaded, not run twice) and Redis knows it again
    assert answer[4] == "2"
    assert redis_client.script_exists(MIXED.sha) == [True]


def test_a_connection_redis_closed_is_dropped_and_the_call_sent_again(redis_client):
    # given a client whose one pooled connection Redis has closed (as a restart does)
    client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    assert _call(MIXED, [1, "x", "y"]).run(client)[4] == "1"
    assert redis_client.client_kill_filter(_id=client.client_id()) == 1
    # when the next call goes out on it
    answer = _call(MIXED, [1, "x", "y"]).run(client)
    # then it reached Redis exactly once
    assert answer[4] == "2"
    client.close()


class _WriteFails:
    """A socket whose writes fail with a broken pipe; everything else is the socket's."""

    def __init__(self, sock: socket.socket) -> None:
        self._real = sock

    def sendall(self, data) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_a_connection_that_breaks_as_the_call_is_sent_fails_that_call_as_redis_py_does_and_is_replaced(
        redis_client):
    def broken_client() -> redis.Redis:
        # a client whose one pooled connection looks fine at checkout (its
        # socket is connected, nothing to read) but whose next write fails,
        # as a connection cut by the network does
        client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        client.ping()
        (connection,) = client.connection_pool._available_connections
        connection._sock = _WriteFails(connection._sock)
        return client

    # given such a client for ScriptCall and one for redis-py's own Script
    ours, theirs = broken_client(), broken_client()
    # when a call goes out on each
    with pytest.raises(BudgetUnavailable, match="Broken pipe"):
        _call(MIXED, [1, "x", "y"]).run(ours)
    with pytest.raises(redis.exceptions.ConnectionError, match="Broken pipe"):
        lua_script(theirs, MIXED.source)(keys=["sluice:test:{script}"], args=[1, "x", "y"])
    # then neither reached Redis, and the next call on each connects anew and runs once
    assert _call(MIXED, [1, "x", "y"]).run(ours)[4] == "1"
    assert lua_script(theirs, MIXED.source)(keys=["sluice:test:{script}"], args=[1, "x", "y"])[4] == "2"
    ours.close()
    theirs.close()


def test_a_script_error_and_a_bad_argument_raise_as_redis_py_raises(redis_client):
    # a script that fails inside Redis, and an argument Redis cannot take, each
    # raise the same error through ScriptCall as through redis-py's Script
    for run in (lambda script, args: _call(script, args).run(),
                lambda script, args: lua_script(get_redis(), script.source)(keys=["sluice:test:{script}"], args=args)):
        with pytest.raises(redis.exceptions.ResponseError, match="Wrong number of args"):
            run(FAILING, [])
        with pytest.raises(redis.exceptions.DataError):
            run(MIXED, [None, "x", "y"])


# The async client (the web process's): the same answers and failures.

SLOW = LuaScript.of_source("test/slow.lua", """
local t0 = redis.call('TIME')
repeat local t = redis.call('TIME') until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) >= 100000
return ARGV[1]
""")


def _async_client():
    return aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def test_async_the_answer_reloading_and_errors_are_as_redis_pys(redis_client):
    async def scenario():
        client = _async_client()
        ours = await _call(MIXED, [21, "a b ü", ""]).run_async(client)
        theirs = await lua_script(client, MIXED.source)(keys=["sluice:test:{script}"], args=[21, "a b ü", ""])
        await client.script_flush()
        reloaded = await _call(MIXED, [21, "a b ü", ""]).run_async(client)
        with pytest.raises(redis.exceptions.ResponseError, match="Wrong number of args"):
            await _call(FAILING, []).run_async(client)
        with pytest.raises(redis.exceptions.DataError):
            await _call(MIXED, [None, "x", "y"]).run_async(client)
        await client.aclose()
        return ours, theirs, reloaded

    ours, theirs, reloaded = asyncio.run(scenario())
    assert ours == [42, "a b ü", ["", 7], None, "1"]
    assert theirs == [42, "a b ü", ["", 7], None, "2"]
    assert reloaded == [42, "a b ü", ["", 7], None, "3"]


def test_async_a_call_cancelled_mid_answer_leaves_no_answer_for_the_next_call(redis_client):
    async def scenario():
        # given one connection in the client's pool, and a call on it that is
        # cancelled while Redis runs its script (the caller went away)
        client = _async_client()
        slow = asyncio.ensure_future(_call(SLOW, ["first"]).run_async(client))
        await asyncio.sleep(0.03)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        # when the next call is made on the same client
        answer = await _call(SLOW, ["second"]).run_async(client)
        await client.aclose()
        return answer

    # then it gets its own answer, not the cancelled call's
    assert asyncio.run(scenario()) == "second"


def test_async_a_connection_that_breaks_as_the_call_is_sent_fails_that_call_and_is_replaced(redis_client):
    async def scenario():
        client = _async_client()
        await client.ping()
        (connection,) = client.connection_pool._available_connections
        connection._writer.writelines = _raise_broken_pipe  # the next write fails, as on a cut connection
        with pytest.raises(BudgetUnavailable):
            await _call(MIXED, [1, "x", "y"]).run_async(client)
        answer = await _call(MIXED, [1, "x", "y"]).run_async(client)
        await client.aclose()
        return answer

    assert asyncio.run(scenario())[4] == "1"


def _raise_broken_pipe(data) -> None:
    raise BrokenPipeError(32, "Broken pipe")
