"""Micro-bench (issue 31): the CPU of the request path's Redis calls, with and
without adapters/redis.py: one EVALSHA through ``ScriptCall.run`` (the
adapter) against redis-py's registered ``Script``, and three plain commands
through ``Commands.run`` (the adapter) against a redis-py ``Pipeline``, on
the same plain client, the same Redis, in the same run.

CPU is this process's (``time.process_time``), not wall time; the ways
alternate in rounds so drift of the machine hits them alike. Reports each
way's median and range over the rounds and the ratio of the medians, never
an absolute target. Needs a Redis: ``REDIS_URL`` (default: the test Redis).

Run alone: ``python -m bench.redis_call_overhead [--calls N] [--rounds N]``."""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))  # no database, no sessions: any will do
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402

from budgets.redis.composition import Commands  # noqa: E402
from budgets.redis.scripts import LuaScript, ScriptCall, lua_script  # noqa: E402

SCRIPT = LuaScript.of_source("bench/redis_call_overhead", "redis.call('HINCRBY', KEYS[1], 'n', 1)\n"
                                                          "return {1, ARGV[1], ARGV[2]}")
KEYS = ("sluice:bench:{rco}:h", "sluice:bench:{rco}:r", "sluice:bench:{rco}:l")


def main(*, calls: int, rounds: int) -> dict:
    client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    call = ScriptCall(script=SCRIPT, keys=[KEYS[0]], args=["a", 2], parse=list)
    registered = lua_script(client, SCRIPT.source)

    def script_adapter() -> None:
        call.run(client)

    def script_redis_py() -> None:
        registered(keys=call.keys, args=call.args, client=client)

    def commands_adapter() -> None:
        Commands().hset(KEYS[1], mapping={"a": 1, "b": 2}).pexpire(KEYS[1], 1000).lpush(KEYS[2], "x").run(client)

    def commands_redis_py() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.hset(KEYS[1], mapping={"a": 1, "b": 2})
        pipe.pexpire(KEYS[1], 1000)
        pipe.lpush(KEYS[2], "x")
        pipe.execute()

    ways = {"script, adapter": script_adapter, "script, redis-py Script": script_redis_py,
            "3 commands, adapter": commands_adapter, "3 commands, redis-py Pipeline": commands_redis_py}
    us: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            for _ in range(200):
                fn()
            started = time.process_time()
            for _ in range(calls):
                fn()
            us[name].append((time.process_time() - started) / calls * 1e6)
            client.delete(KEYS[2])
    client.delete(*KEYS)
    result = {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)} for name, v in us.items()}
    for name, row in result.items():
        print(f"{name:32s} {row['median_us']:7.1f} us CPU per call (rounds {row['min_us']:.1f}-{row['max_us']:.1f})")
    for adapter, stock in (("script, adapter", "script, redis-py Script"),
                           ("3 commands, adapter", "3 commands, redis-py Pipeline")):
        print(f"{adapter} / {stock}: {result[adapter]['median_us'] / result[stock]['median_us']:.2f}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main(calls=args.calls, rounds=args.rounds)
