"""Lua scripts and the one way to call one.

Every script is its own ``.lua`` file beside the Python that calls it, with
its KEYS/ARGV contract in its header (``LuaScript``). A call is described
once (``ScriptCall``: script, KEYS, ARGV and how to read the reply) and run
by a sync or an async caller that differ only in the await; both translate
"Redis is unreachable" the same way (``BudgetUnavailable``). On a cluster,
redis-py's ``Script`` routes the call by its keys and loads the script on
every primary that answers NOSCRIPT."""

from __future__ import annotations

import hashlib
import importlib.resources
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import hiredis
import redis
import redis.asyncio as aioredis

from budgets.errors import BudgetUnavailable
from budgets.redis.clients import REDIS_UNAVAILABLE, AsyncRedis, SyncRedis, get_async_redis, get_redis

T = TypeVar("T")


# Per client (forgotten with it), the scripts registered on it.
_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lua_script(client, source: str):
    """The client's registered script for ``source``. register_script keeps the
    SHA and reloads the source after SCRIPT FLUSH or a Redis restart
    (NoScriptError -> SCRIPT LOAD -> EVALSHA)."""
    registered = _scripts.setdefault(client, {})
    script = registered.get(source)
    if script is None:
        script = registered[source] = client.register_script(source)
    return script


class LuaScript:
    """One ``.lua`` file next to the Python that calls it, read once at import;
    ``library``: a file of local functions several scripts share, put before it."""

    def __init__(self, package: str, filename: str, *, library: str | None = None):
        files = importlib.resources.files(package)
        prelude = files.joinpath(library).read_text() + "\n" if library else ""
        self._set(f"{package}/{filename}", prelude + files.joinpath(filename).read_text())

    @classmethod
    def of_source(cls, name: str, source: str) -> LuaScript:
        script = cls.__new__(cls)
        script._set(name, source)
        return script

    def _set(self, name: str, source: str) -> None:
        self.name, self.source = name, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()  # as Redis names a loaded script

    def __repr__(self) -> str:
        return f"LuaScript({self.name})"


@dataclass(frozen=True)
class ScriptCall(Generic[T]):
    """One call of a script: its KEYS and ARGV, built once, and how to turn
    the reply into a typed result. ``run`` and ``run_async`` differ only in
    the await."""

    script: LuaScript
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]

    def run(self, client: SyncRedis | None = None) -> T:
        client = client or get_redis()
        try:
            if type(client) is redis.Redis and client.connection is None:
                raw = _evalsha(client, self.script, self.keys, self.args)
            else:  # a cluster client routes by slot; a single-connection client holds its own
                raw = lua_script(client, self.script.source)(keys=self.keys, args=self.args)
        except REDIS_UNAVAILABLE as exc:
            raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc
        return self.parse(raw)

    async def run_async(self, client: AsyncRedis | None = None) -> T:
        client = client or get_async_redis()
        try:
            if type(client) is aioredis.Redis and not client.single_connection_client:
                raw = await _evalsha_async(client, self.script, self.keys, self.args)
            else:
                raw = await lua_script(client, self.script.source)(keys=self.keys, args=self.args)
        except REDIS_UNAVAILABLE as exc:
            raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc
        return self.parse(raw)


def _evalsha_packed(script: LuaScript, keys: list[str], args: list[Any]) -> list[bytes]:
    try:
        return [hiredis.pack_command(("EVALSHA", script.sha, len(keys), *keys, *args))]
    except TypeError as exc:  # an argument Redis cannot take (None, a dict): redis-py says DataError
        raise redis.exceptions.DataError(str(exc)) from exc


def _evalsha(client: redis.Redis, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
    """One EVALSHA on one of the client's pooled connections, sent as
    redis-py's own command path sends it: the same packing (hiredis, which
    redis-py's serializer calls too), the same connection handling (a
    connection Redis closed while idle is replaced at checkout; one that
    fails mid-call is dropped by redis-py's own send and read, and goes
    through the connection's ``Retry``, which with Sluice's clients raises),
    the same answer and errors; NOSCRIPT (after SCRIPT FLUSH or a restart)
    loads the script and sends it again, as ``register_script`` does. What
    it leaves out is the layers redis-py puts around every command
    (``Script``, ``execute_command``'s argument checks, response callbacks
    and observability hooks), a sizeable share of a call's CPU on a path
    that makes several calls per request (bench/PROFILE.md).
    ``_evalsha_async`` is the same steps, awaited."""
    packed = _evalsha_packed(script, keys, args)
    pool = client.connection_pool
    conn = pool.get_connection()

    def once() -> Any:
        conn.send_packed_command(packed)
        try:
            return conn.read_response()
        except redis.exceptions.NoScriptError:
            conn.send_command("SCRIPT", "LOAD", script.source)
            conn.read_response()
            conn.send_packed_command(packed)
            return conn.read_response()

    try:
        return conn.retry.call_with_retry(once, lambda error: conn.disconnect())
    finally:
        pool.release(conn)


async def _evalsha_async(client: aioredis.Redis, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
    """``_evalsha`` on an async client. A caller cancelled mid-call (its
    client left) leaves no half-read answer behind: redis-py's send and read
    drop the connection on any interruption."""
    packed = _evalsha_packed(script, keys, args)
    pool = client.connection_pool
    conn = await pool.get_connection()

    async def once() -> Any:
        await conn.send_packed_command(packed)
        try:
            return await conn.read_response()
        except redis.exceptions.NoScriptError:
            await conn.send_command("SCRIPT", "LOAD", script.source)
            await conn.read_response()
            await conn.send_packed_command(packed)
            return await conn.read_response()

    async def dropped(error: Exception) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, dropped)
    finally:
        await pool.release(conn)


def raw_reply(raw: Any) -> Any:
    """``parse`` for scripts whose reply callers read as it is."""
    return raw
