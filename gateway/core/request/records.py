"""A request's record in Redis, shared by the web process that admitted it and
the worker that runs it (the Celery message carries only the id and the
delivery's generation); what happened to it (``Outcome``); the two scripts
that hand it over between the sides (``claim.lua``: who owns the outcome,
``publish.lua``: deliver it once); and its ledger row, built here once for
every place that writes one."""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from django.conf import settings

from budgets.redis.composition import Step, answered
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.ledger.pricing import TokenPrice
from budgets.ledger.writer import LedgerEntry
from gateway.core import keys
from gateway.core.errors import error_body
from gateway.core.request.endpoints import CHAT_COMPLETIONS

CLAIM = LuaScript(__package__, "claim.lua")
RECORD_READ = LuaScript(__package__, "record_read.lua")
PUBLISH = LuaScript(__package__, "publish.lua")

# Who asks claim.lua (its header has the states and verdicts).
WORKER = "worker"
WATCH = "watch"
REAP = "reap"
# Its verdicts.
GAVE_UP = "gaveup"
EXPIRED = "expired"
REDELIVERED = "redelivered"
LOST = "lost"
RUNNING = "running"
SUPERSEDED = "superseded"
PUBLISHED = "published"
QUEUED = "queued"
REQUEUE = "requeue"
FINISH = "finish"


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    tenant_id: int
    workload_id: int
    pool_id: int
    pool_base_url: str
    pool_api_key_env: str
    model: str
    lane: str
    borrowed: bool
    estimated_input_tokens: int
    estimated_output_tokens: int
    admitted_ms: float
    deadline_ms: float
    payload: dict[str, Any]  # what the pool receives
    session_id: str = ""  # X-Session-Id: retries are budgeted per session
    job_id: str = ""  # set for async jobs (POST /v1/jobs)
    retry_deadline_ms: float = 0.0  # no retry may start after this (Redis clock)
    # The price in force at admission: settlement corrects the spend with it.
    price_input_per_million: str = ""
    price_output_per_million: str = ""
    price_id: int = 0  # 0: the model had no price at admission
    # YYYY-MM of the tenant's month-to-date its estimated cost is held against
    # ('' without a price): settlement corrects that month.
    spend_month: str = ""
    api_key_id: int = 0  # 0: no key (a cron firing)
    # "stream": true: the worker relays the pool's chunks through a Redis
    # Stream (gateway/core/request/streams.py); stream_usage: the caller asked for the
    # usage chunk (stream_options.include_usage). tokenizer: the pool's
    # encoding, to count the tokens of a stream cut short.
    stream: bool = False
    stream_usage: bool = False
    tokenizer: str = ""
    # The waiting web process's notice stream (its shared read's wake key,
    # gateway/web/stream_reads.py): each append to this request's stream
    # names the request there, so that read names only streams with news.
    # '' (a cluster, or a record of a web process without notices): none.
    stream_wake: str = ""
    # Admitted while the pool's circuit was open, or a retry of such a
    # request: it waits in the pool's held set, not on its lane (gateway/core/protection/held.py).
    held: bool = False
    # Routing across pools (gateway/core/request/routing.py): served by an
    # overflow slice; moved here after a failed call on another pool; and the
    # pools of its route after this one (ids in route order), where a call
    # that fails before its first token may move once.
    overflow: bool = False
    failed_over: bool = False
    fallback_pools: str = ""
    pool_slug: str = ""  # the x-sluice-pool header
    # The /v1 endpoint it came through: the worker posts to its pool path,
    # the ledger row names it (gateway/core/request/endpoints.py).
    endpoint: str = CHAT_COMPLETIONS

    @property
    def ledger_price(self) -> tuple[int, Decimal, Decimal] | None:
        if not self.price_id:
            return None
        return self.price_id, Decimal(self.price_input_per_million), Decimal(self.price_output_per_million)

    def actual_cost_micro(self, *, input_tokens: int, output_tokens: int) -> int:
        if not self.price_input_per_million:
            return 0
        price = TokenPrice(Decimal(self.price_input_per_million), Decimal(self.price_output_per_million))
        return price.cost_micro(input_tokens=input_tokens, output_tokens=output_tokens)

    def to_redis(self) -> dict[str, str]:
        # Field by field (dataclasses.asdict would deep-copy the payload first).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["payload"] = json.dumps(self.payload)
        data["borrowed"] = int(self.borrowed)
        data["stream"] = int(self.stream)
        data["stream_usage"] = int(self.stream_usage)
        data["held"] = int(self.held)
        data["overflow"] = int(self.overflow)
        data["failed_over"] = int(self.failed_over)
        return {k: str(v) for k, v in data.items()}

    @classmethod
    def from_redis(cls, data: dict[str, str]) -> RequestRecord:
        return cls(
            request_id=data["request_id"],
            tenant_id=int(data["tenant_id"]),
            workload_id=int(data["workload_id"]),
            pool_id=int(data["pool_id"]),
            pool_base_url=data["pool_base_url"],
            pool_api_key_env=data["pool_api_key_env"],
            model=data["model"],
            lane=data["lane"],
            borrowed=data["borrowed"] == "1",
            estimated_input_tokens=int(data["estimated_input_tokens"]),
            estimated_output_tokens=int(data["estimated_output_tokens"]),
            admitted_ms=float(data["admitted_ms"]),
            deadline_ms=float(data["deadline_ms"]),
            payload=json.loads(data["payload"]),
            session_id=data.get("session_id", ""),
            job_id=data.get("job_id", ""),
            retry_deadline_ms=float(data.get("retry_deadline_ms", 0) or 0),
            price_input_per_million=data.get("price_input_per_million", ""),
            price_output_per_million=data.get("price_output_per_million", ""),
            spend_month=data.get("spend_month", ""),
            price_id=int(data.get("price_id", 0) or 0),
            api_key_id=int(data.get("api_key_id", 0) or 0),
            stream=data.get("stream") == "1",
            stream_usage=data.get("stream_usage") == "1",
            tokenizer=data.get("tokenizer", ""),
            stream_wake=data.get("stream_wake", ""),
            held=data.get("held") == "1",
            overflow=data.get("overflow") == "1",
            failed_over=data.get("failed_over") == "1",
            fallback_pools=data.get("fallback_pools", ""),
            pool_slug=data.get("pool_slug", ""),
            endpoint=data.get("endpoint") or CHAT_COMPLETIONS,
        )


@dataclass(frozen=True)
class Outcome:
    """What happened to a request: a pool response, or an error to relay."""

    # "ok" | "queue_timeout" | "upstream_error" | "invalid_request" (the pool
    # refused it as malformed) | "worker_error" (the worker failed on it) |
    # "worker_lost" (its worker died mid-call and none could take it over) |
    # "cancelled" (a stream whose caller went away: the pool call was closed)
    status: str
    http_status: int = 200
    body: dict[str, Any] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    queue_wait_ms: int = 0
    upstream_ms: int = 0
    retry_after_ms: int | None = None
    attempts: int = 0
    upstream_status: int = 0
    # The pool's own message with an error status (truncated), for the ledger.
    upstream_message: str = ""
    upstream_429s: int = 0
    # Where the charged tokens come from: "pool" (its usage), "counted" (a
    # stream cut short, its text counted with the pool's tokenizer),
    # "estimate" (the pool may have run it, nobody knows how far); "" when
    # nothing is charged.
    usage_source: str = ""
    # Chunks went to the caller through the request's Redis Stream: the body
    # is not a JSON answer, and the web process ends the stream with it.
    streamed: bool = False
    # Streams: ms until the pool's first chunk (pool_stream gives it per
    # attempt; request execution turns it into ms since admission).
    ttft_ms: int | None = None
    # The pool that answered (its slug), when the call moved from the pool it
    # was admitted on (gateway/worker/failover.py); '' otherwise.
    pool: str = ""
    # Streams: the pool's id for the answer, read from its chunks (an
    # answer in one piece carries it in ``body``).
    completion_id: str = ""

    @property
    def answer_id(self) -> str:
        """The pool's id for the answer (``chatcmpl-...``: what the SDK
        returns to the caller), "" when none came back."""
        if self.completion_id:
            return self.completion_id
        found = (self.body or {}).get("id") if self.status == "ok" and not self.streamed else None
        return found if isinstance(found, str) else ""

    @property
    def ledger_error(self) -> str:
        """The ledger row's ``error``: the error code, and for a pool's error
        answer its status and message ("upstream_error (pool answered 503:
        model is loading)"), so a failure can be told apart later."""
        if self.status == "ok":
            return ""
        code = str((self.body or {}).get("error", {}).get("code", ""))
        if self.upstream_status and self.upstream_status >= 400:
            said = f": {self.upstream_message}" if self.upstream_message else ""
            return f"{code} (pool answered {self.upstream_status}{said})"[:500]
        return code

    def to_json(self) -> str:
        # Field by field, not dataclasses.asdict: that deep-copies the body
        # (the pool's whole answer) before json.dumps walks it again.
        return json.dumps({name: getattr(self, name) for name in _OUTCOME_FIELDS})

    @classmethod
    def from_json(cls, raw: str) -> Outcome:
        return cls(**json.loads(raw))


_OUTCOME_FIELDS = tuple(f.name for f in fields(Outcome))


def ttl_ms() -> int:
    return settings.SLUICE_RESULT_TTL_S * 1000


@dataclass(frozen=True)
class Claim:
    verdict: str
    generation: int  # the delivery the verdict is about
    changed: bool  # this call moved the state: the caller acts on the verdict
    now_ms: float  # Redis's clock when it was decided
    answered: bool = False  # the pool's answer was stored when it was decided


def _claim(raw) -> Claim:
    return Claim(verdict=raw[0], generation=int(raw[1]), changed=int(raw[2]) == 1, now_ms=float(raw[3]),
                 answered=int(raw[4]) == 1)


_process_tokens: dict[int, str] = {}


def heartbeat_holder(kind: str) -> str:
    """Who holds a heartbeat: ``worker@host:pid:token``. The token tells apart
    processes that share a host name and a pid (containers all run as pid 1)."""
    pid = os.getpid()
    token = _process_tokens.setdefault(pid, uuid.uuid4().hex[:8])
    return f"{kind}@{socket.gethostname()}:{pid}:{token}"


def heartbeat_value(generation: int | str, holder: str) -> str:
    """A running call's heartbeat: ``<generation>|<holder>``, as claim.lua
    writes it at a delivery's start and reads it at every claim."""
    return f"{generation}|{holder}"


def heartbeat_generation(value: str | None) -> str:
    """The delivery generation a heartbeat names ('' for none)."""
    return (value or "").split("|", 1)[0]


def claim_call(role: str, record: RequestRecord, *, generation: int = 0, holder: str = "") -> ScriptCall[Claim]:
    """One step of claim.lua: ``role`` WORKER (``generation``: the delivery
    dequeued), WATCH (the waiting web process) or REAP (the reaper)."""
    request_id = record.request_id
    return ScriptCall(
        script=CLAIM,
        keys=[keys.request_owner(request_id), keys.request_heartbeat(request_id), keys.request_response(request_id),
              keys.request_result_published(request_id)],
        args=[role, record.deadline_ms, record.retry_deadline_ms or record.deadline_ms, ttl_ms(), generation,
              int(settings.SLUICE_HEARTBEAT_TTL_S * 1000), holder or heartbeat_holder(role),
              int(settings.SLUICE_REDELIVERY_WAIT_S * 1000)],
        parse=_claim,
    )


def record_claim_steps(request_id: str, *, generation: int, holder: str) -> tuple[Step, Step]:
    """A worker's first two steps of a delivery: ``record`` reads the record
    (its fields as a dict, empty when there is none) and, only if there is
    one, ``claim`` claims it as WORKER with the record's own deadlines (None
    when there was no record). Both keys carry the request's tag, so they
    are one script on a cluster too."""
    record_key = keys.request_record(request_id)
    read = ScriptCall(script=RECORD_READ, keys=[record_key],
                      args=[], parse=lambda raw: dict(zip(raw[1::2], raw[2::2])) if int(raw[0]) == 1 else {})
    claim = ScriptCall(
        script=CLAIM,
        keys=[keys.request_owner(request_id), keys.request_heartbeat(request_id), keys.request_response(request_id),
              keys.request_result_published(request_id), record_key],
        args=[WORKER, "", "", ttl_ms(), generation, int(settings.SLUICE_HEARTBEAT_TTL_S * 1000), holder,
              int(settings.SLUICE_REDELIVERY_WAIT_S * 1000)],
        parse=_claim,
    )
    return Step("record", read), Step("claim", claim, only_if=answered("record", 1))


def worker_lost_outcome(record: RequestRecord, *, queue_wait_ms: int = 0) -> Outcome:
    """A call whose worker was lost and that no delivery could take over in
    time. The pool may have run it: charged on its estimate, and said so."""
    return Outcome(
        status="worker_lost", http_status=503, queue_wait_ms=queue_wait_ms, retry_after_ms=1000,
        input_tokens=record.estimated_input_tokens, output_tokens=record.estimated_output_tokens,
        body=error_body(message="The worker running this request was lost and no other could take it over in "
                                "time; it is charged on its estimate. Retry shortly.",
                        error_type="service_unavailable", code="worker_lost"),
        usage_source="estimate", streamed=record.stream,
    )


def publish_call(record: RequestRecord, outcome: Outcome) -> ScriptCall[bool]:
    """Push the outcome for the waiting web process, once (True: pushed now)."""
    return ScriptCall(script=PUBLISH,
                      keys=[keys.request_result(record.request_id), keys.request_result_published(record.request_id)],
                      args=[outcome.to_json(), ttl_ms()], parse=lambda raw: int(raw) == 1)


def ledger_entry(record: RequestRecord, *, status: str, actual_input_tokens: int = 0, actual_output_tokens: int = 0,
                 queue_wait_ms: int = 0, upstream_ms: int = 0, total_ms: int = 0, attempts: int = 0,
                 error: str = "", usage_source: str = "", ttft_ms: int | None = None,
                 completion_id: str = "") -> LedgerEntry:
    """The request's one ledger row, priced at the price in force when it was admitted."""
    return LedgerEntry(
        request_id=record.request_id,
        created_at=datetime.fromtimestamp(record.admitted_ms / 1000, tz=timezone.utc),
        tenant_id=record.tenant_id, workload_id=record.workload_id, pool_id=record.pool_id,
        model=record.model, lane=record.lane, status=status, borrowed=record.borrowed,
        overflow=record.overflow, failed_over=record.failed_over,
        estimated_input_tokens=record.estimated_input_tokens, estimated_output_tokens=record.estimated_output_tokens,
        actual_input_tokens=actual_input_tokens, actual_output_tokens=actual_output_tokens,
        queue_wait_ms=queue_wait_ms, upstream_ms=upstream_ms, total_ms=total_ms, ttft_ms=ttft_ms, attempts=attempts,
        error=error, usage_source=usage_source, price=record.ledger_price, api_key_id=record.api_key_id or None,
        completion_id=completion_id,
        endpoint=record.endpoint,
    )
