"""OpenAI-shaped errors for /v1/*: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from django.http import JsonResponse

from budgets.errors import Rejected


def format_duration_ms(ms: int) -> str:
    """OpenAI's x-ratelimit-reset-* style: '120ms', '1.5s', '6m0s'."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000.0
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest}s"


def error_body(*, message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def openai_error(*, status: int, message: str, error_type: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JsonResponse:
    response = JsonResponse(error_body(message=message, error_type=error_type, code=code, param=param), status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def rejected_response(rejected: Rejected, *, extra_headers: dict[str, str] | None = None) -> JsonResponse:
    headers = dict(rejected.headers)
    if rejected.retry_after_ms is not None:
        headers["Retry-After"] = str(rejected.retry_after_s)
        headers["retry-after-ms"] = str(rejected.retry_after_ms)
    headers.update(extra_headers or {})
    return openai_error(
        status=rejected.status,
        message=rejected.message,
        error_type=rejected.error_type,
        code=rejected.reason,
        param=rejected.param,
        headers=headers,
    )


def bad_request(message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> Rejected:
    return Rejected(reason=code or "invalid_request", message=message, status=status, param=param,
                    error_type="invalid_request_error")
