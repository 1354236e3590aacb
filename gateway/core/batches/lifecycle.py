"""The Batch API's batches (docs/architecture.md, "The Batch API").

A batch's lines are jobs (gateway/core/jobs/lifecycle.py) on the batch lane:
budget delays them, never rejects them. The life of a batch:

- ``validating``: a housekeeping task reads the input file once
  (gateway/core/batches/lines.py) and writes a ``Job`` row per request
  (``pending``; a refused request is written final, for the error file), in
  short transactions, or fails the batch with the file's errors.
- ``in_progress``: the pacer feeds the batch (``batches_step``): while fewer
  than SLUICE_BATCH_LINES_IN_FLIGHT lines of its workload's batches are
  delayed or queued, the next pending lines (in file order, older batches
  first) become delayed jobs due now, and the
  pacer's usual release admits them or parks them until the budget has room.
  A line that finishes wakes the pacer, so the next one follows at once.
- ``finalizing``: every line is final; a housekeeping task writes the output
  file (2xx answers) and the error file (everything else), keyed by
  ``custom_id`` in file order, then ``completed``.
- ``cancelling``: pending lines are cancelled at once; delayed ones as the
  pacer takes them off its set; lines already on the lane finish (and are
  billed: they ran). Then the files are written and ``cancelled``.
- the window ends (``expires_at``): lines not started end ``batch_expired``;
  then the files are written and ``expired``.

No line runs twice: a pending line becomes delayed by one conditional
UPDATE, a delayed one is released by whoever removes it from the delayed set
(ZREM), and a queued one is the request path's (its claim, its ledger row).
Every step is idempotent and every state is in PostgreSQL, so a restart of
any process resumes a batch where it was: a validation or finalization task
lost with its worker is published again by the pacer after BATCH_TASK_TTL_S,
a delayed line missing from the delayed set (Redis lost it) is put back
after LOST_LINE_S, and a queued line whose request record Redis lost is
settled from the ledger (``_lost_queued_recover``)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from budgets.admission import keys as budget_keys
from budgets.models import Reservation, UsageRecord
from budgets.redis.clients import get_redis, redis_now_ms
from budgets.redis.composition import Commands
from gateway.core import keys
from gateway.core.batches.files import file_delete, file_of_workload, file_write
from gateway.core.batches.lines import Checked, LineError, lines_check
from gateway.core.errors import bad_request, error_body
from gateway.core.lanes import HOUSEKEEPING
from gateway.core.paging import newest_first_page
from gateway.core.pacer_wake import pacer_wake_commands
from gateway.core.request.context import CallerContext, context_for_workload
from gateway.core.request.endpoints import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from gateway.models import Batch, BatchFile, Job
from tenants.text_numbers import ascii_int

logger = logging.getLogger(__name__)

VALIDATE_TASK = "gateway.batch_validate"
FINALIZE_TASK = "gateway.batch_finalize"

ENDPOINTS = (CHAT_COMPLETIONS, EMBEDDINGS, COMPLETIONS)
WINDOWS_S = {"24h": 24 * 3600}
# A published task not done by then was lost with its worker: publish it again.
BATCH_TASK_TTL_S = 300
# Longer than any validation (50,000 lines read, estimated and written).
VALIDATE_LOCK_S = 1800
# A delayed line the delayed set has not held for this long is put back.
LOST_LINE_S = 60.0
# How often the pacer looks at running batches without being woken.
FEED_EVERY_S = 0.5
CREATE_CHUNK = 500
METADATA_MAX_KEYS = 16

IN_FLIGHT = (Job.Status.DELAYED, Job.Status.QUEUED)
ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING)


# --- creating ------------------------------------------------------------------------------

def _metadata_check(metadata) -> dict | None:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > METADATA_MAX_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise bad_request(f"'metadata' must be an object of at most {METADATA_MAX_KEYS} string pairs (keys up to 64 "
                          "characters, values up to 512).", param="metadata", code="invalid_metadata")
    return metadata


def batch_fields_check(body: dict) -> tuple[str, str, str, dict | None]:
    """POST /v1/batches's body: (input_file_id, endpoint, completion_window, metadata), or a 400."""
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0][:100]}.", param=unknown[0][:100],
                          code="unknown_parameter")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise bad_request("'input_file_id' is required.", param="input_file_id", code="missing_required_parameter")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint",
                          code="invalid_endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS_S:
        raise bad_request("'completion_window' must be '24h'.", param="completion_window",
                          code="invalid_completion_window")
    return input_file_id, endpoint, window, _metadata_check(body.get("metadata"))


def batch_plan(ctx: CallerContext, *, tokens: int, requests: int, window_s: float, basis: str) -> dict:
    """Whether the workload's budget lets ``tokens`` over ``requests`` run
    within ``window_s``: at its reserved rate, at its ceiling (borrowing idle
    capacity), or not at all; said at creation (from the file's size) and
    again once validated (from its token count)."""
    reserved_tpm = sum(s.reserved_tpm for s in ctx.slices)
    ceiling_tpm = sum(max(s.ceiling_tpm, s.reserved_tpm) for s in ctx.slices)
    rpm = sum(s.rpm for s in ctx.slices)

    def seconds_at(tpm: int) -> float | None:
        if tpm <= 0:
            return None
        by_tokens = tokens / tpm * 60
        by_requests = requests / rpm * 60 if rpm > 0 else 0.0
        return max(by_tokens, by_requests)

    at_reserved, at_ceiling = seconds_at(reserved_tpm), seconds_at(ceiling_tpm)
    if at_reserved is not None and at_reserved <= window_s:
        fits, note = "reserved", "Fits the completion window at the workload's reserved rate."
    elif at_ceiling is not None and at_ceiling <= window_s:
        fits, note = "ceiling", ("Fits the completion window only by borrowing idle capacity up to the workload's "
                                 "ceiling; lines not started when the window ends expire.")
    else:
        fits, note = "no", ("Cannot finish within the completion window at the workload's budget; lines not started "
                            "when the window ends expire (split the batch, or ask for a bigger budget slice).")
    return {"estimated_tokens": tokens, "requests": requests, "basis": basis, "reserved_tpm": reserved_tpm,
            "ceiling_tpm": ceiling_tpm, "rpm": rpm,
            "seconds_at_reserved": round(at_reserved, 1) if at_reserved is not None else None,
            "seconds_at_ceiling": round(at_ceiling, 1) if at_ceiling is not None else None,
            "fits_window": fits, "note": note}


def _rough_tokens(ctx: CallerContext, stored: BatchFile) -> int:
    """Before validation: about four bytes a token in, plus the workload's
    default answer per line."""
    return stored.bytes // 4 + stored.lines * ctx.max_tokens_default


def batch_create(*, ctx: CallerContext, body: dict) -> Batch:
    """A new batch, ``validating``; its validation goes to the housekeeping lane."""
    input_file_id, endpoint, window, metadata = batch_fields_check(body)
    stored = file_of_workload(file_id=input_file_id, workload_id=ctx.workload_id)
    if stored is None:
        raise bad_request(f"No such file: '{input_file_id[:100]}'.", param="input_file_id", code="file_not_found",
                          status=404)
    if stored.purpose != BatchFile.Purpose.BATCH:
        raise bad_request("The input file must have been uploaded with purpose 'batch'.", param="input_file_id",
                          code="invalid_input_file")
    window_s = WINDOWS_S[window]
    batch = Batch.objects.create(
        tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, api_key_id=ctx.api_key_id or None, endpoint=endpoint,
        completion_window=window, metadata=metadata, input_file=stored,
        expires_at=timezone.now() + timedelta(seconds=window_s),
        plan=batch_plan(ctx, tokens=_rough_tokens(ctx, stored), requests=stored.lines, window_s=window_s,
                        basis="file size"))
    _task_publish(batch.id, VALIDATE_TASK, step="validate")
    return batch


def _task_publish(batch_id: str, task: str, *, step: str, force: bool = True) -> None:
    """Publish a batch's task; with ``force`` off, only if none was published
    within BATCH_TASK_TTL_S (the pacer's re-publish of a lost one)."""
    claimed = get_redis().set(keys.batch_task(batch_id, step), 1, nx=not force, ex=BATCH_TASK_TTL_S)
    if claimed:
        current_app.send_task(task, args=[batch_id], queue=HOUSEKEEPING.queue)


# --- validating ----------------------------------------------------------------------------

def _batch_context(batch: Batch) -> CallerContext:
    return replace(context_for_workload(batch.workload), api_key_id=batch.api_key_id or 0)


def _line_job(batch: Batch, line) -> Job:
    common = dict(tenant_id=batch.tenant_id, workload_id=batch.workload_id, batch_id=batch.id, line=line.number,
                  custom_id=line.custom_id, body=line.body, endpoint=batch.endpoint, body_sha256="",
                  deadline=batch.expires_at, api_key_id=batch.api_key_id)
    if line.refused is not None:
        refused = line.refused
        return Job(**common, status=Job.Status.REJECTED, reason=refused.reason, finished_at=timezone.now(),
                   result_status=refused.status,
                   result=error_body(message=refused.message, error_type=refused.error_type, param=refused.param,
                                     code=refused.reason))
    return Job(**common, status=Job.Status.PENDING, estimated_input_tokens=line.estimate.input_tokens,
               estimated_output_tokens=line.estimate.output_tokens)


def batch_validate(*, batch_id: str) -> str:
    """Read the input file and write the batch's lines, or fail it.

    The lines go in short transactions of CREATE_CHUNK rows, not one: a
    50,000-line file takes seconds, and on SQLite (make run) one long write
    transaction would hold the database's write lock that every tenant's
    ledger rows wait for. Lines of a batch still ``validating`` are never
    fed, and a failed validation deletes them. One validator at a time runs
    per batch (a Redis lock that outlives any validation, VALIDATE_LOCK_S):
    a second delivery finds the lock taken and leaves the batch to the
    first; a validator that died leaves the lock to expire, and the pacer's
    re-publish (BATCH_TASK_TTL_S) starts afresh, deleting the lines it
    had written."""
    batch = Batch.objects.select_related("workload", "workload__tenant", "input_file").filter(pk=batch_id).first()
    if batch is None or batch.status != Batch.Status.VALIDATING:
        return "skipped"
    lock = keys.batch_task(batch_id, "validating")
    if not get_redis().set(lock, 1, nx=True, ex=VALIDATE_LOCK_S):
        return "running"
    try:
        return _lines_write(batch)
    finally:
        get_redis().delete(lock)


def _lines_write(batch: Batch) -> str:
    if batch.input_file is None:
        return _fail(batch, [{"code": "file_not_found", "message": "The input file was deleted.", "param":
                              "input_file_id", "line": None}])
    ctx = _batch_context(batch)
    checked = Checked(errors=[])
    Job.objects.filter(batch=batch).delete()  # what an earlier validator that died had written
    tokens = lines = 0
    chunk: list[Job] = []
    try:
        for line in lines_check(batch.input_file, ctx=ctx, endpoint=batch.endpoint, checked=checked):
            lines += 1
            if line.estimate is not None:
                tokens += line.estimate.total_tokens
            if not checked.errors:
                chunk.append(_line_job(batch, line))
                if len(chunk) >= CREATE_CHUNK:
                    Job.objects.bulk_create(chunk)
                    chunk = []
    except (OSError, UnicodeError) as exc:
        checked.errors.append(LineError("invalid_file", f"The input file cannot be read: {exc}", None,
                                        "input_file_id"))
    if checked.errors or lines == 0:
        Job.objects.filter(batch=batch).delete()
        errors = [e.view() for e in checked.errors] or [
            {"code": "empty_file", "message": "The input file holds no requests.", "param": None, "line": None}]
        return _fail(batch, errors)
    Job.objects.bulk_create(chunk)
    plan = batch_plan(ctx, tokens=tokens, requests=lines, window_s=WINDOWS_S[batch.completion_window],
                      basis="token count")
    # Conditional: a cancel while it validated ended the batch, and its lines go.
    started = Batch.objects.filter(pk=batch.id, status=Batch.Status.VALIDATING).update(
        total=lines, estimated_tokens=tokens, plan=plan, status=Batch.Status.IN_PROGRESS,
        in_progress_at=timezone.now())
    if not started:
        Job.objects.filter(batch=batch).delete()
        return "cancelled"
    _pacer_wake()
    return Batch.Status.IN_PROGRESS


def _fail(batch: Batch, errors: list[dict]) -> str:
    """Failed, unless a cancel ended it meanwhile."""
    Batch.objects.filter(pk=batch.id, status=Batch.Status.VALIDATING).update(
        status=Batch.Status.FAILED, errors=errors, failed_at=timezone.now())
    return Batch.Status.FAILED


def _pacer_wake() -> None:
    wake = Commands()
    pacer_wake_commands(wake)
    wake.run()


# --- running: the pacer's step -------------------------------------------------------------

def batch_counts(batch_id: str) -> dict[str, int]:
    """The batch's lines by status (one grouped query on the batch's index)."""
    return dict(Job.objects.filter(batch_id=batch_id).values_list("status").annotate(n=Count("id"))
                .values_list("status", "n"))


def _feed(batch: Batch, counts: dict[str, int], room: Room) -> int:
    """Make the batch's next pending lines due now, within its room (spent here)."""
    free = room.free(batch.workload_id)
    if free <= 0 or not counts.get(Job.Status.PENDING):
        return 0
    ids = list(Job.objects.filter(batch=batch, status=Job.Status.PENDING).order_by("line")
               .values_list("id", flat=True)[:free])
    now = timezone.now()
    fed = []
    for job_id in ids:  # one conditional UPDATE each: a line another pacer took is skipped
        if Job.objects.filter(pk=job_id, status=Job.Status.PENDING).update(
                status=Job.Status.DELAYED, release_at=now, reason="batch"):
            fed.append(str(job_id))
    room.spend(batch.workload_id, len(fed))
    if fed:
        due_ms = redis_now_ms()
        Commands().zadd(keys.DELAYED_JOBS, {job_id: due_ms for job_id in fed}).run()
    return len(fed)


def _lost_lines_restore(batch: Batch) -> int:
    """Delayed lines the delayed set does not hold (a pacer died between its
    UPDATE and its ZADD, or Redis lost the set) go back into it."""
    stale = timezone.now() - timedelta(seconds=LOST_LINE_S)
    ids = [str(i) for i in Job.objects.filter(batch=batch, status=Job.Status.DELAYED, release_at__lt=stale)
           .values_list("id", flat=True)[:1000]]
    if not ids:
        return 0
    scores = get_redis().zmscore(keys.DELAYED_JOBS, ids)
    lost = [job_id for job_id, score in zip(ids, scores) if score is None]
    if lost:
        logger.warning("batch %s: %d delayed lines were missing from the delayed set; put back", batch.id, len(lost))
        Commands().zadd(keys.DELAYED_JOBS, {job_id: redis_now_ms() for job_id in lost}).run()
    return len(lost)


def _lost_queued_recover(batch: Batch) -> int:
    """Queued lines whose request record is not in Redis: no worker can run
    them (a worker's claim needs the record). Two ways to get there:

    - the release stopped between the line's UPDATE to queued and its
      enqueue (the pacer killed there, gateway/core/jobs/lifecycle.py
      ``job_start``): its admission's lease is in Redis, so Redis kept its
      data and the line never reached a lane. After ``LOST_LINE_S`` it goes
      back to pending; its lease is refunded by the lease reaper.
    - Redis lost its data: the lease went too, and a worker may still be in
      its pool call, so the line waits until any call must have ended. One
      the ledger billed ran: it ends failed (``result_lost``: its answer went
      with the record); one it did not goes back to pending, to run again."""
    now = timezone.now()
    queued = list(Job.objects.filter(batch=batch, status=Job.Status.QUEUED,
                                     released_at__lt=now - timedelta(seconds=LOST_LINE_S))
                  .values_list("id", "request_id", "released_at")[:1000])
    if not queued:
        return 0
    pool_ids = list(Reservation.objects.filter(workload_id=batch.workload_id).values_list("pool_id", flat=True))
    pipe = get_redis().pipeline(transaction=False)
    for _, request_id, _ in queued:
        pipe.exists(keys.request_record(request_id))
        for pool_id in pool_ids:
            pipe.exists(budget_keys.lease(pool_id, request_id))
    found = pipe.execute()
    width = 1 + len(pool_ids)
    settled_by = now - timedelta(seconds=settings.SLUICE_BATCH_LINE_QUEUE_S + settings.SLUICE_UPSTREAM_TIMEOUT_S
                                 + LOST_LINE_S)
    missing, unsent = [], []
    for at, (job_id, request_id, released_at) in enumerate(queued):
        record, leases = found[at * width], found[at * width + 1:(at + 1) * width]
        if record:
            continue
        if any(leases):
            unsent.append(job_id)
        elif released_at < settled_by:
            missing.append((job_id, request_id))
    billed = set(UsageRecord.objects.filter(request_id__in=[r for _, r in missing])
                 .values_list("request_id", flat=True))
    for job_id, request_id in missing:
        if request_id in billed:
            Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
                status=Job.Status.FAILED, reason="result_lost", finished_at=timezone.now(),
                result=error_body(message="This request ran and was billed, but its answer was lost with Sluice's "
                                  "result store.", error_type="server_error", code="result_lost"))
        else:
            Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(status=Job.Status.PENDING, reason="")
    for job_id in unsent:
        Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(status=Job.Status.PENDING, reason="")
    if missing:
        logger.warning("batch %s: %d queued lines had lost their request records", batch.id, len(missing))
    if unsent:
        logger.warning("batch %s: %d lines were released but never reached their lane; back to pending",
                       batch.id, len(unsent))
    return len(missing) + len(unsent)


def _delayed_end(batch: Batch, *, status: str, reason: str, message: str) -> int:
    """End the batch's delayed lines that this pacer takes off the delayed
    set (a line another pacer just released is the request path's)."""
    ended = 0
    client = get_redis()
    for job_id in Job.objects.filter(batch=batch, status=Job.Status.DELAYED).values_list("id", flat=True):
        if client.zrem(keys.DELAYED_JOBS, str(job_id)):
            ended += Job.objects.filter(pk=job_id, status=Job.Status.DELAYED).update(
                status=status, reason=reason, finished_at=timezone.now(),
                result=error_body(message=message, error_type="invalid_request_error", code=reason))
    return ended


def _pending_end(batch: Batch, *, status: str, reason: str, message: str) -> int:
    return Job.objects.filter(batch=batch, status=Job.Status.PENDING).update(
        status=status, reason=reason, finished_at=timezone.now(),
        result=error_body(message=message, error_type="invalid_request_error", code=reason))


EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was not executed: its batch was cancelled."


def batch_step(batch: Batch, room: Room) -> None:
    """One look at a running batch: feed it (within ``room``, see _feed),
    end what its cancel or its window ends, and hand it to finalization
    once no line is in flight."""
    if batch.status == Batch.Status.VALIDATING:
        _task_publish(batch.id, VALIDATE_TASK, step="validate", force=False)
        return
    if batch.status == Batch.Status.FINALIZING:
        _task_publish(batch.id, FINALIZE_TASK, step="finalize", force=False)
        return
    ending = None
    if batch.status == Batch.Status.CANCELLING:
        ending = (Job.Status.CANCELLED, "batch_cancelled", CANCELLED_MESSAGE)
    elif batch.expires_at <= timezone.now():
        ending = (Job.Status.EXPIRED, "batch_expired", EXPIRED_MESSAGE)
    if ending is not None:
        _pending_end(batch, status=ending[0], reason=ending[1], message=ending[2])
        _delayed_end(batch, status=ending[0], reason=ending[1], message=ending[2])
    counts = batch_counts(batch.id)
    if ending is None and _feed(batch, counts, room):
        return
    # Ending or not: a lost line back in the delayed set is released, or
    # ended by the next step's _delayed_end; a lost queued one is settled.
    _lost_lines_restore(batch)
    if counts.get(Job.Status.QUEUED):
        _lost_queued_recover(batch)
    if any(counts.get(s, 0) for s in (*IN_FLIGHT, Job.Status.PENDING)):
        return
    if batch.status == Batch.Status.IN_PROGRESS and ending is None:
        updated = Batch.objects.filter(pk=batch.id, status=Batch.Status.IN_PROGRESS).update(
            status=Batch.Status.FINALIZING, finalizing_at=timezone.now())
        if not updated:
            return
    _task_publish(batch.id, FINALIZE_TASK, step="finalize", force=False)


@dataclass
class Room:
    """How many more batch lines may be delayed or queued: per workload
    (SLUICE_BATCH_LINES_IN_FLIGHT across all its batches, so a tenant with a
    hundred batches costs the pacer no more than one with one) and per pool
    (SLUICE_BATCH_POOL_SHARE of its in-flight limit across every workload's
    batch lines whose primary pool it is). An admitted line holds a place in
    the pool's in-flight limit until it settles, and each sequence a GPU adds
    slows every other's decode step: batch lines take at most that share and
    interactive calls keep the rest (docs/architecture.md, "The Batch API")."""

    workload: dict[int, int]
    pool: dict[int, int]
    pool_of: dict[int, int]

    def free(self, workload_id: int) -> int:
        free = self.workload.get(workload_id, 0)
        pool_id = self.pool_of.get(workload_id)
        return min(free, self.pool[pool_id]) if pool_id is not None else free

    def spend(self, workload_id: int, lines: int) -> None:
        self.workload[workload_id] = self.workload.get(workload_id, 0) - lines
        pool_id = self.pool_of.get(workload_id)
        if pool_id is not None:
            self.pool[pool_id] -= lines


def batch_room(batches: list[Batch]) -> Room:
    ids = [b.id for b in batches if b.status == Batch.Status.IN_PROGRESS]
    busy = dict(Job.objects.filter(batch_id__in=ids, status__in=IN_FLIGHT).values_list("workload_id")
                .annotate(n=Count("id")).values_list("workload_id", "n")) if ids else {}
    workloads = {b.workload_id for b in batches}
    room = Room(workload={wid: settings.SLUICE_BATCH_LINES_IN_FLIGHT - busy.get(wid, 0) for wid in workloads},
                pool={}, pool_of={})
    primary = (Reservation.objects.filter(workload_id__in=workloads, pool__is_active=True, pool__max_concurrency__gt=0)
               .order_by("workload_id", "rank", "id").values_list("workload_id", "pool_id", "pool__max_concurrency"))
    for wid, pool_id, conc in primary:
        if wid in room.pool_of:
            continue  # its primary came first
        room.pool_of[wid] = pool_id
        room.pool.setdefault(pool_id, max(1, int(conc * settings.SLUICE_BATCH_POOL_SHARE)))
        room.pool[pool_id] -= busy.get(wid, 0)
    return room


def batches_step() -> int:
    """The pacer's look at every active batch, oldest first (a workload's
    batches run in the order they were made), each step; while any is
    active it steps at least every FEED_EVERY_S. Returns how many it looked at."""
    batches = list(Batch.objects.filter(status__in=ACTIVE).select_related("workload").order_by("created_at"))
    room = batch_room(batches)
    for batch in batches:
        try:
            batch_step(batch, room)
        except Exception:  # one batch's trouble must not stop the others'
            logger.exception("batch %s: step failed", batch.id)
    return len(batches)


# --- finishing -----------------------------------------------------------------------------

def output_line_item(job: Job) -> dict:
    """One line of the output or error file, in OpenAI's format: the pool's
    answer (or the refusal a direct call would get) as ``response``; a line
    that never ran as ``error``. The web UI's error table reads lines
    through it too, so the page and the file never disagree."""
    line_id = "batch_req_" + uuid.UUID(str(job.id)).hex
    if job.status in (Job.Status.CANCELLED, Job.Status.EXPIRED) and job.result_status is None:
        # It never reached the pool: cancelled, or its window (or its budget's wait) ran out.
        item = {"id": line_id, "custom_id": job.custom_id, "response": None,
                "error": {"code": job.reason or "batch_expired",
                          "message": (job.result or {}).get("error", {}).get("message", EXPIRED_MESSAGE)}}
    else:
        status_code = job.result_status or (200 if job.status == Job.Status.SUCCEEDED else 500)
        item = {"id": line_id, "custom_id": job.custom_id,
                "response": {"status_code": status_code, "request_id": job.request_id or None,
                             "body": job.result or {}},
                "error": None}
    return item


def _output_line(job: Job) -> bytes:
    return json.dumps(output_line_item(job), separators=(",", ":")).encode() + b"\n"


def _lines_of(batch: Batch, *, ok: bool) -> Iterator[bytes]:
    query = Job.objects.filter(batch=batch).order_by("line")
    query = query.filter(status=Job.Status.SUCCEEDED) if ok else query.exclude(status=Job.Status.SUCCEEDED)
    for job in query.only("id", "custom_id", "status", "reason", "result", "result_status", "request_id") \
            .iterator(chunk_size=1000):
        yield _output_line(job)


ENDINGS = {Batch.Status.CANCELLING: (Batch.Status.CANCELLED, "cancelled_at"),
           Batch.Status.FINALIZING: (Batch.Status.COMPLETED, "completed_at"),
           Batch.Status.IN_PROGRESS: (Batch.Status.EXPIRED, "expired_at")}  # in progress: past its window


def batch_finalize(*, batch_id: str) -> str:
    """Write the output and error files and end the batch: ``completed``
    from finalizing, ``cancelled`` from cancelling, ``expired`` past its
    window. The files are written outside any transaction (on SQLite a long
    one would hold every tenant's writes); the ending is one conditional
    UPDATE, so of two deliveries one ends the batch and the other deletes
    the files it wrote."""
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None or batch.status not in ENDINGS:
        return "skipped"
    counts = batch_counts(batch.id)
    if any(counts.get(s, 0) for s in (*IN_FLIGHT, Job.Status.PENDING)):
        return "running"  # the pacer finishes them first
    if batch.status == Batch.Status.IN_PROGRESS and batch.expires_at > timezone.now():
        return "running"
    ok = counts.get(Job.Status.SUCCEEDED, 0)
    written = {"output_file": None, "error_file": None}
    if ok:
        written["output_file"] = file_write(tenant_id=batch.tenant_id, workload_id=batch.workload_id,
                                            purpose=BatchFile.Purpose.BATCH_OUTPUT,
                                            filename=f"{batch.id}_output.jsonl", lines=_lines_of(batch, ok=True))
    if sum(counts.values()) > ok:
        written["error_file"] = file_write(tenant_id=batch.tenant_id, workload_id=batch.workload_id,
                                           purpose=BatchFile.Purpose.BATCH_ERROR,
                                           filename=f"{batch.id}_error.jsonl", lines=_lines_of(batch, ok=False))
    ending, stamp = ENDINGS[batch.status]
    now = timezone.now()
    ended = Batch.objects.filter(pk=batch.id, status=batch.status).update(
        status=ending, **{stamp: now}, finalizing_at=batch.finalizing_at or now, **written)
    if not ended:
        for stored in written.values():
            if stored is not None:
                file_delete(stored)
        return "skipped"
    return ending


def batch_cancel(batch: Batch) -> Batch:
    """``cancelling``: no new line starts; pending lines end now; the pacer
    ends the delayed ones and finishes the batch when the running ones are
    done. A batch already ended, or cancelling, is answered as it is."""
    if batch.status in Batch.FINAL or batch.status == Batch.Status.CANCELLING:
        return batch
    now = timezone.now()
    # A validating batch has no line to run yet: it ends at once (its
    # validator deletes what it wrote, batch_validate).
    if Batch.objects.filter(pk=batch.id, status=Batch.Status.VALIDATING).update(
            status=Batch.Status.CANCELLED, cancelling_at=now, cancelled_at=now):
        return Batch.objects.get(pk=batch.id)
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.id)
        if locked.status in Batch.FINAL or locked.status == Batch.Status.CANCELLING:
            return locked
        locked.status, locked.cancelling_at = Batch.Status.CANCELLING, now
        locked.save(update_fields=["status", "cancelling_at"])
        _pending_end(locked, status=Job.Status.CANCELLED, reason="batch_cancelled", message=CANCELLED_MESSAGE)
    _pacer_wake()
    return locked


# --- showing -------------------------------------------------------------------------------

def _unix(moment) -> int | None:
    return int(moment.timestamp()) if moment else None


def batch_view(batch: Batch, counts: dict[str, int] | None = None) -> dict:
    """OpenAI's batch object, with Sluice's plan (``sluice``)."""
    if counts is None:
        counts = batch_counts(batch.id) if batch.status != Batch.Status.VALIDATING else {}
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at), "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at), "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.completed_at), "failed_at": _unix(batch.failed_at),
        "expired_at": _unix(batch.expired_at), "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.cancelled_at),
        "request_counts": request_counts(batch, counts),
        "metadata": batch.metadata, "usage": batch_usage(batch.id),
        "sluice": {"workload": batch.workload.slug, "plan": batch.plan,
                   "lines": {status: n for status, n in sorted(counts.items())}},
    }


LINE_FAILED = (Job.Status.FAILED, Job.Status.REJECTED, Job.Status.EXPIRED, Job.Status.CANCELLED)


def request_counts(batch: Batch, counts: dict[str, int]) -> dict[str, int]:
    """OpenAI's ``request_counts`` from the batch's lines by status: a line
    that ended any other way than succeeded is failed (it is in the error file)."""
    return {"total": batch.total, "completed": counts.get(Job.Status.SUCCEEDED, 0),
            "failed": sum(n for status, n in counts.items() if status in LINE_FAILED)}


def batch_usage(batch_id: str) -> dict:
    """Tokens the ledger holds for the batch's lines (what it is billed for),
    in OpenAI's batch ``usage`` shape, and their cost."""
    totals = UsageRecord.objects.filter(request_id__in=Job.objects.filter(batch_id=batch_id).exclude(request_id="")
                                        .values("request_id")).aggregate(
        input_tokens=Sum("actual_input_tokens"), output_tokens=Sum("actual_output_tokens"), cost=Sum("cost"))
    input_tokens, output_tokens = totals["input_tokens"] or 0, totals["output_tokens"] or 0
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens, "cost": str(totals["cost"] or 0)}


def batch_of_workload(*, batch_id: str, workload_id: int) -> Batch | None:
    return Batch.objects.select_related("workload").filter(pk=batch_id, workload_id=workload_id).first()


LIST_DEFAULT, LIST_MAX = 20, 100


def batch_list(*, workload_id: int, after: str | None, limit: str | None) -> dict:
    """GET /v1/batches: newest first, keyset-paged by ``after`` (a batch id)."""
    count = ascii_int(limit) if limit not in (None, "") else LIST_DEFAULT
    if count is None or not 1 <= count <= LIST_MAX:
        raise bad_request(f"'limit' must be an integer from 1 to {LIST_MAX}.", param="limit", code="invalid_limit")
    rows, more = newest_first_page(Batch.objects.filter(workload_id=workload_id).select_related("workload"),
                                   scope=Batch.objects.filter(workload_id=workload_id), after=after or "",
                                   limit=count, noun="batches")
    data = [batch_view(b) for b in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
