"""Lua scripts and the one way to call one.

Every script is its own ``.lua`` file beside the Python that calls it, with
its KEYS/ARGV contract in its header (``LuaScript``). A call is described
once (``ScriptCall``: script, KEYS, ARGV and how to read the reply) and run
by a sync or an async caller that differ only in the await; both translate
"Redis is unreachable" the same way (``BudgetUnavailable``). On a plain
client the EVALSHA goes out without redis-py's per-command layers
(adapters/redis.py). On a cluster,
redis-py's ``Script`` routes the call by its keys and loads the script on
every primary that answers NOSCRIPT."""

from __future__ import annotations

import hashlib
import importlib.resources
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar


from adapters.redis import evalsha, evalsha_async, lean_async_client, lean_client
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
            if lean_client(client):
                raw = evalsha(client, sha=self.script.sha, source=self.script.source, keys=self.keys, args=self.args)
            else:  # a cluster client routes by slot; a single-connection client holds its own
                raw = lua_script(client, self.script.source)(keys=self.keys, args=self.args)
        except REDIS_UNAVAILABLE as exc:
            raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc
        return self.parse(raw)

    async def run_async(self, client: AsyncRedis | None = None) -> T:
        client = client or get_async_redis()
        try:
            if lean_async_client(client):
                raw = await evalsha_async(client, sha=self.script.sha, source=self.script.source, keys=self.keys,
                                          args=self.args)
            else:
                raw = await lua_script(client, self.script.source)(keys=self.keys, args=self.args)
        except REDIS_UNAVAILABLE as exc:
            raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc
        return self.parse(raw)


def raw_reply(raw: Any) -> Any:
    """``parse`` for scripts whose reply callers read as it is."""
    return raw
