"""Asynchronous jobs: delay, don't reject (docs/architecture.md, "Lanes").
A job over budget waits in a Redis sorted set keyed by its release
time; the pacer (``manage.py run_pacer``) moves due jobs onto their lane.
Scheduled workloads' jobs always go through a leaky bucket at the workload's
reserved rate. Never Celery ETA/countdown: with the Redis broker a task held
past visibility_timeout is delivered a second time."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from budgets.admission.estimation import Estimate
from budgets.redis.clients import REDIS_UNAVAILABLE, get_redis, redis_now_ms
from budgets.redis.composition import Commands
from budgets.redis.scripts import LuaScript, ScriptCall
from budgets.errors import BudgetUnavailable, Rejected
from budgets.models import UsageRecord
from gateway.core import keys
from gateway.core.pacer_wake import pacer_wake_commands
from gateway.core.request.admission import lease_ttl_ms
from gateway.core.request.routing import request_route_admit
from gateway.core.jobs.callbacks import CallbackRefused, callback_enqueue, callback_url_check
from gateway.core.request.bodies import request_validate
from gateway.core.request.chat import ChatRequest, body_digest, request_check
from gateway.core.request.endpoints import ApiRequest
from gateway.core.request.context import CallerContext, context_for_workload
from gateway.core.request.enqueue import new_request_id, record_build, record_enqueue
from gateway.core.errors import bad_request, budget_unavailable, error_body
from gateway.core.paging import newest_first_page
from gateway.core.request.records import Outcome
from gateway.models import Job, JobCallbackDelivery
from tenants.text_numbers import ascii_int

logger = logging.getLogger(__name__)

PACE = LuaScript(__package__, "pace.lua")

# Reasons a later retry can fix; anything else is final. A pool that does
# not answer comes back: its jobs wait for it like for budget.
DELAY_HISTORY_KEPT = 50

DELAYABLE = {"workload_tpm", "workload_rpm", "pool_tpm", "pool_rpm", "pool_input_tpm", "pool_output_tpm",
             "pool_saturated", "workload_concurrency", "pool_backoff", "pool_unavailable", "provider_tpm",
             "provider_rpm", "pool_circuit_open"}


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool


class IdempotencyConflict(Exception):
    pass


def _ms_to_datetime(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=dt_timezone.utc)


def job_submit(*, ctx: CallerContext, chat: ChatRequest, body: dict, callback_url: str = "", idempotency_key: str = "",
               deadline_s: float | None = None, session_id: str = "", schedule_id: int | None = None) -> Submitted:
    """Create a job and try to start it. Raises Rejected for a job that can
    never run (caps, size), a callback URL Sluice will not call, or whose
    earliest start is past its deadline, and IdempotencyConflict for a reused
    key with another body."""
    request_check(ctx, chat)
    if callback_url:
        try:
            callback_url_check(url=callback_url)  # resolves the host: this runs in a thread, not the event loop
        except CallbackRefused as refused:
            raise bad_request(refused.message, param="callback_url", code="invalid_callback_url") from None
    digest = body_digest(body)
    if idempotency_key:
        existing = Job.objects.filter(workload_id=ctx.workload_id, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.body_sha256 != digest:
                raise IdempotencyConflict(idempotency_key)
            return Submitted(job=existing, created=False)
    estimate = chat.estimate(ctx)
    deadline_s = deadline_s if deadline_s is not None else settings.SLUICE_JOB_DEADLINE_S
    job = Job(
        tenant_id=ctx.tenant_id, workload_id=ctx.workload_id, status=Job.Status.DELAYED, body=body,
        body_sha256=digest, idempotency_key=idempotency_key, callback_url=callback_url, session_id=session_id,
        estimated_input_tokens=estimate.input_tokens, estimated_output_tokens=estimate.output_tokens,
        deadline=timezone.now() + timedelta(seconds=deadline_s), schedule_id=schedule_id,
        api_key_id=ctx.api_key_id or None,
    )
    try:
        with transaction.atomic():
            job.save(force_insert=True)
    except IntegrityError:
        # Another request with the same key won the insert: answer with its job.
        existing = Job.objects.get(workload_id=ctx.workload_id, idempotency_key=idempotency_key)
        if existing.body_sha256 != digest:
            raise IdempotencyConflict(idempotency_key) from None
        return Submitted(job=existing, created=False)
    try:
        job_start(job=job, ctx=ctx, chat=chat, estimate=estimate, at_submit=True)
    except (BudgetUnavailable, *REDIS_UNAVAILABLE) as exc:
        # Redis is away: the job can be neither parked nor queued. Forget it
        # (nothing was admitted, or it was refunded) so the caller's retry,
        # same Idempotency-Key included, starts afresh.
        job.delete()
        raise budget_unavailable() from exc
    except Rejected as rejected:
        if rejected.reason == budget_unavailable().reason:
            job.delete()
        raise
    return Submitted(job=job, created=True)


def _delay(job: Job, *, release_ms: float, reason: str, at_submit: bool) -> None:
    if release_ms > job.deadline.timestamp() * 1000:
        # At submission the caller hears it at once (429); later it expires.
        job.status = Job.Status.REJECTED if at_submit else Job.Status.EXPIRED
        job.reason = "deadline_unreachable"
        job.finished_at = timezone.now()
        job.result = error_body(message=f"Budget ({reason}) would hold this job past its deadline.",
                                error_type="rate_limit_error", code="deadline_unreachable")
        job.save(update_fields=["status", "reason", "finished_at", "result"])
        if not at_submit:  # at submission the caller hears it in the answer
            _callback(job)
        return
    # Every wait counts, the leaky bucket's pacing included, with its reason.
    job.status = Job.Status.DELAYED
    job.release_at = _ms_to_datetime(release_ms)
    job.reason = reason
    job.delays += 1
    # The latest DELAY_HISTORY_KEPT waits (``delays`` counts them all): a job
    # re-delayed every second for days must not grow its row without bound.
    job.delay_history = [*(job.delay_history or []), {
        "at": timezone.now().isoformat(), "reason": reason, "release_at": job.release_at.isoformat()}
    ][-DELAY_HISTORY_KEPT:]
    job.save(update_fields=["status", "release_at", "reason", "delays", "delay_history"])
    parked = Commands().zadd(keys.DELAYED_JOBS, {str(job.id): release_ms})
    pacer_wake_commands(parked)  # it may be due before the pacer's next look
    parked.run()


def _leaky_release_ms(ctx: CallerContext, estimate: Estimate) -> float:
    rate_per_ms = max(ctx.reserved_tpm, 1) / 60_000.0
    return ScriptCall(script=PACE, keys=[keys.pool_pacer(ctx.pool_id)],
                      args=[ctx.workload_id, estimate.total_tokens, rate_per_ms], parse=float).run()


def job_start(*, job: Job, ctx: CallerContext, chat: ApiRequest, estimate: Estimate, paced: bool = False,
              at_submit: bool = False) -> None:
    """Admit the job now and put it on its lane, or park it until the budget
    says it fits. Scheduled workloads first pass their leaky bucket. A batch
    line waits on its lane at most SLUICE_BATCH_LINE_QUEUE_S (then it goes
    back to its batch's pending lines: gateway/core/batches/lifecycle.py)."""
    now_ms = redis_now_ms()
    if ctx.workload_class == "scheduled" and not paced:
        release_ms = _leaky_release_ms(ctx, estimate)
        if release_ms > now_ms + 1:
            _delay(job, release_ms=release_ms, reason="paced", at_submit=at_submit)
            return
    deadline_ms = job.deadline.timestamp() * 1000
    if job.batch_id:
        deadline_ms = min(deadline_ms, now_ms + settings.SLUICE_BATCH_LINE_QUEUE_S * 1000)
    request_id = new_request_id()
    lease_ms = lease_ttl_ms(queue_s=max(0.0, (deadline_ms - now_ms) / 1000))
    try:
        # Routed as a chat call is (gateway/core/request/routing.py), on the
        # estimate taken at submit.
        routed = request_route_admit(ctx.route(chat.model), request_id=request_id, model=chat.model,
                                     estimate_for=lambda _on_pool: estimate, lease_ms=lease_ms)
    except Rejected as rejected:
        if rejected.reason in DELAYABLE and rejected.retry_after_ms is not None:
            _delay(job, release_ms=now_ms + rejected.retry_after_ms, reason=rejected.reason, at_submit=at_submit)
            return
        raise
    record = record_build(routed.ctx, request_id=request_id, model=chat.model, payload=chat.pool_payload(estimate),
                          estimate=estimate, admission=routed.admission, deadline_ms=deadline_ms,
                          retry_deadline_ms=deadline_ms, session_id=job.session_id, job_id=str(job.id),
                          fallback_pool_ids=routed.fallback_pool_ids, endpoint=chat.endpoint)
    job.request_id = request_id
    job.status = Job.Status.QUEUED
    job.released_at = timezone.now()
    job.reason = ""
    job.save(update_fields=["request_id", "status", "released_at", "reason", "delays"])
    record_enqueue(record, lease_ms=lease_ms)


# The pacer releases a batch's lines by the hundred, all of one workload:
# each reads its workload's slices and prices once a second, not once a line
# (a changed slice or price reaches released jobs within that second).
RELEASE_CONTEXT_FRESH_S = 1.0
RELEASE_CONTEXTS_KEPT = 1024
_release_contexts: dict[int, tuple[float, CallerContext]] = {}


def _release_context(workload) -> CallerContext:
    now = time.monotonic()
    kept = _release_contexts.get(workload.id)
    if kept is not None and now - kept[0] < RELEASE_CONTEXT_FRESH_S:
        return kept[1]
    if len(_release_contexts) >= RELEASE_CONTEXTS_KEPT:
        _release_contexts.clear()
    ctx = context_for_workload(workload)
    _release_contexts[workload.id] = (now, ctx)
    return ctx


def job_release(*, job_id: str) -> str:
    """The pacer's step for one due job: start it, or park it again."""
    job = Job.objects.select_related("workload", "workload__tenant").filter(pk=job_id).first()
    if job is None or job.status != Job.Status.DELAYED:
        return "skipped"
    if job.deadline <= timezone.now():
        job.status = Job.Status.EXPIRED
        job.reason = "deadline_passed"
        job.finished_at = timezone.now()
        job.save(update_fields=["status", "reason", "finished_at"])
        _callback(job)
        return "expired"
    # The key that submitted it (or its schedule's): the ledger row carries
    # it. A batch's line runs on the batch lane, whatever its workload's class.
    ctx = replace(_release_context(job.workload), api_key_id=job.api_key_id)
    if job.batch_id:
        ctx = replace(ctx, workload_class="batch")
    try:
        # Again at release: the pool or its settings may have changed since.
        chat = request_validate(job.endpoint, job.body)
        request_check(ctx, chat)
        estimate = Estimate(input_tokens=job.estimated_input_tokens, output_tokens=job.estimated_output_tokens,
                            max_tokens_requested=getattr(chat, "max_tokens", None), clamped=False)
        job_start(job=job, ctx=ctx, chat=chat, estimate=estimate, paced=True)
    except Rejected as rejected:
        job.status = Job.Status.REJECTED
        job.reason = rejected.reason
        job.finished_at = timezone.now()
        job.result = error_body(message=rejected.message, error_type=rejected.error_type, param=rejected.param,
                                code=rejected.reason)
        job.result_status = rejected.status
        job.save(update_fields=["status", "reason", "finished_at", "result", "result_status"])
        _callback(job)
    return job.status


def job_complete(*, job_id: str, outcome: Outcome) -> None:
    """Called by the worker once the job's request is settled and in the
    ledger. A batch line that timed out on its lane never ran (the claim
    decided it): it goes back to its batch's pending lines."""
    if outcome.status == "queue_timeout" and batch_line_requeue(job_id=job_id):
        return
    status = {"ok": Job.Status.SUCCEEDED, "queue_timeout": Job.Status.EXPIRED}.get(outcome.status, Job.Status.FAILED)
    updated = Job.objects.filter(pk=job_id).exclude(status__in=Job.FINAL).update(
        status=status, result=outcome.body, finished_at=timezone.now(), result_status=outcome.http_status,
        reason="" if outcome.status == "ok" else outcome.status,
    )
    if updated and batch_line_finished(job_id=job_id):
        return
    if updated:
        job = Job.objects.filter(pk=job_id).only("id", "callback_url").first()
        if job is not None:
            _callback(job)


def batch_line_requeue(*, job_id: str) -> bool:
    """A batch line back to pending (its batch still running); False for
    any other job."""
    return bool(Job.objects.filter(pk=job_id, batch__isnull=False, status=Job.Status.QUEUED,
                                   batch__status="in_progress").update(status=Job.Status.PENDING, reason=""))


def batch_line_finished(*, job_id: str) -> bool:
    """A batch line reached its end: the pacer, which feeds batches their
    next lines, looks now rather than at its next tick. False for a job."""
    if not Job.objects.filter(pk=job_id, batch__isnull=False).exists():
        return False
    wake = Commands()
    pacer_wake_commands(wake)
    wake.run()
    return True


def _callback(job: Job) -> None:
    """A job reached its final state after its submission was answered: its
    callback, if it has one, goes out from the housekeeping lane."""
    if job.callback_url:
        callback_enqueue(job_id=str(job.id))


def job_callback_attempts(job: Job) -> list[dict]:
    return [
        {"attempt": d.attempt, "at": d.at.isoformat(), "status_code": d.status_code, "delivered": d.delivered,
         "error": d.error or None, "next_attempt_at": d.next_attempt_at.isoformat() if d.next_attempt_at else None}
        for d in JobCallbackDelivery.objects.filter(job=job).order_by("attempt")
    ]


_LOOK_UP = object()


def job_view(job: Job, *, base_url: str = "", with_callback: bool = True, usage_row=_LOOK_UP) -> dict:
    """The job as the API shows it; tokens and cost come from its ledger row.
    ``with_callback``: also how its callback went (not in the callback's own
    body, which stays the same across attempts). ``usage_row``: the job's
    ledger row when the caller already fetched it (a list, in one query)."""
    row = usage_row
    if row is _LOOK_UP:
        row = UsageRecord.objects.filter(request_id=job.request_id).first() if job.request_id else None
    data = {
        "id": str(job.id),
        "object": "job",
        "status": job.status,
        "workload": job.workload.slug,
        "created_at": job.created_at.isoformat(),
        "deadline": job.deadline.isoformat(),
        "release_at": job.release_at.isoformat() if job.release_at else None,
        "released_at": job.released_at.isoformat() if job.released_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "reason": job.reason or None,
        "delays": job.delays,
        "delay_history": job.delay_history or [],
        "status_url": f"{base_url}/v1/jobs/{job.id}",
        "result": job.result if job.status in Job.FINAL else None,
        "usage": None,
        "cost": None,
    }
    if row is not None:
        data["usage"] = {"prompt_tokens": row.actual_input_tokens, "completion_tokens": row.actual_output_tokens,
                         "total_tokens": row.actual_input_tokens + row.actual_output_tokens,
                         "estimated_prompt_tokens": row.estimated_input_tokens,
                         "estimated_completion_tokens": row.estimated_output_tokens}
        data["cost"] = str(row.cost)
        data["request_id"] = row.request_id
    if with_callback:
        # callback_status: the last attempt's HTTP status, 0 when it got none.
        data["callback_status"] = job.callback_status
        data["callback_attempts"] = job_callback_attempts(job) if job.callback_url else []
    return data


# --- listing (GET /v1/jobs and the jobs page) ---------------------------------------------

JOB_LIST_DEFAULT = 20
JOB_LIST_MAX = 100


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    has_more: bool


def job_list_params(*, status: str | None, after: str | None, limit: str | None) -> tuple[str, str, int]:
    """GET /v1/jobs's query checked: (status, after, limit). Raises Rejected
    (a 400 in OpenAI's shape) for anything else."""
    status = status or ""
    if status and status not in Job.JOB_STATUSES:
        raise bad_request(f"'status' must be one of {', '.join(Job.JOB_STATUSES)}.", param="status",
                          code="invalid_status")
    after = after or ""
    if after:
        try:
            after = str(uuid.UUID(after))
        except ValueError:
            raise bad_request("'after' must be a job id from an earlier page.", param="after",
                              code="invalid_cursor") from None
    count = ascii_int(limit) if limit not in (None, "") else JOB_LIST_DEFAULT
    if count is None or not 1 <= count <= JOB_LIST_MAX:
        raise bad_request(f"'limit' must be an integer from 1 to {JOB_LIST_MAX}.", param="limit",
                          code="invalid_limit")
    return status, after, count


def jobs_of_workload(*, workload_id: int, status: str = "", after: str = "", limit: int = JOB_LIST_DEFAULT) -> JobPage:
    """A workload's jobs, newest first, one page of ``limit``. Keyset paging
    on (created_at, id): ``after`` is the last job id of the previous page,
    so a page costs one index range, however deep, and jobs created meanwhile
    never shift what the next page shows. An ``after`` that is not one of
    this workload's jobs is refused (400), never used to probe other ids."""
    # A batch's lines are the Batch API's (GET /v1/batches), not jobs.
    jobs = Job.objects.filter(workload_id=workload_id, batch__isnull=True).select_related("workload")
    if status:
        jobs = jobs.filter(status=status)
    page, more = newest_first_page(jobs, scope=Job.objects.filter(workload_id=workload_id), after=after, limit=limit,
                                   noun="jobs")
    return JobPage(jobs=page, has_more=more)


def job_list_view(page: JobPage, *, base_url: str = "") -> dict:
    """The list in OpenAI's shape. Items carry no callback attempt log (one
    query per job); GET /v1/jobs/{id} has it."""
    request_ids = [job.request_id for job in page.jobs if job.request_id]
    rows = {row.request_id: row for row in UsageRecord.objects.filter(request_id__in=request_ids)}
    data = [job_view(job, base_url=base_url, with_callback=False, usage_row=rows.get(job.request_id))
            for job in page.jobs]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": page.has_more}


def jobs_running(*, jobs: list[Job]) -> set[str]:
    """The ids of the queued jobs whose request a worker has started (its
    owner state in Redis is ``worker:<generation>``, see gateway/core/request/claim.lua). One
    pipelined round trip; Redis away means none is known to be running."""
    queued = [job for job in jobs if job.status == Job.Status.QUEUED and job.request_id]
    if not queued:
        return set()
    try:
        pipe = get_redis().pipeline(transaction=False)
        for job in queued:
            pipe.get(keys.request_owner(job.request_id))
        owners = pipe.execute()
    except REDIS_UNAVAILABLE:
        return set()
    return {str(job.id) for job, owner in zip(queued, owners) if owner and str(owner).startswith("worker:")}
