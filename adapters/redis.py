"""redis-py without its per-command layers, for the request path's hot calls:
one EVALSHA, or several plain commands in one write, on one of a plain
client's pooled connections.

Written against: redis-py 8.2.0 and hiredis 3.5.0 (sync and asyncio clients).

Replaces: ``Script.__call__`` (``register_script``) and ``Pipeline.execute``
on a plain single-Redis client. What redis-py puts around every command is
left out: ``execute_command``'s argument checks, response callbacks, the
pipeline's command stack, event dispatch and observability hooks. What a
call relies on is redis-py's own: the pool's checkout and release (a
connection Redis closed while idle is replaced at checkout), the packing
(``hiredis.pack_command``, which redis-py's own packer calls), the
connection's ``send_packed_command`` / ``read_response`` (a connection that
fails mid-call is dropped by them) and its ``Retry``, the same replies and
errors. NOSCRIPT (after SCRIPT FLUSH or a restart) loads the script and
sends it again, as ``Script`` does. A cluster client, or a client holding a
single connection of its own, goes through redis-py's API instead (the
callers check ``lean_client``).

Measured gain: ``python -m bench.redis_call_overhead`` (CPU per call against
a real Redis, alternated rounds): an EVALSHA here costs about 0.6x of
``Script.__call__``, three commands in one write about 0.55x of a
``Pipeline`` (73.6 against 132.0 us, 89.7 against 170.3 us on a 2-core
machine that adds 10 million integers in 2.15 s); a request makes about
four script calls and two or three command batches: about 0.4 ms of its
~10, 4% of its CPU.

Guarded by: tests/adapters/test_redis_scripts.py and tests/adapters/test_redis_commands.py,
which hold every call to what redis-py's registered script and pipeline
answer (replies, errors, NOSCRIPT reload, a connection closed by Redis or
broken mid-call, a caller cancelled mid-answer), sync and async."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis


def lean_client(client) -> bool:
    """Whether ``client`` is a plain single-Redis client drawing connections from its pool."""
    return type(client) is redis.Redis and client.connection is None


def lean_async_client(client) -> bool:
    return type(client) is aioredis.Redis and not client.single_connection_client


def _packed(commands: Sequence[Sequence[Any]]) -> list[bytes]:
    try:
        # One buffer, one write: redis-py sends each item of a list on its own.
        return [b"".join([hiredis.pack_command(tuple(command)) for command in commands])]
    except TypeError as exc:  # an argument Redis cannot take (None, a dict): redis-py says DataError
        raise redis.exceptions.DataError(str(exc)) from exc


def _evalsha_command(sha: str, keys: list[str], args: list[Any]) -> list[bytes]:
    return _packed([("EVALSHA", sha, len(keys), *keys, *args)])


def evalsha(client: redis.Redis, *, sha: str, source: str, keys: list[str], args: list[Any]) -> Any:
    """One EVALSHA of the script ``source`` (whose SHA1 is ``sha``)."""
    packed = _evalsha_command(sha, keys, args)
    pool = client.connection_pool
    conn = pool.get_connection()

    def once() -> Any:
        conn.send_packed_command(packed)
        try:
            return conn.read_response()
        except redis.exceptions.NoScriptError:
            conn.send_command("SCRIPT", "LOAD", source)
            conn.read_response()
            conn.send_packed_command(packed)
            return conn.read_response()

    try:
        return conn.retry.call_with_retry(once, lambda error: conn.disconnect())
    finally:
        pool.release(conn)


async def evalsha_async(client: aioredis.Redis, *, sha: str, source: str, keys: list[str], args: list[Any]) -> Any:
    """``evalsha`` on an async client. A caller cancelled mid-call leaves no
    half-read answer behind: redis-py's send and read drop the connection on
    any interruption."""
    packed = _evalsha_command(sha, keys, args)
    pool = client.connection_pool
    conn = await pool.get_connection()

    async def once() -> Any:
        await conn.send_packed_command(packed)
        try:
            return await conn.read_response()
        except redis.exceptions.NoScriptError:
            await conn.send_command("SCRIPT", "LOAD", source)
            await conn.read_response()
            await conn.send_packed_command(packed)
            return await conn.read_response()

    async def dropped(error: Exception) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, dropped)
    finally:
        await pool.release(conn)


def commands_framed(commands: Sequence[Sequence[Any]], transaction: bool) -> list[Sequence[Any]]:
    """``commands`` as they go out: inside MULTI/EXEC when ``transaction``."""
    return [("MULTI",), *commands, ("EXEC",)] if transaction else list(commands)


def commands_send(client: redis.Redis, commands: Sequence[Sequence[Any]], *, transaction: bool) -> list[Any]:
    """``commands`` in one write, inside MULTI/EXEC if ``transaction``; every
    reply in order (MULTI's and EXEC's included), a command Redis refused
    giving its ``ResponseError`` as its reply, so the connection stays in step."""
    framed = commands_framed(commands, transaction)
    packed = _packed(framed)
    pool = client.connection_pool
    conn = pool.get_connection()

    def reply() -> Any:
        try:
            return conn.read_response()
        except redis.exceptions.ResponseError as refused:
            return refused

    def once() -> list[Any]:
        conn.send_packed_command(packed)
        return [reply() for _ in framed]

    try:
        return conn.retry.call_with_retry(once, lambda error: conn.disconnect())
    finally:
        pool.release(conn)


async def commands_send_async(client: aioredis.Redis, commands: Sequence[Sequence[Any]], *,
                              transaction: bool) -> list[Any]:
    """``commands_send`` on an async client."""
    framed = commands_framed(commands, transaction)
    packed = _packed(framed)
    pool = client.connection_pool
    conn = await pool.get_connection()

    async def once() -> list[Any]:
        await conn.send_packed_command(packed)
        replies = []
        for _ in framed:
            try:
                replies.append(await conn.read_response())
            except redis.exceptions.ResponseError as refused:
                replies.append(refused)
        return replies

    async def dropped(error: Exception) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, dropped)
    finally:
        await pool.release(conn)
