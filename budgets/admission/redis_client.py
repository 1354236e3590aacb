"""Redis connections for the buckets, and the one way to call a Lua script.

Short timeouts on the admission path: when Redis is gone or hung the gateway
must say 503 within a second, not hang. A script call is described once
(``ScriptCall``: script, KEYS, ARGV and how to read the reply) and run by a
sync or an async caller that differ only in the await; both translate
"Redis is unreachable" the same way (``BudgetUnavailable``). A flow of
several calls (hold spend, admit, take the hold back if the pool refused) is
written once as a ``Plan`` and run by ``plan_run`` or ``plan_run_async``.

With ``SLUICE_REDIS_CLUSTER`` the clients are redis-py's cluster clients
(``REDIS_URL`` names any node; the client finds the rest). They route a
script call by its keys, which must share one hash slot (the key modules
tag them: ``{pool:<id>}``, ``{<request id>}``), and load a script on every
primary when a node answers NOSCRIPT."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import importlib.resources
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator, Generic, TypeVar, Union

import hiredis
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aioredis_cluster
import redis.cluster
from asgiref.sync import sync_to_async
from django.conf import settings

from budgets.errors import BudgetUnavailable

T = TypeVar("T")
logger = logging.getLogger(__name__)

# What "Redis is not answering" looks like from redis-py: a refused or reset
# connection, a read that timed out (a hung server: redis-py's TimeoutError is
# not a ConnectionError), or the socket failing underneath.
# On a cluster also: the cluster (or the shard holding a slot) is down or
# failing over, or a slot is moving (TRYAGAIN).
REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
    redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError, redis.exceptions.TryAgainError,
)

# Either a single Redis or a cluster: both offer the commands Sluice uses.
SyncRedis = redis.Redis | redis.cluster.RedisCluster
AsyncRedis = aioredis.Redis | aioredis_cluster.RedisCluster

_sync_clients: dict[str, SyncRedis] = {}
_sync_lock = threading.Lock()
_async_clients: dict[tuple[int, str], AsyncRedis] = {}


def _options(blocking: bool) -> dict:
    timeout = settings.SLUICE_REDIS_TIMEOUT_S
    return {
        "socket_connect_timeout": timeout,
        # Blocking reads (BLPOP for a result) set their own server-side timeout.
        "socket_timeout": None if blocking else timeout,
        "health_check_interval": 30,
        "decode_responses": True,
    }


def get_redis(*, blocking: bool = False) -> SyncRedis:
    key = "blocking" if blocking else "fast"
    client = _sync_clients.get(key)
    if client is None:
        with _sync_lock:
            client = _sync_clients.get(key)
            if client is None:
                if settings.SLUICE_REDIS_CLUSTER:
                    # max_connections: per node on a cluster.
                    client = redis.cluster.RedisCluster.from_url(settings.REDIS_URL, max_connections=512,
                                                                 **_options(blocking))
                else:
                    client = redis.Redis.from_url(settings.REDIS_URL, max_connections=512, **_options(blocking))
                _sync_clients[key] = client
    return client


def get_async_redis(*, blocking: bool = False) -> AsyncRedis:
    """One client per event loop (a client's connections belong to its loop)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), "blocking" if blocking else "fast")
    client = _async_clients.get(key)
    if client is None:
        if settings.SLUICE_REDIS_CLUSTER:
            client = aioredis_cluster.RedisCluster.from_url(settings.REDIS_URL, max_connections=4096,
                                                            **_options(blocking))
        else:
            client = aioredis.Redis.from_url(settings.REDIS_URL, max_connections=4096, **_options(blocking))
        _async_clients[key] = client
    return client


def reset_clients() -> None:
    """Forget cached clients (after a fork, or in tests that restart Redis)."""
    _sync_clients.clear()
    _async_clients.clear()
    _scripts.clear()


_scripts: dict[tuple[int, str], object] = {}


def lua_script(client, source: str):
    """The client's registered script for ``source``. register_script keeps the
    SHA and reloads the source after SCRIPT FLUSH or a Redis restart
    (NoScriptError -> SCRIPT LOAD -> EVALSHA)."""
    key = (id(client), source)
    script = _scripts.get(key)
    if script is None:
        script = client.register_script(source)
        _scripts[key] = script
    return script


def redis_now_ms(client: SyncRedis | None = None) -> float:
    """Redis's clock in ms: every host measures deadlines on the same clock
    (on a cluster, one node's: keep the nodes' clocks in sync, as any
    cluster needs for its own failure detection)."""
    seconds, micros = (client or get_redis()).time()
    return seconds * 1000 + micros / 1000


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


class Sent(Generic[T]):
    """A round trip sent, its answer read later: once, by whichever thread
    asks first (``result``; the others get the same answer or exception).
    Lets a round trip overlap other work, another round trip included; the
    sender makes sure someone reads it (the connection goes back to its pool
    only then)."""

    def __init__(self, read: Callable[[], T]) -> None:
        self._read: Callable[[], T] | None = read
        self._lock = threading.Lock()
        self._value: T | None = None
        self._error: BaseException | None = None

    def result(self) -> T:
        with self._lock:
            if self._read is not None:
                read, self._read = self._read, None
                try:
                    self._value = read()
                except BaseException as exc:  # noqa: BLE001 - kept for every reader
                    self._error = exc
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    @property
    def read(self) -> bool:
        return self._read is None


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

    def send(self, client: SyncRedis | None = None) -> Sent[T] | None:
        """Send the call now and read its answer later (``Sent``), so that
        other work overlaps its round trip: the answer is what ``run``
        returns or raises. None where the client is not a plain single
        Redis: the caller runs the call instead."""
        client = client or get_redis()
        if not (type(client) is redis.Redis and client.connection is None):
            return None
        packed = _evalsha_packed(self.script, self.keys, self.args)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed)
        except REDIS_UNAVAILABLE as exc:
            pool.release(conn)  # redis-py's send dropped the connection
            raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc

        def read() -> T:
            try:
                try:
                    raw = conn.read_response()
                except redis.exceptions.NoScriptError:
                    conn.send_command("SCRIPT", "LOAD", self.script.source)
                    conn.read_response()
                    conn.send_packed_command(packed)
                    raw = conn.read_response()
            except REDIS_UNAVAILABLE as exc:
                conn.disconnect()
                raise BudgetUnavailable(f"{self.script.name}: {exc}") from exc
            finally:
                pool.release(conn)
            return self.parse(raw)
        return Sent(read)

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
    and observability hooks): about 20 µs of CPU of a call's 70, and a lane
    worker makes about ten per request (bench/PROFILE.md, round 5).
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


class Commands:
    """Plain commands for one round trip, queued with the pipeline methods
    their callers use (``hset(key, mapping=...)``, ``pexpire``, ``hincrby``,
    ``zadd``, ``lpush``, ``zrem``, ``hdel``) and run together: in order, on
    one connection. On a plain client they go out as ``_evalsha`` sends a
    script, packed by hiredis and read back without redis-py's ``Pipeline``
    (its command stack, per-command callbacks and argument checks: about
    half of a short pipeline's CPU, bench/PROFILE.md round 6); elsewhere (a
    cluster client, a single-connection client) through redis-py's own
    pipeline, or its ``execute_command`` for one command alone (a blocking
    read must not wait inside a pipeline). ``transaction``: wrapped in
    MULTI/EXEC, as a redis-py pipeline's default is. The replies are Redis's
    own, decoded as the client decodes (on the plain path without redis-py's
    per-command callbacks: PEXPIRE's 1, not True); a command Redis refused
    raises its ``ResponseError`` once every reply is read, so the connection
    stays in step."""

    __slots__ = ("commands", "transaction")

    def __init__(self, *, transaction: bool = False) -> None:
        self.commands: list[tuple] = []
        self.transaction = transaction

    def hset(self, name: str, key: str | None = None, value: Any = None, mapping: dict | None = None) -> Commands:
        items: list[Any] = [] if key is None else [key, value]
        for k, v in (mapping or {}).items():
            items += (k, v)
        self.commands.append(("HSET", name, *items))
        return self

    def pexpire(self, name: str, ms: int) -> Commands:
        self.commands.append(("PEXPIRE", name, int(ms)))
        return self

    def hincrby(self, name: str, key: str, amount: int = 1) -> Commands:
        self.commands.append(("HINCRBY", name, key, int(amount)))
        return self

    def zadd(self, name: str, mapping: dict) -> Commands:
        items: list[Any] = []
        for member, score in mapping.items():
            items += (score, member)
        self.commands.append(("ZADD", name, *items))
        return self

    def sadd(self, name: str, *members: Any) -> Commands:
        self.commands.append(("SADD", name, *members))
        return self

    def zrem(self, name: str, *members: Any) -> Commands:
        self.commands.append(("ZREM", name, *members))
        return self

    def hdel(self, name: str, *fields: Any) -> Commands:
        self.commands.append(("HDEL", name, *fields))
        return self

    def lpush(self, name: str, *values: Any) -> Commands:
        self.commands.append(("LPUSH", name, *values))
        return self

    def command(self, *args: Any) -> Commands:
        """Any other command, as Redis names it; its reply is Redis's own
        (HGETALL's a flat list, BLPOP's a list or None)."""
        self.commands.append(args)
        return self

    def _packed(self) -> list[bytes]:
        commands = [("MULTI",), *self.commands, ("EXEC",)] if self.transaction else self.commands
        try:
            # One buffer, one write: redis-py sends each item of a list on its own.
            return [b"".join([hiredis.pack_command(command) for command in commands])]
        except TypeError as exc:  # None, a dict: what redis-py refuses with DataError
            raise redis.exceptions.DataError(str(exc)) from exc

    def _pipeline_of(self, client):
        pipe = client.pipeline(transaction=self.transaction)
        for command in self.commands:
            pipe.execute_command(*command)
        return pipe

    def _replies(self, raw: list[Any]) -> list[Any]:
        if self.transaction:
            raw = raw[-1]  # EXEC's: the queued commands' replies
            if isinstance(raw, BaseException):
                raise raw
        errors = [reply for reply in raw if isinstance(reply, redis.exceptions.ResponseError)]
        if errors:
            raise errors[0]
        return raw

    def run(self, client: SyncRedis | None = None) -> list[Any]:
        client = client or get_redis()
        if not self.commands:
            return []
        if not (type(client) is redis.Redis and client.connection is None):
            if len(self.commands) == 1 and not self.transaction:  # a blocking read must not go in a pipeline
                return [client.execute_command(*self.commands[0])]
            return self._pipeline_of(client).execute()
        packed = self._packed()
        count = len(self.commands) + (2 if self.transaction else 0)
        pool = client.connection_pool
        conn = pool.get_connection()

        def once() -> list[Any]:
            conn.send_packed_command(packed)
            return [_reply(conn.read_response) for _ in range(count)]

        try:
            return self._replies(conn.retry.call_with_retry(once, lambda error: conn.disconnect()))
        finally:
            pool.release(conn)

    def send(self, client: SyncRedis | None = None) -> Sent[list[Any]] | None:
        """Send the commands now, their replies read later (``Sent``: what
        ``run`` returns or raises); None where ``run`` would not send them
        as one buffer (no commands, or not a plain single Redis)."""
        client = client or get_redis()
        if not self.commands or not (type(client) is redis.Redis and client.connection is None):
            return None
        packed = self._packed()
        count = len(self.commands) + (2 if self.transaction else 0)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed)
        except BaseException:
            pool.release(conn)  # redis-py's send dropped the connection
            raise

        def read() -> list[Any]:
            try:
                return self._replies([_reply(conn.read_response) for _ in range(count)])
            except REDIS_UNAVAILABLE:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        return Sent(read)

    async def run_async(self, client: AsyncRedis | None = None) -> list[Any]:
        client = client or get_async_redis()
        if not self.commands:
            return []
        if not (type(client) is aioredis.Redis and not client.single_connection_client):
            if len(self.commands) == 1 and not self.transaction:
                return [await client.execute_command(*self.commands[0])]
            return await self._pipeline_of(client).execute()
        packed = self._packed()
        count = len(self.commands) + (2 if self.transaction else 0)
        pool = client.connection_pool
        conn = await pool.get_connection()

        async def once() -> list[Any]:
            await conn.send_packed_command(packed)
            replies = []
            for _ in range(count):
                try:
                    replies.append(await conn.read_response())
                except redis.exceptions.ResponseError as refused:
                    replies.append(refused)
            return replies

        async def dropped(error: Exception) -> None:
            await conn.disconnect()

        try:
            return self._replies(await conn.retry.call_with_retry(once, dropped))
        finally:
            await pool.release(conn)


def _reply(read: Callable[[], Any]) -> Any:
    """One reply; a command Redis refused gives its error as the reply."""
    try:
        return read()
    except redis.exceptions.ResponseError as refused:
        return refused


# Several script calls in one round trip: each script's text becomes a local
# function of one composed script (its KEYS and ARGV are the function's
# parameters, so the text runs unchanged), called in order on its own slice
# of the composed call's KEYS and ARGV; a step that answers an error ends it
# there, with that error. A step may be guarded: it runs only when the step
# before it ran and answered a table whose first element is one of the
# guard's values (comma-separated: budgets/admission/admit.lua's 1,
# gateway/core/circuit.lua's 'go'), and
# is skipped (false) otherwise. Each step also gets the answers of the steps
# before it (PREVIOUS, a table; nil when a step runs on its own), which only
# a step written to follow others reads (gateway/core/enqueue.lua). Atomic
# together, as one script is; every key must share a hash slot on a cluster
# (the callers' keys share their pool's tag). Composed once per sequence of
# scripts.
_COMPOSE_TAIL = """
local n = tonumber(ARGV[1])
local ki, ai = 1, 2 + 3 * n
local out = {}
for i = 1, n do
  local nk, na, guard = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), ARGV[3 * i + 1]
  local k, a = {}, {}
  for j = 1, nk do k[j] = KEYS[ki]; ki = ki + 1 end
  for j = 1, na do a[j] = ARGV[ai]; ai = ai + 1 end
  local go = guard == ''
  if not go and i > 1 and type(out[i - 1]) == 'table' and out[i - 1][1] ~= nil then
    go = string.find(',' .. guard .. ',', ',' .. tostring(out[i - 1][1]) .. ',', 1, true) ~= nil
  end
  local r = false
  if go then
    r = STEPS[i](k, a, out)
    if r == nil then r = false end
    -- A step that answers an error ends the script with it: the calls after
    -- it do not run, and the caller hears the error, as when run one by one.
    if type(r) == 'table' and r.err then return r end
  end
  out[i] = r
end
return out
"""
_composed: dict[tuple[str, ...], LuaScript] = {}


def _composed_script(scripts: tuple[LuaScript, ...]) -> LuaScript:
    names = tuple(script.name for script in scripts)
    composed = _composed.get(names)
    if composed is None:
        parts = [f"local function step_{i}(KEYS, ARGV, PREVIOUS)\n{script.source}\nend\n"
                 for i, script in enumerate(scripts)]
        steps = ", ".join(f"step_{i}" for i in range(len(scripts)))
        composed = LuaScript.of_source("+".join(names),
                                       "".join(parts) + f"local STEPS = {{{steps}}}\n" + _COMPOSE_TAIL)
        _composed[names] = composed
    return composed


Guards = tuple[str, ...] | None


def _composed_call(calls: list[ScriptCall] | tuple[ScriptCall, ...], guards: Guards = None) -> ScriptCall[list]:
    counts: list[Any] = [len(calls)]
    for i, call in enumerate(calls):
        counts += [len(call.keys), len(call.args), guards[i] if guards else ""]
    return ScriptCall(script=_composed_script(tuple(call.script for call in calls)),
                      keys=[key for call in calls for key in call.keys],
                      args=counts + [arg for call in calls for arg in call.args], parse=list)


def _parsed(calls, raws: list[Any], guards: Guards) -> list[Any]:
    # A guarded step that was skipped comes back as None, unparsed.
    return [None if guards and guards[i] and raw is None else call.parse(raw)
            for i, (call, raw) in enumerate(zip(calls, raws))]


def _guard_passes(guard: str, previous_raw: Any) -> bool:
    return (isinstance(previous_raw, list) and bool(previous_raw)
            and str(previous_raw[0]) in guard.split(","))


def _one_by_one(calls, guards: Guards, run) -> list[Any]:
    """The calls as separate round trips, guards applied as the composed script does."""
    results, previous = [], None
    for i, call in enumerate(calls):
        guard = guards[i] if guards else ""
        if guard and not _guard_passes(guard, previous):
            results.append(None)
            previous = None
            continue
        previous = run(ScriptCall(script=call.script, keys=call.keys, args=call.args, parse=raw_reply))
        results.append(call.parse(previous))
    return results


def script_calls_run(calls: list[ScriptCall], client: SyncRedis | None = None, *, guards: Guards = None) -> list[Any]:
    """Run ``calls`` in order as one script (one round trip); each result
    parsed as its own call would parse it. ``guards``: per call, '' or the
    values the previous call's first element must have for it to run (a
    skipped call's result is None)."""
    if len(calls) == 1:
        return [calls[0].run(client)]
    if not calls:
        return []
    return _parsed(calls, _composed_call(calls, guards).run(client), guards)


@dataclass(frozen=True)
class Together:
    """Script calls whose keys carry different hash tags (a pool's and a
    request's, a pool's and a tenant's), run in order and each parsed as its
    own call would be: in one round trip, one composed script, on a single
    Redis; one after another on a cluster, where no script may touch two
    slots. Callers count only on the order, never on the calls being atomic
    together (they are on a single Redis, not on a cluster), and a call
    that raises stops the ones after it either way. ``guards`` as for
    ``script_calls_run``, applied the same way on both paths."""

    calls: tuple[ScriptCall, ...]
    guards: Guards = None

    def run(self, client: SyncRedis | None = None) -> list[Any]:
        client = client or get_redis()
        if isinstance(client, redis.cluster.RedisCluster):
            return _one_by_one(self.calls, self.guards, lambda call: call.run(client))
        return script_calls_run(list(self.calls), client, guards=self.guards)

    def send(self, client: SyncRedis | None = None) -> Sent[list[Any]] | None:
        """``ScriptCall.send`` for the calls together, as ``run`` would run
        them on a single Redis (one composed script); None on a cluster."""
        client = client or get_redis()
        if isinstance(client, redis.cluster.RedisCluster) or not self.calls:
            return None
        if len(self.calls) == 1:
            call = self.calls[0]
            sent = ScriptCall(script=call.script, keys=call.keys, args=call.args,
                              parse=lambda raw: [call.parse(raw)]).send(client)
        else:
            composed = _composed_call(self.calls, self.guards)
            sent = ScriptCall(script=composed.script, keys=composed.keys, args=composed.args,
                              parse=lambda raw: _parsed(self.calls, raw, self.guards)).send(client)
        return sent

    async def run_async(self, client: AsyncRedis | None = None) -> list[Any]:
        client = client or get_async_redis()
        if isinstance(client, aioredis_cluster.RedisCluster) or len(self.calls) == 1:
            results, previous = [], None
            for i, call in enumerate(self.calls):
                guard = self.guards[i] if self.guards else ""
                if guard and not _guard_passes(guard, previous):
                    results.append(None)
                    previous = None
                    continue
                previous = await ScriptCall(script=call.script, keys=call.keys, args=call.args,
                                            parse=raw_reply).run_async(client)
                results.append(call.parse(previous))
            return results
        if not self.calls:
            return []
        raws = await _composed_call(self.calls, self.guards).run_async(client)
        return _parsed(self.calls, raws, self.guards)


# A flow of script calls written once: a generator that yields each step and
# receives its result (or has its exception thrown in at the yield), and
# returns the flow's result. A step is a ScriptCall, several calls run
# Together (their results as a list), or a plain callable for blocking work
# between calls (rebuilding config from the database).
Step = Union[ScriptCall, Together, Callable[[], Any]]
Plan = Generator[Step, Any, T]


def plan_run(plan: Plan[T], client: redis.Redis | None = None) -> T:
    """Run a plan's steps synchronously."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(result)
        except StopIteration as done:
            return done.value
        result, error = None, None
        try:
            result = step.run(client) if isinstance(step, (ScriptCall, Together)) else step()
        except Exception as exc:  # noqa: BLE001 - the plan decides what it handles
            error = exc


async def plan_run_async(plan: Plan[T], client: aioredis.Redis | None = None) -> T:
    """``plan_run`` for async callers: script calls awaited, blocking steps in a thread."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(result)
        except StopIteration as done:
            return done.value
        result, error = None, None
        try:
            if isinstance(step, (ScriptCall, Together)):
                result = await step.run_async(client)
            else:
                result = await sync_to_async(step, thread_sensitive=False)()
        except Exception as exc:  # noqa: BLE001 - the plan decides what it handles
            error = exc


def parked_release(*, key: str, now_ms: float, send: Callable[[str], None], what: str, limit: int = 100,
                   client: SyncRedis | None = None) -> int:
    """Hand every member of the sorted set ``key`` due by ``now_ms`` to
    ``send`` (retries parked with their due time as score). ZREM is the
    claim, so several releasers send each once; a member whose ``send``
    raised is parked again for 1 s. Returns how many were sent."""
    client = client or get_redis()
    released = 0
    for member in client.zrangebyscore(key, "-inf", now_ms, start=0, num=limit):
        if not client.zrem(key, member):
            continue
        try:
            send(member)
            released += 1
        except Exception:
            logger.exception("enqueueing %s %s failed; retrying in 1 s", what, member)
            client.zadd(key, {member: now_ms + 1000})
    return released


def raw_reply(raw: Any) -> Any:
    """``parse`` for scripts whose reply callers read as it is."""
    return raw


# A page that falls back to what the database holds when Redis is away says
# so: readers note the failure here, and the web UI shows a banner for the
# request (llm_platform/degraded.py starts a fresh note per request).
_unavailable_note: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("redis_unavailable", default=None)


def unavailable_note_start() -> None:
    _unavailable_note.set([])


def unavailable_note(what: str) -> None:
    """Record that ``what`` was served without Redis (no-op outside a request)."""
    logger.warning("%s: Redis unavailable, falling back", what, exc_info=True)
    notes = _unavailable_note.get()
    if notes is not None:
        notes.append(what)


def unavailable_noted() -> list[str]:
    return list(_unavailable_note.get() or [])
