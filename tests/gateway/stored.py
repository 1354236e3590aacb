"""Helpers of the gateway tests that work on Redis directly: a request
admitted and stored as the web side stores it, and Redis's own MONITOR."""

from __future__ import annotations

import threading
import uuid

from budgets.admission.buckets import admit
from gateway.core import keys
from gateway.core.metrics import arrival_commands
from gateway.core.request.records import RequestRecord

HELLO = [{"role": "user", "content": "Are you still there?"}]


def admitted(redis_client, caller, request_id: str, *, queue_s: float = 10.0, retry_s: float = 70.0,
             output_tokens: int = 7) -> RequestRecord:
    """A request admitted (12 + 30 tokens estimated) and stored as the web
    side stores it, on the interactive lane."""
    pool = caller.pool
    admission = admit(pool_id=pool.id, workload_id=caller.workload.id, request_id=request_id, input_tokens=12,
                      output_tokens=30, lease_ttl_ms=120_000)
    record = RequestRecord(
        request_id=request_id, tenant_id=caller.tenant.id, workload_id=caller.workload.id, pool_id=pool.id,
        pool_base_url=pool.base_url, pool_api_key_env="", model="sim-small", lane="interactive", borrowed=False,
        estimated_input_tokens=12, estimated_output_tokens=30, admitted_ms=admission.admitted_ms,
        deadline_ms=admission.admitted_ms + queue_s * 1000, retry_deadline_ms=admission.admitted_ms + retry_s * 1000,
        payload={"model": "sim-small", "messages": HELLO, "max_tokens": 30, "sim": {"output_tokens": output_tokens}},
    )
    pipe = redis_client.pipeline(transaction=False)
    pipe.hset(keys.request_record(request_id), mapping=record.to_redis())
    arrival_commands(pipe, pool_id=pool.id, lane=record.lane, request_id=request_id,
                     expires_ms=admission.admitted_ms + 120_000)
    pipe.execute()
    return record


class RedisMonitor:
    """Every command Redis runs while it is on, as redis-py's MONITOR reads
    them: (client type, command), a script's own commands as ``lua``. Other
    processes' commands show too.

    An EVALSHA that a Redis without the script answered NOSCRIPT ran
    nothing: its sender loads the script on the same connection and sends
    it again (budgets/redis/scripts.py), so an EVALSHA followed on
    its connection by SCRIPT LOAD is left out (MONITOR shows no replies).
    Otherwise a test's first script call on a fresh Redis would count twice."""

    def __init__(self, redis_client) -> None:
        self._client = redis_client
        self._end = f"monitor-end-{uuid.uuid4().hex}"
        self._seen: list[tuple[str, str] | None] = []
        self._monitor = redis_client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        evalsha_last: dict[tuple, int] = {}  # connection -> index of its EVALSHA, when that was its last command
        while True:
            command = self._monitor.next_command()
            text = command["command"]
            if self._end in text:
                return
            if command["client_type"] != "lua":
                conn = (command.get("client_address"), command.get("client_port"))
                last = evalsha_last.pop(conn, None)
                if last is not None and text.upper().startswith("SCRIPT LOAD"):
                    self._seen[last] = None  # answered NOSCRIPT: it ran nothing
                if text.upper().startswith("EVALSHA"):
                    evalsha_last[conn] = len(self._seen)
            self._seen.append((command["client_type"], text))

    @property
    def commands(self) -> list[tuple[str, str]]:
        return [c for c in self._seen if c is not None]

    def stop(self) -> list[tuple[str, str]]:
        self._client.echo(self._end)
        self._thread.join(10)
        self._monitor.__exit__()
        return self.commands


def executed_watched(redis_client, record: RequestRecord, call) -> tuple[str, list[tuple[str, str]]]:
    """One delivery of ``record`` run in this process (``call``: its lane
    message's hint), and every command Redis ran meanwhile."""
    from gateway.worker.execution import request_execute

    monitor = RedisMonitor(redis_client)
    try:
        outcome = request_execute(request_id=record.request_id, call=call)
    finally:
        commands = monitor.stop()
    return outcome, commands
