"""The OpenAI-compatible API (/v1/*) and the health check. Async views on an
ASGI server: a request waiting for its lane parks on an awaitable Redis read."""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from budgets.errors import Rejected

from .auth import CallerContext, bearer_key, caller_context
from .dispatch import chat_completion
from .errors import format_duration_ms, openai_error, rejected_response
from .health import health_report
from .validation import parse_json_body, validate_chat_request

logger = logging.getLogger(__name__)


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


def _ratelimit_headers(ctx_limits: dict[str, int], *, remaining_tokens: int, remaining_requests: int,
                       tokens_reset_ms: int, requests_reset_ms: int) -> dict[str, str]:
    return {
        "x-ratelimit-limit-tokens": str(ctx_limits["tokens"]),
        "x-ratelimit-remaining-tokens": str(max(0, remaining_tokens)),
        "x-ratelimit-reset-tokens": format_duration_ms(tokens_reset_ms),
        "x-ratelimit-limit-requests": str(ctx_limits["requests"]),
        "x-ratelimit-remaining-requests": str(max(0, remaining_requests)),
        "x-ratelimit-reset-requests": format_duration_ms(requests_reset_ms),
    }


@csrf_exempt
async def chat_completions(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return openai_error(status=405, message="Use POST.", error_type="invalid_request_error", code="method_not_allowed")
    started = time.monotonic()
    auth = await _authenticate(request)
    if isinstance(auth, JsonResponse):
        return auth
    ctx = auth
    try:
        length = int(request.headers.get("Content-Length") or 0)
    except ValueError:
        length = 0
    if length > settings.SLUICE_MAX_BODY_BYTES or len(request.body) > settings.SLUICE_MAX_BODY_BYTES:
        return openai_error(status=413, message=f"The request body exceeds {settings.SLUICE_MAX_BODY_BYTES} bytes.",
                            error_type="invalid_request_error", code="body_too_large")
    try:
        chat = validate_chat_request(parse_json_body(request.body))
        if chat.stream:
            raise Rejected(reason="stream_unsupported", message="Streaming is not supported yet; send stream=false.",
                           status=400, param="stream", error_type="invalid_request_error")
        if ctx.pool_id is None:
            raise Rejected(reason="no_reservation", message="This workload has no budget on any pool.", status=403,
                           error_type="permission_error")
        if chat.model not in ctx.served_models:
            raise Rejected(reason="model_not_found", message=f"The model '{chat.model}' does not exist on this workload's pool.",
                           status=404, param="model", error_type="invalid_request_error")
        dispatched = await chat_completion(ctx=ctx, chat=chat, session_id=request.headers.get("X-Session-Id", "")[:128])
    except Rejected as rejected:
        extra = {}
        remaining = getattr(rejected, "remaining_tokens", None)
        if remaining is not None:
            extra = _ratelimit_headers(ctx.limits, remaining_tokens=rejected.remaining_tokens,
                                       remaining_requests=rejected.remaining_requests,
                                       tokens_reset_ms=rejected.tokens_reset_ms,
                                       requests_reset_ms=rejected.requests_reset_ms)
        return rejected_response(rejected, extra_headers=extra)

    outcome = dispatched.outcome
    admission = dispatched.admission
    headers = {
        "x-request-id": dispatched.request_id,
        "x-sluice-lane": dispatched.lane,
        "x-sluice-borrowed": "true" if admission.borrowed else "false",
        "x-sluice-max-tokens-applied": str(dispatched.estimate.output_tokens),
        "x-sluice-estimated-prompt-tokens": str(dispatched.estimate.input_tokens),
        "x-sluice-queue-ms": str(outcome.queue_wait_ms),
        "x-sluice-total-ms": str(int((time.monotonic() - started) * 1000)),
        **_ratelimit_headers(ctx.limits, remaining_tokens=admission.remaining_tokens,
                             remaining_requests=admission.remaining_requests,
                             tokens_reset_ms=admission.tokens_reset_ms,
                             requests_reset_ms=admission.requests_reset_ms),
    }
    if outcome.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-outcome.retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(outcome.retry_after_ms)
    response = JsonResponse(outcome.body or {}, status=outcome.http_status)
    for name, value in headers.items():
        response[name] = value
    return response


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
