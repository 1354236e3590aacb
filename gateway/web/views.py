"""The OpenAI-compatible API (/v1/*) and the health check. Async views on an
ASGI server: a request waiting for its lane parks on an awaitable Redis read.
Every refusal is OpenAI-shaped JSON; Redis being unreachable or hung is a 503
``budget_unavailable`` with Retry-After, never a 500."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from budgets.redis.clients import REDIS_UNAVAILABLE
from budgets.errors import BudgetUnavailable, Rejected
from budgets.ledger.rejections import rejection_note
from budgets.models import InferencePool
from gateway.core.request.chat import body_digest, parse_json_body, request_check, validate_chat_request
from gateway.core.request.completions import validate_completion_request, validate_embedding_request
from gateway.core.request.endpoints import ApiRequest
from gateway.core.request.context import CallerContext
from gateway.core.db_threads import DATABASE_AWAY, database_off_loop
from gateway.core.errors import bad_request, budget_unavailable, database_unavailable
from gateway.core.jobs.lifecycle import (IdempotencyConflict, job_list_params, job_list_view, job_submit, job_view,
                               jobs_of_workload)
from gateway.core.log_context import log_annotate
from gateway.core.request.streams import STREAMING
from gateway.core.metrics import pool_live_metrics
from gateway.models import Job
from gateway.core.protection.throttle import request_client_address
from gateway.web.admission_turns import turn_leave
from gateway.web.auth import bearer_key, key_check
from gateway.web.dispatch import request_dispatch
from gateway.web.health import health_details_allowed, liveness_report, readiness_report
from gateway.web.idempotency import (MAX_KEY_LENGTH, idempotency_claim, idempotency_release, idempotency_store,
                                     idempotency_wait)
from gateway.web.relay import stream_response
from gateway.web.responses import openai_error, ratelimit_headers, rejected_response

logger = logging.getLogger(__name__)

MAX_JOB_DEADLINE_S = 7 * 24 * 3600

# Refusals that mean Redis itself is unreachable: counting them there would
# only add a timeout to the caller's 503.
UNCOUNTED_REASONS = {"budget_unavailable", "result_unavailable"}


def unavailable_is_503(view):
    """Redis down or hung anywhere under a /v1 view (buckets, results,
    idempotency, jobs' pacing) answers 503 budget_unavailable, and the
    database away (a key the process cannot vouch for, jobs, batches, files)
    503 database_unavailable, not 500."""

    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *args, **kwargs):
        try:
            return await view(request, *args, **kwargs)
        except (BudgetUnavailable, *REDIS_UNAVAILABLE) as exc:
            logger.warning("%s %s: Redis unavailable: %s", request.method, request.path, exc)
            return rejected_response(budget_unavailable())
        except DATABASE_AWAY as exc:
            logger.warning("%s %s: database unavailable: %s", request.method, request.path, type(exc).__name__)
            return rejected_response(database_unavailable())

    return wrapper


def _header(request: HttpRequest, meta_name: str) -> str:
    """A request header's value, read from META under its CGI name
    (``HTTP_X_SESSION_ID``; ``CONTENT_LENGTH``), "" when absent: the value
    ``request.headers`` gives, without building that mapping from every
    META key on each request."""
    return request.META.get(meta_name, "")


async def caller_authenticate(request: HttpRequest) -> CallerContext | JsonResponse:
    raw_key = bearer_key(_header(request, "HTTP_AUTHORIZATION"))
    if raw_key is None:
        return openai_error(status=401, message="Missing bearer API key (Authorization: Bearer <key>).",
                            error_type="invalid_request_error", code="missing_api_key")
    check = await key_check(raw_key, address=request_client_address(request.META), before_waiting=turn_leave)
    if check.retry_after_ms is not None:
        retry_after_s = max(1, -(-check.retry_after_ms // 1000))
        return openai_error(status=429, message="Too many requests with incorrect API keys from this address; "
                            f"retry after {retry_after_s} s.", error_type="rate_limit_error",
                            code="too_many_invalid_api_keys",
                            headers={"Retry-After": str(retry_after_s), "retry-after-ms": str(check.retry_after_ms)})
    if check.context is None:
        return openai_error(status=401, message="Incorrect or revoked API key.", error_type="invalid_request_error",
                            code="invalid_api_key")
    ctx = check.context
    log_annotate(tenant=ctx.tenant_slug, workload=ctx.workload_slug, workload_id=ctx.workload_id, pool_id=ctx.pool_id)
    return ctx


async def _rejection(request: HttpRequest, ctx: CallerContext, rejected: Rejected) -> JsonResponse:
    if rejected.reason not in UNCOUNTED_REASONS:
        try:
            # Counted in this process, sent to Redis once per tick (no round
            # trip here), and filed under the answer's x-request-id, so the
            # id the caller reports finds this refusal.
            rejection_note(pool_id=ctx.pool_id, workload_id=ctx.workload_id, tenant_id=ctx.tenant_id,
                           reason=rejected.reason, retry_after_ms=rejected.retry_after_ms,
                           estimated_tokens=rejected.estimated_tokens, message=rejected.message,
                           request_id=getattr(request, "request_id", "") or "", api_key_id=ctx.api_key_id)
        except Exception:  # noqa: BLE001 - losing a counter beats failing the caller's answer
            logger.warning("could not count a %s rejection of workload %s", rejected.reason, ctx.workload_id,
                           exc_info=True)
    return rejected_response(rejected, limits=ctx.limits)


def json_body_read(request: HttpRequest) -> dict:
    try:
        length = int(_header(request, "CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > settings.SLUICE_MAX_BODY_BYTES or len(request.body) > settings.SLUICE_MAX_BODY_BYTES:
        raise bad_request(f"The request body exceeds {settings.SLUICE_MAX_BODY_BYTES} bytes.", code="body_too_large",
                          status=413)
    return parse_json_body(request.body)


def _idempotency_key(request: HttpRequest) -> str:
    key = _header(request, "HTTP_IDEMPOTENCY_KEY")
    if len(key) > MAX_KEY_LENGTH:
        raise bad_request(f"Idempotency-Key must be at most {MAX_KEY_LENGTH} characters.", code="invalid_idempotency_key")
    return key


def _idempotency_conflict() -> JsonResponse:
    return openai_error(status=409, message="This Idempotency-Key was used with a different request body.",
                        error_type="invalid_request_error", code="idempotency_key_reused")


@csrf_exempt
@unavailable_is_503
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _through_the_door(request, validate_chat_request)


@csrf_exempt
@unavailable_is_503
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions: legacy completions, weighed and billed as chat."""
    return await _through_the_door(request, validate_completion_request)


@csrf_exempt
@unavailable_is_503
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings: admitted on its exact input tokens, no output."""
    return await _through_the_door(request, validate_embedding_request)


async def _through_the_door(request: HttpRequest, validate: Callable[[dict], ApiRequest]) -> HttpResponse:
    """Every synchronous /v1 endpoint's one path (gateway/core/request/endpoints.py):
    ``validate`` is all an endpoint adds (its body shape; the request it
    returns gives its token count and its pool payload)."""
    if request.method != "POST":
        return openai_error(status=405, message="Use POST.", error_type="invalid_request_error", code="method_not_allowed",
                            headers={"Allow": "POST"})
    started = time.monotonic()
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    ctx = auth
    idem_key = ""
    try:
        body = json_body_read(request)
        api_request = validate(body)
        request_check(ctx, api_request, streaming=True)
        idem_key = _idempotency_key(request)
        if api_request.stream and idem_key:
            # A stream cannot be stored and replayed as one answer.
            raise bad_request("Idempotency-Key is not supported with stream=true.", param="stream",
                              code="idempotency_stream_unsupported")
    except Rejected as rejected:
        return await _rejection(request, ctx, rejected)

    digest = body_digest(body)
    if idem_key:
        claim = await idempotency_claim(workload_id=ctx.workload_id, key=idem_key, digest=digest)
        if claim.state == "pending":
            turn_leave()  # it waits for another request, not for admission
            claim = await idempotency_wait(workload_id=ctx.workload_id, key=idem_key, digest=digest,
                                           timeout_s=ctx.queue_timeout_s + settings.SLUICE_UPSTREAM_TIMEOUT_S)
        if claim.state == "conflict":
            return _idempotency_conflict()
        if claim.state == "done":
            response = JsonResponse(claim.body or {}, status=claim.status)
            for name, value in (claim.headers or {}).items():
                response[name] = value
            response["x-sluice-idempotent-replay"] = "true"
            return response
        if claim.state == "pending":
            return openai_error(status=409, message="A request with this Idempotency-Key is still running.",
                                error_type="invalid_request_error", code="idempotency_key_in_progress")

    try:
        dispatched = await request_dispatch(ctx=ctx, request=api_request, session_id=_header(request, "HTTP_X_SESSION_ID")[:128],
                                           request_id=getattr(request, "request_id", None), body_digest=digest)
    except Rejected as rejected:
        if idem_key:
            await idempotency_release(workload_id=ctx.workload_id, key=idem_key)
        return await _rejection(request, ctx, rejected)

    outcome = dispatched.outcome
    admission = dispatched.admission
    headers: dict[str, str] = {
        "x-request-id": dispatched.request_id,
        "x-sluice-lane": dispatched.lane,
        "x-sluice-borrowed": "true" if admission.borrowed else "false",
        "x-sluice-max-tokens-applied": str(dispatched.estimate.output_tokens),
        "x-sluice-estimated-prompt-tokens": str(dispatched.estimate.input_tokens),
        "x-sluice-queue-ms": str(outcome.queue_wait_ms),
        "x-sluice-attempts": str(outcome.attempts),
        "x-sluice-pool": dispatched.pool_slug,
        **ratelimit_headers(dispatched.ctx.limits, admission.rate_limits),
    }
    if outcome.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-outcome.retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(outcome.retry_after_ms)
    if outcome.status == STREAMING:
        # The first chunk came: from here the answer is the stream. Its lane
        # wait and attempts are known to the worker only (the ledger row).
        del headers["x-sluice-queue-ms"], headers["x-sluice-attempts"]
        headers["x-sluice-total-ms"] = str(int((time.monotonic() - started) * 1000))
        return stream_response(record=dispatched.record, headers=headers, head=dispatched.stream_head)
    if idem_key:
        await idempotency_store(workload_id=ctx.workload_id, key=idem_key, digest=digest, status=outcome.http_status,
                                body=outcome.body or {}, headers=headers)
    headers["x-sluice-total-ms"] = str(int((time.monotonic() - started) * 1000))
    response = JsonResponse(outcome.body or {}, status=outcome.http_status)
    for name, value in headers.items():
        response[name] = value
    return response


def _job_fields(body: dict) -> tuple[str, float | None]:
    # Checked (DNS included) by job_submit, off the event loop.
    callback_url = body.pop("callback_url", None) or ""
    deadline = body.pop("deadline_seconds", None)
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline <= MAX_JOB_DEADLINE_S:
            raise bad_request(f"'deadline_seconds' must be a number in (0, {MAX_JOB_DEADLINE_S}].", param="deadline_seconds")
    return callback_url, deadline


@csrf_exempt
@unavailable_is_503
async def jobs(request: HttpRequest) -> JsonResponse:
    """POST /v1/jobs: an async chat completion; 202 with the job and its
    status URL. GET /v1/jobs: the caller's workload's jobs, one page."""
    if request.method in ("GET", "HEAD"):
        return await _jobs_list(request)
    if request.method != "POST":
        return openai_error(status=405, message="Use GET or POST.", error_type="invalid_request_error",
                            code="method_not_allowed", headers={"Allow": "GET, HEAD, POST"})
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    ctx = auth
    # Before the job exists: a request refused after its job was created
    # would leave a job that runs and is billed (get_host() refuses a bad Host).
    base_url = f"{request.scheme}://{request.get_host()}"
    try:
        body = json_body_read(request)
        callback_url, deadline = _job_fields(body)
        chat = validate_chat_request(body)
        request_check(ctx, chat)
        idem_key = _idempotency_key(request)
        submitted = await database_off_loop(job_submit)(
            ctx=ctx, chat=chat, body=body, callback_url=callback_url, idempotency_key=idem_key, deadline_s=deadline,
            session_id=_header(request, "HTTP_X_SESSION_ID")[:128],
        )
    except IdempotencyConflict:
        return _idempotency_conflict()
    except Rejected as rejected:
        return await _rejection(request, ctx, rejected)
    job = submitted.job
    log_annotate(job_id=str(job.id), job_request_id=job.request_id or "")
    view = await database_off_loop(job_view)(job, base_url=base_url)
    if job.status == Job.Status.REJECTED:
        error = (job.result or {}).get("error", {})
        refused = Rejected(reason=job.reason or "rejected", message=error.get("message", "Rejected."), status=429,
                           error_type="rate_limit_error", param="deadline_seconds",
                           estimated_tokens=job.estimated_input_tokens + job.estimated_output_tokens)
        if submitted.created:  # a replay was counted when it was refused
            return await _rejection(request, ctx, refused)
        return rejected_response(refused)
    response = JsonResponse(view, status=202 if submitted.created else 200)
    response["Location"] = view["status_url"]
    if not submitted.created:
        response["x-sluice-idempotent-replay"] = "true"
    return response


async def _jobs_list(request: HttpRequest) -> JsonResponse:
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    base_url = f"{request.scheme}://{request.get_host()}"

    def load() -> dict:
        status, after, limit = job_list_params(status=request.GET.get("status"), after=request.GET.get("after"),
                                               limit=request.GET.get("limit"))
        return job_list_view(jobs_of_workload(workload_id=auth.workload_id, status=status, after=after, limit=limit),
                             base_url=base_url)

    try:
        return JsonResponse(await database_off_loop(load)())
    except Rejected as rejected:
        return rejected_response(rejected)


def get_only(request: HttpRequest) -> JsonResponse | None:
    if request.method in ("GET", "HEAD"):
        return None
    return openai_error(status=405, message="Use GET.", error_type="invalid_request_error", code="method_not_allowed",
                        headers={"Allow": "GET, HEAD"})


@unavailable_is_503
async def job_detail(request: HttpRequest, job_id) -> JsonResponse:
    if (refused := get_only(request)) is not None:
        return refused
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    def load():
        # A job is visible to keys of its own workload only.
        job = Job.objects.select_related("workload").filter(pk=job_id, workload_id=auth.workload_id).first()
        return job_view(job, base_url=f"{request.scheme}://{request.get_host()}") if job else None

    view = await database_off_loop(load)()
    if view is None:
        return openai_error(status=404, message="No such job.", error_type="invalid_request_error", code="job_not_found")
    return JsonResponse(view)


@unavailable_is_503
async def models(request: HttpRequest) -> JsonResponse:
    if (refused := get_only(request)) is not None:
        return refused
    auth = await caller_authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    return JsonResponse({
        "object": "list",
        "data": [{"id": m, "object": "model", "created": 0, "owned_by": "sluice"} for m in auth.served_models],
    })


def _no_store(response: JsonResponse) -> JsonResponse:
    response["Cache-Control"] = "no-store"
    return response


@require_GET
async def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness: 200 while this process answers (details: gateway/web/health.py)."""
    detailed = await health_details_allowed(request)
    return _no_store(JsonResponse(await liveness_report(detailed=detailed)))


@require_GET
async def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: 200 when the database and Redis answer, else 503; pools never count."""
    detailed = await health_details_allowed(request)
    ready, report = await readiness_report(detailed=detailed)
    response = JsonResponse(report, status=200 if ready else 503)
    if not ready:
        response["Retry-After"] = "5"
    return _no_store(response)


def pool_metrics(request: HttpRequest, pool_id: int) -> JsonResponse:
    """Little's law and capacity numbers of one pool, for platform admins."""
    if not (request.user.is_authenticated and request.user.is_staff):
        return JsonResponse({"detail": "Platform admins only."}, status=403 if request.user.is_authenticated else 401)
    if not InferencePool.objects.filter(pk=pool_id).exists():
        return JsonResponse({"detail": "Not found."}, status=404)
    return JsonResponse(pool_live_metrics(pool_id=pool_id))
