"""The OpenAI-compatible API (/v1/*) and the health check. Async views on an
ASGI server: a request waiting for its lane parks on an awaitable Redis read."""

from __future__ import annotations

import logging
import time
from urllib.parse import urlparse

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from budgets.errors import Rejected
from budgets.rejections import rejection_count_async

from .auth import CallerContext, bearer_key, caller_context
from .dispatch import chat_completion
from .errors import bad_request, format_duration_ms, openai_error, rejected_response
from .health import health_report
from .idempotency import (MAX_KEY_LENGTH, body_digest, idempotency_claim, idempotency_release, idempotency_store,
                          idempotency_wait)
from .validation import ChatRequest, parse_json_body, validate_chat_request

logger = logging.getLogger(__name__)

# Job-only fields of a POST /v1/jobs body; the rest is a chat-completions body.
MAX_JOB_DEADLINE_S = 7 * 24 * 3600


async def _authenticate(request: HttpRequest) -> CallerContext | JsonResponse:
    raw_key = bearer_key(request.headers.get("Authorization"))
    if raw_key is None:
        return openai_error(status=401, message="Missing bearer API key (Authorization: Bearer <key>).",
                            error_type="invalid_request_error", code="missing_api_key")
    ctx = await caller_context(raw_key)
    if ctx is None:
        return openai_error(status=401, message="Incorrect or revoked API key.", error_type="invalid_request_error",
                            code="invalid_api_key")
    return ctx


def _ratelimit_headers(limits: dict[str, int], *, remaining_tokens: int, remaining_requests: int,
                       tokens_reset_ms: int, requests_reset_ms: int) -> dict[str, str]:
    return {
        "x-ratelimit-limit-tokens": str(limits["tokens"]),
        "x-ratelimit-remaining-tokens": str(max(0, remaining_tokens)),
        "x-ratelimit-reset-tokens": format_duration_ms(tokens_reset_ms),
        "x-ratelimit-limit-requests": str(limits["requests"]),
        "x-ratelimit-remaining-requests": str(max(0, remaining_requests)),
        "x-ratelimit-reset-requests": format_duration_ms(requests_reset_ms),
    }


# Refusals that mean Redis itself is unreachable: counting them there would
# only add a timeout to the caller's 503.
UNCOUNTED_REASONS = {"budget_unavailable", "result_unavailable"}


async def _rejection(ctx: CallerContext, rejected: Rejected) -> JsonResponse:
    if rejected.reason not in UNCOUNTED_REASONS:
        await rejection_count_async(pool_id=ctx.pool_id, workload_id=ctx.workload_id, tenant_id=ctx.tenant_id,
                                    reason=rejected.reason, retry_after_ms=rejected.retry_after_ms,
                                    estimated_tokens=getattr(rejected, "estimated_tokens", 0))
    extra = {}
    if getattr(rejected, "remaining_tokens", None) is not None:
        extra = _ratelimit_headers(ctx.limits, remaining_tokens=rejected.remaining_tokens,
                                   remaining_requests=rejected.remaining_requests,
                                   tokens_reset_ms=rejected.tokens_reset_ms,
                                   requests_reset_ms=rejected.requests_reset_ms)
    return rejected_response(rejected, extra_headers=extra)


def _read_body(request: HttpRequest) -> dict:
    try:
        length = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        length = 0
    if length > settings.SLUICE_MAX_BODY_BYTES or len(request.body) > settings.SLUICE_MAX_BODY_BYTES:
        raise bad_request(f"The request body exceeds {settings.SLUICE_MAX_BODY_BYTES} bytes.", code="body_too_large",
                          status=413)
    return parse_json_body(request.body)


def _check_chat(ctx: CallerContext, chat: ChatRequest) -> None:
    if chat.stream:
        raise Rejected(reason="stream_unsupported", message="Streaming is not supported yet; send stream=false.",
                       status=400, param="stream", error_type="invalid_request_error")
    if ctx.pool_id is None:
        raise Rejected(reason="no_reservation", message="This workload has no budget on any pool.", status=403,
                       error_type="permission_error")
    if chat.model not in ctx.served_models:
        raise Rejected(reason="model_not_found", message=f"The model '{chat.model}' does not exist on this workload's pool.",
                       status=404, param="model", error_type="invalid_request_error")


def _idempotency_key(request: HttpRequest) -> str:
    key = request.headers.get("Idempotency-Key", "")
    if len(key) > MAX_KEY_LENGTH:
        raise bad_request(f"Idempotency-Key must be at most {MAX_KEY_LENGTH} characters.", code="invalid_idempotency_key")
    return key


def _idempotency_conflict() -> JsonResponse:
    return openai_error(status=409, message="This Idempotency-Key was used with a different request body.",
                        error_type="invalid_request_error", code="idempotency_key_reused")


@csrf_exempt
async def chat_completions(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return openai_error(status=405, message="Use POST.", error_type="invalid_request_error", code="method_not_allowed")
    started = time.monotonic()
    auth = await _authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    ctx = auth
    idem_key = ""
    try:
        chat = validate_chat_request(_read_body(request))
        _check_chat(ctx, chat)
        idem_key = _idempotency_key(request)
    except Rejected as rejected:
        return await _rejection(ctx, rejected)

    digest = body_digest(request.body)
    if idem_key:
        claim = await idempotency_claim(workload_id=ctx.workload_id, key=idem_key, digest=digest)
        if claim.state == "pending":
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
        dispatched = await chat_completion(ctx=ctx, chat=chat, session_id=request.headers.get("X-Session-Id", "")[:128])
    except Rejected as rejected:
        if idem_key:
            await idempotency_release(workload_id=ctx.workload_id, key=idem_key)
        return await _rejection(ctx, rejected)

    outcome = dispatched.outcome
    admission = dispatched.admission
    headers = {
        "x-request-id": dispatched.request_id,
        "x-sluice-lane": dispatched.lane,
        "x-sluice-borrowed": "true" if admission.borrowed else "false",
        "x-sluice-max-tokens-applied": str(dispatched.estimate.output_tokens),
        "x-sluice-estimated-prompt-tokens": str(dispatched.estimate.input_tokens),
        "x-sluice-queue-ms": str(outcome.queue_wait_ms),
        "x-sluice-attempts": str(outcome.attempts),
        **_ratelimit_headers(ctx.limits, remaining_tokens=admission.remaining_tokens,
                             remaining_requests=admission.remaining_requests,
                             tokens_reset_ms=admission.tokens_reset_ms,
                             requests_reset_ms=admission.requests_reset_ms),
    }
    if outcome.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-outcome.retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(outcome.retry_after_ms)
    if idem_key:
        await idempotency_store(workload_id=ctx.workload_id, key=idem_key, digest=digest, status=outcome.http_status,
                                body=outcome.body or {}, headers=headers)
    headers["x-sluice-total-ms"] = str(int((time.monotonic() - started) * 1000))
    response = JsonResponse(outcome.body or {}, status=outcome.http_status)
    for name, value in headers.items():
        response[name] = value
    return response


def _job_fields(body: dict) -> tuple[str, float | None]:
    callback_url = body.pop("callback_url", None) or ""
    if callback_url:
        parsed = urlparse(callback_url) if isinstance(callback_url, str) else None
        if parsed is None or parsed.scheme not in {"http", "https"} or not parsed.netloc or len(callback_url) > 1000:
            raise bad_request("'callback_url' must be an http(s) URL.", param="callback_url")
    deadline = body.pop("deadline_seconds", None)
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline <= MAX_JOB_DEADLINE_S:
            raise bad_request(f"'deadline_seconds' must be a number in (0, {MAX_JOB_DEADLINE_S}].", param="deadline_seconds")
    return callback_url, deadline


@csrf_exempt
async def jobs(request: HttpRequest) -> JsonResponse:
    """POST /v1/jobs: an async chat completion; 202 with the job and its status URL."""
    if request.method != "POST":
        return openai_error(status=405, message="Use POST.", error_type="invalid_request_error", code="method_not_allowed")
    auth = await _authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    ctx = auth
    from .jobs import IdempotencyConflict, job_submit, job_view
    from .models import Job

    try:
        body = _read_body(request)
        callback_url, deadline = _job_fields(body)
        chat = validate_chat_request(body)
        _check_chat(ctx, chat)
        idem_key = _idempotency_key(request)
        submitted = await sync_to_async(job_submit, thread_sensitive=False)(
            ctx=ctx, chat=chat, body=body, callback_url=callback_url, idempotency_key=idem_key, deadline_s=deadline,
            session_id=request.headers.get("X-Session-Id", "")[:128],
        )
    except IdempotencyConflict:
        return _idempotency_conflict()
    except Rejected as rejected:
        return await _rejection(ctx, rejected)
    job = submitted.job
    base_url = f"{request.scheme}://{request.get_host()}"
    view = await sync_to_async(job_view, thread_sensitive=False)(job, base_url=base_url)
    if job.status == Job.Status.REJECTED:
        error = (job.result or {}).get("error", {})
        return openai_error(status=429, message=error.get("message", "Rejected."), error_type="rate_limit_error",
                            code=job.reason or "rejected", param="deadline_seconds")
    response = JsonResponse(view, status=202 if submitted.created else 200)
    response["Location"] = view["status_url"]
    if not submitted.created:
        response["x-sluice-idempotent-replay"] = "true"
    return response


async def job_detail(request: HttpRequest, job_id) -> JsonResponse:
    auth = await _authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    from .jobs import job_view
    from .models import Job

    def load():
        # A job is visible to keys of its own workload only.
        job = Job.objects.select_related("workload").filter(pk=job_id, workload_id=auth.workload_id).first()
        return job_view(job, base_url=f"{request.scheme}://{request.get_host()}") if job else None

    view = await sync_to_async(load, thread_sensitive=False)()
    if view is None:
        return openai_error(status=404, message="No such job.", error_type="invalid_request_error", code="job_not_found")
    return JsonResponse(view)


async def models(request: HttpRequest) -> JsonResponse:
    auth = await _authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    return JsonResponse({
        "object": "list",
        "data": [{"id": m, "object": "model", "created": 0, "owned_by": "sluice"} for m in auth.served_models],
    })


@require_GET
async def healthz(request: HttpRequest) -> JsonResponse:
    report = await health_report()
    return JsonResponse(report, status=200 if report["status"] == "ok" else 503)


def pool_metrics(request: HttpRequest, pool_id: int) -> JsonResponse:
    """Little's law and capacity numbers of one pool, for platform admins."""
    if not (request.user.is_authenticated and request.user.is_staff):
        return JsonResponse({"detail": "Platform admins only."}, status=403 if request.user.is_authenticated else 401)
    from budgets.models import InferencePool

    from .metrics import pool_live_metrics

    if not InferencePool.objects.filter(pk=pool_id).exists():
        return JsonResponse({"detail": "Not found."}, status=404)
    return JsonResponse(pool_live_metrics(pool_id=pool_id))
