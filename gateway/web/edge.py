"""The edge of /v1: what answers before and around the views, so that every
answer on /v1 is OpenAI-shaped JSON, whatever goes wrong and wherever.

- the body's size limit, before Django: gateway/web/body_limit.py;
- ``api_error_response``: an exception raised outside a view's own handling
  (an unknown path, a bad Host header, a malformed URL, a bug) as an OpenAI
  error instead of Django's HTML page.
- ``as_openai_error``: any non-JSON error response (Django's 404/405/400
  pages) rewritten in OpenAI's shape, keeping its status and headers.
- ``api_answered``: the two above around Django's view call, with a bad
  Host refused before any view runs.

llm_platform/asgi.py wires them around the /v1 handler."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from django.conf import settings
from django.core.exceptions import BadRequest, DisallowedHost, PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse

from adapters.django import GetResponse
from gateway.web.body_limit import too_large_body
from gateway.web.responses import openai_error

logger = logging.getLogger("django.request")

# status -> (OpenAI error type, code) for errors that no view chose itself.
_STATUS_ERRORS = {
    400: ("invalid_request_error", "bad_request"),
    403: ("permission_error", "permission_denied"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "body_too_large"),
}
# Headers of the original response that still mean something on the JSON one.
_KEPT_HEADERS = ("Allow", "Retry-After", "retry-after-ms")


def api_error_response(request: HttpRequest, exc: Exception) -> HttpResponse:
    """An exception no view turned into an answer, as an OpenAI error."""
    if isinstance(exc, Http404):
        return openai_error(status=404, message=f"Unknown API path: {request.method} {request.path[:200]}.",
                            error_type="invalid_request_error", code="not_found")
    if isinstance(exc, RequestDataTooBig):
        return openai_error(status=413, message=too_large_body(settings.SLUICE_MAX_BODY_BYTES)["error"]["message"],
                            error_type="invalid_request_error", code="body_too_large")
    if isinstance(exc, DisallowedHost):
        return openai_error(status=400, message="Invalid Host header.", error_type="invalid_request_error",
                            code="invalid_host")
    if isinstance(exc, (SuspiciousOperation, BadRequest)):
        return openai_error(status=400, message="Bad request.", error_type="invalid_request_error", code="bad_request")
    if isinstance(exc, PermissionDenied):
        return openai_error(status=403, message="Permission denied.", error_type="permission_error",
                            code="permission_denied")
    logger.error("%s %s: unhandled error", request.method, request.path, exc_info=exc)
    return openai_error(status=500, message="Sluice had an internal error while handling this request.",
                        error_type="server_error", code="internal_error")


def as_openai_error(response: HttpResponse) -> HttpResponse:
    """A non-JSON error response rewritten as OpenAI's error body."""
    if response.status_code < 400 or response.get("Content-Type", "").startswith("application/json"):
        return response
    error_type, code = _STATUS_ERRORS.get(response.status_code, ("server_error", "internal_error")
                                          if response.status_code >= 500 else ("invalid_request_error", "bad_request"))
    try:
        phrase = HTTPStatus(response.status_code).phrase
    except ValueError:
        phrase = "Error"
    rewritten = openai_error(status=response.status_code, message=f"{phrase}.", error_type=error_type, code=code)
    for name in _KEPT_HEADERS:
        if name in response:
            rewritten[name] = response[name]
    return rewritten


def api_answered(view_response: GetResponse) -> GetResponse:
    """``view_response`` (Django's URL resolution and view call) with every
    answer OpenAI-shaped JSON, whatever went wrong."""

    async def answered(request: HttpRequest) -> HttpResponse:
        try:
            # A bad Host is refused before any view runs: a view that asked
            # only after its work (a job created) would answer 400 for work done.
            request.get_host()
            response = await view_response(request)
        except Exception as exc:  # noqa: BLE001 - every /v1 answer is JSON, whatever went wrong
            response = api_error_response(request, exc)
        return as_openai_error(response)

    return answered
