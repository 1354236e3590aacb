"""Several Redis steps in one round trip, and flows of them written once.

- ``Commands``: plain commands (HSET, LPUSH, BLPOP, ...) sent in one write
  and read back in order, optionally inside MULTI/EXEC.
- ``RoundTrip``: named script calls run in order. Each script's text
  becomes a local function of one composed script, called on its own slice
  of KEYS and ARGV, so the scripts stay separate files with separate tests.
  A step may run only if an earlier step answered one of some values
  (``Step(..., only_if=answered("admit", "1", "2"))``); a skipped step's
  answer is None. A step that answers an error ends the round trip with it.
  The answers come back by step name. On a single Redis the steps are one
  script, atomic together; on a cluster, where no script may touch two
  hash slots, steps whose keys span slots run one after another with the
  same conditions. Callers count only on the order, never on the steps being
  atomic together.
- ``Plan``: a flow of steps (script calls, round trips, blocking work such as
  rebuilding a config from the database) written once as a generator and
  run by a sync (``plan_run``) or an async (``plan_run_async``) caller that
  differ only in the await."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, TypeVar, Union

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aioredis_cluster
import redis.cluster
from asgiref.sync import sync_to_async
from redis.crc import key_slot

from adapters.redis import commands_framed, commands_send, commands_send_async, lean_async_client, lean_client
from budgets.redis.clients import AsyncRedis, SyncRedis, get_async_redis, get_redis
from budgets.redis.scripts import LuaScript, ScriptCall, raw_reply

T = TypeVar("T")


class Commands:
    """Plain commands for one round trip, queued with the pipeline methods
    their callers use (``hset(key, mapping=...)``, ``pexpire``, ``hincrby``,
    ``zadd``, ``lpush``, ``ltrim``, ``zrem``, ``hdel``) and run together: in
    order, on one connection. On a plain client they go out in one write and are read
    back without redis-py's ``Pipeline`` (adapters/redis.py); elsewhere (a
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

    def ltrim(self, name: str, start: int, end: int) -> Commands:
        self.commands.append(("LTRIM", name, int(start), int(end)))
        return self

    def command(self, *args: Any) -> Commands:
        """Any other command, as Redis names it; its reply is Redis's own
        (HGETALL's a flat list, BLPOP's a list or None)."""
        self.commands.append(args)
        return self

    def _pipeline_of(self, client):
        pipe = client.pipeline(transaction=self.transaction)
        for command in self.commands:
            pipe.execute_command(*command)
        return pipe

    def framed(self) -> list[tuple]:
        """The commands as they go out (MULTI/EXEC around them in a
        transaction), for a caller that sends several ``Commands`` in one
        write (``commands_send``) and hands each its slice of the replies
        (``replies``)."""
        return commands_framed(self.commands, self.transaction)

    @staticmethod
    def run_together(batches: list[Commands], client: SyncRedis | None = None) -> list[list[Any] | BaseException]:
        """Several batches in one write (one round trip on a plain client;
        one by one elsewhere): each batch's replies, or the
        ``ResponseError`` Redis refused one of its commands with. A lost
        connection raises, for all of them."""
        client = client or get_redis()
        out: list[list[Any] | BaseException] = []
        if not lean_client(client):
            for batch in batches:
                try:
                    out.append(batch.run(client))
                except redis.exceptions.ResponseError as refused:
                    out.append(refused)
            return out
        framed = [batch.framed() for batch in batches]
        raw = commands_send(client, [command for commands in framed for command in commands], transaction=False)
        at = 0
        for batch, commands in zip(batches, framed, strict=True):
            try:
                out.append(batch.replies(raw[at:at + len(commands)]))
            except redis.exceptions.ResponseError as refused:
                out.append(refused)
            at += len(commands)
        return out

    def replies(self, raw: list[Any]) -> list[Any]:
        """This batch's replies from its slice of a shared write's (``framed``)."""
        return self._replies(raw)

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
        if not lean_client(client):
            if len(self.commands) == 1 and not self.transaction:  # a blocking read must not go in a pipeline
                return [client.execute_command(*self.commands[0])]
            return self._pipeline_of(client).execute()
        return self._replies(commands_send(client, self.commands, transaction=self.transaction))

    async def run_async(self, client: AsyncRedis | None = None) -> list[Any]:
        client = client or get_async_redis()
        if not self.commands:
            return []
        if not lean_async_client(client):
            if len(self.commands) == 1 and not self.transaction:
                return [await client.execute_command(*self.commands[0])]
            return await self._pipeline_of(client).execute()
        return self._replies(await commands_send_async(client, self.commands, transaction=self.transaction))


@dataclass(frozen=True)
class Condition:
    """A step runs only if the step named ``step`` ran and answered a table
    whose first element is one of ``values``."""

    step: str
    values: tuple[str, ...]

    def holds(self, answer: Any) -> bool:
        return isinstance(answer, list) and bool(answer) and str(answer[0]) in self.values


def answered(step: str, *values: Any) -> Condition:
    return Condition(step=step, values=tuple(str(value) for value in values))


@dataclass(frozen=True)
class Step:
    """One named script call of a round trip."""

    name: str
    call: ScriptCall
    only_if: Condition | None = None


# The composed script's driver. ARGV[1] is the number of steps; then, per
# step, its KEYS count, its ARGV count, the index of the step its condition
# reads (0: none) and the condition's values, comma-separated; then every
# step's ARGV in order. KEYS are every step's KEYS in order.
_COMPOSE_TAIL = """
local n = tonumber(ARGV[1])
local ki, ai = 1, 2 + 4 * n
local out = {}
for i = 1, n do
  local at = 4 * (i - 1) + 1
  local nk, na, gi, values = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]), ARGV[at + 4]
  local k, a = {}, {}
  for j = 1, nk do k[j] = KEYS[ki]; ki = ki + 1 end
  for j = 1, na do a[j] = ARGV[ai]; ai = ai + 1 end
  local go = gi == 0
  if not go then
    local seen = out[gi]
    go = type(seen) == 'table' and seen[1] ~= nil
      and string.find(',' .. values .. ',', ',' .. tostring(seen[1]) .. ',', 1, true) ~= nil
  end
  local r = false
  if go then
    r = STEPS[i](k, a)
    if r == nil then r = false end
    -- A step that answers an error ends the script with it: the steps after
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
        # A script called by several steps is one function, called by each.
        unique = list(dict.fromkeys(scripts))
        parts = [f"local function step_{i}(KEYS, ARGV)\n{script.source}\nend\n" for i, script in enumerate(unique)]
        steps = ", ".join(f"step_{unique.index(script)}" for script in scripts)
        composed = LuaScript.of_source("+".join(names),
                                       "".join(parts) + f"local STEPS = {{{steps}}}\n" + _COMPOSE_TAIL)
        _composed[names] = composed
    return composed


class Answers(dict):
    """Each step's answer by its name, parsed as its call parses it (None:
    the step was skipped)."""


class RoundTrip:
    """Named script calls, run in order in one round trip (module docstring)."""

    def __init__(self, *steps: Step) -> None:
        names = [step.name for step in steps]
        if len(set(names)) != len(names):
            raise ValueError(f"step names repeat: {names}")
        for i, step in enumerate(steps):
            if step.only_if is not None and step.only_if.step not in names[:i]:
                raise ValueError(f"step {step.name!r} depends on {step.only_if.step!r}, which does not come before it")
        self.steps = steps
        self._index = {name: i for i, name in enumerate(names)}

    def _composed_call(self) -> ScriptCall[list]:
        counts: list[Any] = [len(self.steps)]
        for step in self.steps:
            condition = step.only_if
            counts += [len(step.call.keys), len(step.call.args),
                       0 if condition is None else self._index[condition.step] + 1,
                       "" if condition is None else ",".join(condition.values)]
        return ScriptCall(script=_composed_script(tuple(step.call.script for step in self.steps)),
                          keys=[key for step in self.steps for key in step.call.keys],
                          args=counts + [arg for step in self.steps for arg in step.call.args], parse=list)

    def _answers(self, raws: list[Any]) -> Answers:
        return Answers((step.name, None if step.only_if is not None and raw is None else step.call.parse(raw))
                       for step, raw in zip(self.steps, raws))

    def _spans_slots(self, client) -> bool:
        if not isinstance(client, (redis.cluster.RedisCluster, aioredis_cluster.RedisCluster)):
            return False
        return len({key_slot(key.encode()) for step in self.steps for key in step.call.keys}) > 1

    def _raw(self, step: Step) -> ScriptCall:
        return ScriptCall(script=step.call.script, keys=step.call.keys, args=step.call.args, parse=raw_reply)

    def _runs(self, step: Step, raws: dict[str, Any]) -> bool:
        return step.only_if is None or step.only_if.holds(raws.get(step.only_if.step))

    def run(self, client: SyncRedis | None = None) -> Answers:
        client = client or get_redis()
        if len(self.steps) == 1:
            return Answers({self.steps[0].name: self.steps[0].call.run(client)})
        if not self._spans_slots(client):
            return self._answers(self._composed_call().run(client))
        raws: dict[str, Any] = {}
        for step in self.steps:
            raws[step.name] = self._raw(step).run(client) if self._runs(step, raws) else None
        return self._answers([raws[step.name] for step in self.steps])

    async def run_async(self, client: AsyncRedis | None = None) -> Answers:
        client = client or get_async_redis()
        if len(self.steps) == 1:
            return Answers({self.steps[0].name: await self.steps[0].call.run_async(client)})
        if not self._spans_slots(client):
            return self._answers(await self._composed_call().run_async(client))
        raws: dict[str, Any] = {}
        for step in self.steps:
            raws[step.name] = await self._raw(step).run_async(client) if self._runs(step, raws) else None
        return self._answers([raws[step.name] for step in self.steps])


# A flow of Redis steps written once: a generator that yields each step and
# receives its result (or has its exception thrown in at the yield), and
# returns the flow's result. A step is a ScriptCall, a RoundTrip (its
# Answers), or a plain callable for blocking work between them (rebuilding
# a config from the database).
PlanStep = Union[ScriptCall, RoundTrip, Callable[[], Any]]
Plan = Generator[PlanStep, Any, T]


def plan_run(plan: Plan[T], client: SyncRedis | None = None) -> T:
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
            result = step.run(client) if isinstance(step, (ScriptCall, RoundTrip)) else step()
        except Exception as exc:  # noqa: BLE001 - the plan decides what it handles
            error = exc


async def plan_run_async(plan: Plan[T], client: AsyncRedis | None = None) -> T:
    """``plan_run`` for async callers: Redis steps awaited, blocking steps in a thread."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(result)
        except StopIteration as done:
            return done.value
        result, error = None, None
        try:
            if isinstance(step, (ScriptCall, RoundTrip)):
                result = await step.run_async(client)
            else:
                result = await sync_to_async(step, thread_sensitive=False)()
        except Exception as exc:  # noqa: BLE001 - the plan decides what it handles
            error = exc
