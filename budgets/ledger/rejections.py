"""Rejections counted in Redis per minute, flushed to the database in batches.

A storm of 429s must not become a storm of database writes (docs/architecture.md,
"Ledger"). One Lua call (``rejection_count.lua``) increments a minute's
counters by workload and reason, keeps the first few rejections of each
as detailed samples, and files every refusal's details under its request id
in an hourly hash kept 25 hours (``rejection_by_request_id`` finds it), so
the id a caller's 429 carried opens its refusal whether or not it was
sampled. The /v1 views note each refusal in the web process's
memory (``rejection_note``) and send the tally once per tick
(SLUICE_REJECTION_PUSH_S, and at exit): one call per pool minute for a
whole storm, instead of a round trip per refusal. Other callers count one at a time
(``rejection_count_call``, ``rejection_count``). A beat task (``budgets.flush_rejections``) moves closed minutes into
``RejectionStat`` / ``RejectionSample`` with a couple of bulk statements.

Exact and idempotent: the flush writes each minute's *total* (an upsert that
sets the count), then takes the minute off the pending list only if its total
did not move meanwhile (``rejection_ack.lua``). A late rejection for a flushed
minute puts it back on the list; the hash is still there (kept for
``MINUTE_TTL_S``), so the next flush rewrites the full count. A flush that dies
half-way is simply run again."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from budgets.admission import keys
from budgets.redis.clients import get_redis, unavailable_note
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.models import InferencePool, RejectionSample, RejectionStat
from tenants.models import ApiKey, Workload

logger = logging.getLogger(__name__)

COUNT = LuaScript(__package__, "rejection_count.lua")
ACK = LuaScript(__package__, "rejection_ack.lua")

# Minutes stay in Redis this long after their last rejection: long enough for
# the flush to catch up after an outage, short enough to bound memory.
MINUTE_TTL_S = 6 * 3600
# A minute is flushed once it ended this long ago (late arrivals after that
# are still counted exactly, they just cost another flush).
FLUSH_GRACE_S = 5
NO_POOL = 0
# A sample keeps the refusal's message (its numbers) up to this length.
SAMPLE_MESSAGE_CHARS = 300
# A refusal's details stay findable by its request id this long after the
# start of its hour: at least 24 hours for every refusal of the hour.
BY_ID_KEPT_S = 25 * 3600
# Refusals' details a process keeps per minute and field while Redis is away.
PUT_BACK_REFUSALS = 1000


def _minute_epoch(now_s: float) -> int:
    return int(now_s // 60) * 60


def _hour_epoch(now_s: float) -> int:
    return int(now_s // 3600) * 3600


def _sample_json(*, at_s: float, workload_id: int, tenant_id: int, pool: int, reason: str, estimated_tokens: int,
                 retry_after_ms: int | None, message: str, request_id: str = "", api_key_id: int | None = None) -> str:
    return json.dumps({
        "id": request_id or uuid.uuid4().hex, "at": round(at_s, 3), "wid": workload_id, "tid": tenant_id, "pid": pool,
        "kid": api_key_id or None, "reason": reason, "tokens": max(0, int(estimated_tokens or 0)),
        "retry_after_ms": None if retry_after_ms is None else max(0, int(retry_after_ms)),
        "message": (message or "")[:SAMPLE_MESSAGE_CHARS],
    }, separators=(",", ":"))


def _field(workload_id: int, tenant_id: int, reason: str) -> str:
    return f"{workload_id}|{tenant_id}|{reason}"


def _minute_call(pool: int, minute: int, fields: dict[str, tuple[int, list[tuple[str, str]]]]) -> ScriptCall[int]:
    """One script call for one pool's minute: ``fields`` maps a field to
    (count, refusals as (request id or "", JSON) in the order they happened)."""
    hour = _hour_epoch(minute)
    args: list = [minute, settings.SLUICE_REJECTION_SAMPLES_PER_MINUTE, MINUTE_TTL_S, hour + BY_ID_KEPT_S,
                  settings.SLUICE_REFUSAL_LOOKUP_PER_POOL_HOUR]
    for field, (n, refusals) in fields.items():
        args += [field, n, len(refusals)]
        for request_id, details in refusals:
            args += [request_id, details]
    return ScriptCall(
        script=COUNT,
        keys=[
            keys.rejection_minute_counts(pool, minute),
            keys.rejection_minute_samples(pool, minute),
            keys.rejection_pending_minutes(pool),
            keys.rejection_hour_refusals(pool, hour),
        ],
        args=args,
        parse=int,
    )


def rejection_count_call(*, pool_id: int | None, workload_id: int, tenant_id: int, reason: str,
                         estimated_tokens: int, retry_after_ms: int | None, message: str = "",
                         request_id: str = "", api_key_id: int | None = None,
                         now_s: float | None = None) -> ScriptCall[int]:
    """Count one rejection (one Redis round trip), keep it as a sample
    while the minute has room, and file it under its request id. Callers
    never let a failure here fail the rejected caller's response: losing a
    counter is the lesser harm."""
    now_s = time.time() if now_s is None else now_s
    pool = pool_id or NO_POOL
    sample = _sample_json(at_s=now_s, workload_id=workload_id, tenant_id=tenant_id, pool=pool, reason=reason,
                          estimated_tokens=estimated_tokens, retry_after_ms=retry_after_ms, message=message,
                          request_id=request_id, api_key_id=api_key_id)
    return _minute_call(pool, _minute_epoch(now_s), {_field(workload_id, tenant_id, reason): (1, [(request_id, sample)])})


def rejection_count(**kwargs) -> None:
    """``rejection_count_call(...).run()`` that never raises (by contract)."""
    try:
        rejection_count_call(**kwargs).run()
    except Exception:  # noqa: BLE001 - by contract
        logger.warning("could not count a %s rejection of workload %s", kwargs.get("reason"),
                       kwargs.get("workload_id"), exc_info=True)


# --- the web process's tally: counted in memory, sent once per tick ----------------------


class RejectionTally:
    """Rejections noted in this process and not yet sent to Redis, by pool
    and minute, then by field: a count and the refusals' details (request id,
    JSON). A refusal with a request id always keeps its details (it must be
    findable by that id); one without keeps them only while the minute has
    sample places left (the script would keep no more)."""

    def __init__(self) -> None:
        self.minutes: dict[tuple[int, int], dict[str, list]] = {}

    def __bool__(self) -> bool:
        return bool(self.minutes)

    def note(self, *, pool_id: int | None, workload_id: int, tenant_id: int, reason: str, estimated_tokens: int,
             retry_after_ms: int | None, message: str = "", request_id: str = "", api_key_id: int | None = None,
             now_s: float | None = None) -> None:
        now_s = time.time() if now_s is None else now_s
        pool = pool_id or NO_POOL
        fields = self.minutes.setdefault((pool, _minute_epoch(now_s)), {})
        field = _field(workload_id, tenant_id, reason)
        entry = fields.get(field)
        if entry is None:
            entry = fields[field] = [0, []]
        entry[0] += 1
        if request_id or len(entry[1]) < settings.SLUICE_REJECTION_SAMPLES_PER_MINUTE:
            entry[1].append((request_id, _sample_json(
                at_s=now_s, workload_id=workload_id, tenant_id=tenant_id, pool=pool, reason=reason,
                estimated_tokens=estimated_tokens, retry_after_ms=retry_after_ms, message=message,
                request_id=request_id, api_key_id=api_key_id)))

    def take(self) -> dict[tuple[int, int], dict[str, list]]:
        taken, self.minutes = self.minutes, {}
        return taken

    def put_back(self, taken: dict[tuple[int, int], dict[str, list]], *, now_s: float | None = None) -> None:
        """A send that failed: its counts join what was noted meanwhile
        (minutes older than Redis would keep are dropped, and each field keeps
        at most PUT_BACK_REFUSALS details: memory stays bounded while Redis
        is away; the counts stay exact)."""
        oldest = _minute_epoch((time.time() if now_s is None else now_s) - MINUTE_TTL_S)
        for (pool, minute), fields in taken.items():
            if minute < oldest:
                continue
            mine = self.minutes.setdefault((pool, minute), {})
            for field, (n, refusals) in fields.items():
                entry = mine.setdefault(field, [0, []])
                entry[0] += n
                entry[1] = (refusals + entry[1])[:PUT_BACK_REFUSALS]


_tally = RejectionTally()
_tally_sender: asyncio.Task | None = None
_tally_sent_at = float("-inf")  # time.monotonic() of the last send


def rejection_note(**kwargs) -> None:
    """Count one rejection in this process's tally (no I/O). The first
    rejection after a quiet tick is sent at once (just after the caller's
    answer), the ones after it at most once per
    SLUICE_REJECTION_PUSH_S, together: a storm of refusals costs Redis one
    script per tick and pool minute, not one per refusal. Needs a running
    event loop (the /v1 views); ``rejection_tally_send_at_exit`` sends what
    is left when the process stops."""
    global _tally_sender
    _tally.note(**kwargs)
    loop = asyncio.get_running_loop()
    # (A sender of another loop, in tests that run several, is not waited on.)
    if _tally_sender is None or _tally_sender.done() or _tally_sender.get_loop() is not loop:
        _tally_sender = loop.create_task(_tally_send_after_tick())


async def _tally_send_after_tick() -> None:
    global _tally_sent_at
    while _tally:
        wait_s = _tally_sent_at + settings.SLUICE_REJECTION_PUSH_S - time.monotonic()
        await asyncio.sleep(max(0.0, wait_s))
        _tally_sent_at = time.monotonic()
        if not await rejection_tally_send():
            return  # Redis away: the counts wait for the next rejection or the shutdown


def _tally_calls() -> list[tuple[tuple[int, int], dict[str, list], ScriptCall[int]]]:
    """The tally taken out, as one script call per pool minute."""
    return [(minute_key, fields, _minute_call(*minute_key, {f: (n, refusals) for f, (n, refusals) in fields.items()}))
            for minute_key, fields in _tally.take().items()]


def _tally_unsent(calls: list, position: int) -> bool:
    logger.warning("could not send %d rejection minute(s) to Redis; kept for the next send", len(calls) - position,
                   exc_info=True)
    _tally.put_back({minute_key: fields for minute_key, fields, _ in calls[position:]})
    return False


async def rejection_tally_send() -> bool:
    """Send the tally to Redis (one script per pool minute); False when Redis
    refused it (the counts are kept for the next send). Never raises."""
    calls = _tally_calls()
    for position, (_, _, call) in enumerate(calls):
        try:
            await call.run_async()
        except Exception:  # noqa: BLE001 - losing a counter beats failing anything else
            return _tally_unsent(calls, position)
    return True


def rejection_tally_send_at_exit() -> bool:
    """``rejection_tally_send`` for a process that is stopping (atexit: the
    event loop is gone, so the sync client). Not through uvicorn's lifespan
    shutdown: awaiting there hands the loop to the requests it has just
    cancelled, which would answer 500 instead of closing their connections."""
    calls = _tally_calls()
    for position, (_, _, call) in enumerate(calls):
        try:
            call.run()
        except Exception:  # noqa: BLE001 - as rejection_tally_send
            return _tally_unsent(calls, position)
    return True


# --- flush ------------------------------------------------------------------------


@dataclass(frozen=True)
class FlushResult:
    minutes: int
    stats: int
    samples: int
    pending: int  # minutes left pending (a rejection arrived during the flush)


def _known_pool_ids() -> list[int]:
    return [NO_POOL, *InferencePool.objects.values_list("id", flat=True)]


def _minutes_read(client, pool_id: int, minutes: list[int]) -> list[tuple[dict, list]]:
    """Counts and samples of each minute, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for minute in minutes:
        pipe.hgetall(keys.rejection_minute_counts(pool_id, minute))
        pipe.lrange(keys.rejection_minute_samples(pool_id, minute), 0, -1)
    replies = pipe.execute()
    return [(replies[2 * i], replies[2 * i + 1]) for i in range(len(minutes))]


def _parsed_samples(raws: list[str]) -> list[dict]:
    parsed = []
    for raw in raws:
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("id"):
            parsed.append(data)
    return parsed


def _parse_field(field: str) -> tuple[int, int, str] | None:
    try:
        wid, tid, reason = field.split("|", 2)
        return int(wid), int(tid), reason
    except ValueError:
        return None


def rejections_flush(*, now_s: float | None = None, max_minutes: int = 500) -> FlushResult:
    """Move closed minutes of every pool from Redis into the database."""
    client = get_redis()
    now_s = time.time() if now_s is None else now_s
    due_before = _minute_epoch(now_s) - FLUSH_GRACE_S - 60  # the minute has ended, plus grace
    minutes_done = stats_written = samples_written = still_pending = 0
    for pool_id in _known_pool_ids():
        pending_key = keys.rejection_pending_minutes(pool_id)
        minutes = [int(float(m)) for m in client.zrangebyscore(pending_key, "-inf", due_before, start=0, num=max_minutes)]
        if not minutes:
            continue
        read = _minutes_read(client, pool_id, minutes)
        counts_by_minute = {m: counts for m, (counts, _) in zip(minutes, read)}
        samples_by_minute = {m: samples for m, (_, samples) in zip(minutes, read)}

        workload_ids = set()
        for counts in counts_by_minute.values():
            for field in counts:
                parsed = _parse_field(field)
                if parsed:
                    workload_ids.add(parsed[0])
        # Rejections of workloads deleted since are dropped (nothing to show them on).
        existing = set(Workload.objects.filter(pk__in=workload_ids).values_list("id", flat=True))
        sampled = [data for raws in samples_by_minute.values() for data in _parsed_samples(raws)]
        key_ids = set(ApiKey.objects.filter(pk__in={d.get("kid") for d in sampled if d.get("kid")})
                      .values_list("id", flat=True))
        db_pool_id = pool_id or None
        stats: list[RejectionStat] = []
        samples: list[RejectionSample] = []
        for minute, counts in counts_by_minute.items():
            at = datetime.fromtimestamp(minute, tz=dt_timezone.utc)
            for field, count in counts.items():
                parsed = _parse_field(field)
                if parsed is None or parsed[0] not in existing:
                    continue
                wid, tid, reason = parsed
                stats.append(RejectionStat(minute=at, tenant_id=tid, workload_id=wid, pool_id=db_pool_id,
                                           reason=reason, count=int(count)))
        for data in sampled:
            if data.get("wid") not in existing:
                continue
            samples.append(RejectionSample(
                sample_id=str(data["id"])[:64], at=datetime.fromtimestamp(float(data["at"]), tz=dt_timezone.utc),
                tenant_id=data["tid"], workload_id=data["wid"], pool_id=db_pool_id, reason=data["reason"][:64],
                estimated_tokens=int(data.get("tokens") or 0), retry_after_ms=data.get("retry_after_ms"),
                message=str(data.get("message") or "")[:SAMPLE_MESSAGE_CHARS],
                api_key_id=data.get("kid") if data.get("kid") in key_ids else None,
            ))
        with transaction.atomic():
            if stats:
                _stats_upsert(stats)
            if samples:
                RejectionSample.objects.bulk_create(samples, batch_size=1000, ignore_conflicts=True)
        for minute, counts in counts_by_minute.items():
            acked = ScriptCall(script=ACK, keys=[keys.rejection_minute_counts(pool_id, minute), pending_key],
                               args=[minute, counts.get("_n", "0")], parse=int).run(client)
            if acked != 1:
                still_pending += 1
        minutes_done += len(minutes)
        stats_written += len(stats)
        samples_written += len(samples)
    return FlushResult(minutes=minutes_done, stats=stats_written, samples=samples_written, pending=still_pending)


def _stats_upsert(stats: list[RejectionStat]) -> None:
    """Write each minute's exact count, replacing an earlier flush of it."""
    if connection.vendor == "postgresql":
        RejectionStat.objects.bulk_create(
            stats, batch_size=1000, update_conflicts=True,
            unique_fields=["minute", "pool", "workload", "reason"], update_fields=["count"],
        )
        return
    # SQLite (the `make run` demo) cannot enforce a unique constraint over a
    # nullable pool, so ON CONFLICT has nothing to match: upsert row by row.
    for stat in stats:
        RejectionStat.objects.update_or_create(
            minute=stat.minute, pool_id=stat.pool_id, workload_id=stat.workload_id, reason=stat.reason,
            defaults={"count": stat.count, "tenant_id": stat.tenant_id},
        )


def rejection_samples_prune(*, now=None) -> int:
    """Drop detailed samples older than the retention (counts are kept)."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.SLUICE_REJECTION_SAMPLE_RETENTION_DAYS)
    deleted, _ = RejectionSample.objects.filter(at__lt=cutoff).delete()
    return deleted


# --- reading the minutes not yet flushed (live pages) -----------------------------------


@dataclass(frozen=True)
class PendingRejections:
    counts: dict[tuple[datetime, int, str], int]  # (minute, workload id, reason) -> count
    samples: list[dict]


def rejections_pending(*, pool_ids: list[int], since: datetime, workload_ids: set[int] | None = None) -> PendingRejections:
    """Counts and samples still in Redis for minutes from ``since`` on. Pages
    merge them over the flushed rows so the last minute shows at once."""
    counts: dict[tuple[datetime, int, str], int] = defaultdict(int)
    samples: list[dict] = []
    try:
        client = get_redis()
        since_s = _minute_epoch(since.timestamp())
        for pool_id in pool_ids:
            minutes = [int(float(m)) for m in client.zrangebyscore(keys.rejection_pending_minutes(pool_id), since_s, "+inf")]
            if not minutes:
                continue
            read = _minutes_read(client, pool_id, minutes)
            for i, minute in enumerate(minutes):
                at = datetime.fromtimestamp(minute, tz=dt_timezone.utc)
                for field, count in read[i][0].items():
                    parsed = _parse_field(field)
                    if parsed is None or (workload_ids is not None and parsed[0] not in workload_ids):
                        continue
                    counts[(at, parsed[0], parsed[2])] = int(count)
                for raw in read[i][1]:
                    try:
                        data = json.loads(raw)
                    except ValueError:
                        continue
                    if workload_ids is not None and data.get("wid") not in workload_ids:
                        continue
                    samples.append(data)
    except Exception:  # noqa: BLE001 - a page shows flushed data when Redis is away
        unavailable_note("the last minutes' rejections")
    return PendingRejections(counts=dict(counts), samples=samples)


# --- one refusal by its request id ------------------------------------------------------


def rejection_by_request_id(*, request_id: str, pool_ids: list[int], now_s: float | None = None) -> dict | None:
    """A refusal's details (the sample JSON: id, at, wid, tid, pid, kid,
    reason, tokens, retry_after_ms, message) still in Redis, found by its
    request id in the last 25 hours of every pool: one round trip of
    HGETs. None when none of them holds it (older, never refused, past
    the per-hour cap, or Redis is away)."""
    now_s = time.time() if now_s is None else now_s
    newest = _hour_epoch(now_s)
    hours = [newest - 3600 * back for back in range(BY_ID_KEPT_S // 3600 + 1)]
    try:
        pipe = get_redis().pipeline(transaction=False)
        for pool_id in pool_ids:
            for hour in hours:
                pipe.hget(keys.rejection_hour_refusals(pool_id, hour), request_id)
        replies = pipe.execute()
    except Exception:  # noqa: BLE001 - a lookup answers "not found" when Redis is away, never a 500
        unavailable_note("refusals by request id")
        return None
    for raw in replies:
        if raw:
            found = _parsed_samples([raw])
            if found:
                return found[0]
    return None
