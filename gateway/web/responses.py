"""Refusals as HTTP: OpenAI-shaped JSON errors with the headers the official
SDKs read to back off (Retry-After, retry-after-ms, x-ratelimit-*)."""

from __future__ import annotations

from django.http import JsonResponse

from budgets.errors import RateLimitSnapshot, Rejected
from gateway.core.errors import error_body


def format_duration_ms(ms: int) -> str:
    """OpenAI's x-ratelimit-reset-* style: '120ms', '1.5s', '6m0s'."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000.0
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest}s"


def ratelimit_headers(limits: dict[str, int], snapshot: RateLimitSnapshot) -> dict[str, str]:
    return {
        "x-ratelimit-limit-tokens": str(limits["tokens"]),
        "x-ratelimit-remaining-tokens": str(max(0, snapshot.remaining_tokens)),
        "x-ratelimit-reset-tokens": format_duration_ms(snapshot.tokens_reset_ms),
        "x-ratelimit-limit-requests": str(limits["requests"]),
        "x-ratelimit-remaining-requests": str(max(0, snapshot.remaining_requests)),
        "x-ratelimit-reset-requests": format_duration_ms(snapshot.requests_reset_ms),
    }


def openai_error(*, status: int, message: str, error_type: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JsonResponse:
    response = JsonResponse(error_body(message=message, error_type=error_type, code=code, param=param), status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    # The access log's reason, known here: it need not parse the body again
    # (gateway/web/access_log.py error_code).
    response.openai_error_code = code or ""
    return response


def rejected_response(rejected: Rejected, *, limits: dict[str, int] | None = None) -> JsonResponse:
    headers = dict(rejected.headers)
    if rejected.retry_after_ms is not None:
        headers["Retry-After"] = str(rejected.retry_after_s)
        headers["retry-after-ms"] = str(rejected.retry_after_ms)
    limits = rejected.limits or limits
    if rejected.rate_limits is not None and limits is not None:
        headers.update(ratelimit_headers(limits, rejected.rate_limits))
    return openai_error(status=rejected.status, message=rejected.message, error_type=rejected.error_type,
                        code=rejected.reason, param=rejected.param, headers=headers)
