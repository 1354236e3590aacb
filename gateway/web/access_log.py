"""The API's access log and request ids: every /v1 answer, whatever produced
it (a view, a refusal, an unknown path, an unhandled exception), gets an
``x-request-id`` header, one structured log line (logger ``sluice.access``)
and its count in the metrics. It replaces uvicorn's access log, which knows
neither the workload, the lane nor why a request was refused.

The request id is the one the ledger row and the worker's log lines carry
(gateway/web/dispatch.py hands it on). A client's own ``X-Request-Id`` is not
taken: the id is the ledger's unique key, so a caller must not choose it.

Nothing a caller sends is logged verbatim except the path (truncated, no
query string: query strings carry tokens); never a header, never a body."""

from __future__ import annotations

import json
import logging
import time

from django.http import HttpRequest, HttpResponse

from adapters.django import GetResponse, response_on_close
from gateway.core.request.enqueue import new_request_id
from gateway.core.log_context import log_context
from gateway.core.observability import api_response_observe, refusal_observe

access_log = logging.getLogger("sluice.access")

# Routes whose errors are refusals of work (the others are lookups).
ADMITTING_ROUTES = {"chat-completions", "jobs"}
CLIENT_GONE = 499  # nginx's code: the client closed the connection before the answer
MAX_LOGGED_PATH = 200


def error_code(response: HttpResponse) -> str:
    """The machine-readable reason of an error answer: the OpenAI-shaped
    body's ``error.code``, else ``http_<status>``."""
    if response.status_code < 400:
        return ""
    known = getattr(response, "openai_error_code", None)  # set by gateway/web/responses.py openai_error
    if known is not None:
        return known or f"http_{response.status_code}"
    if not response.streaming and response.get("Content-Type", "").startswith("application/json"):
        try:
            code = json.loads(response.content).get("error", {}).get("code")
        except (ValueError, AttributeError):
            code = None
        if isinstance(code, str) and code:
            return code
    return f"http_{response.status_code}"


def _printable(text: str) -> str:
    """A decoded path may hold a newline (%0A): escaped, it cannot forge a log line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def api_observed(get_response: GetResponse) -> GetResponse:
    """Wrap the API's request handling (llm_platform/asgi.py) with the request
    id, the access log line and the response metrics."""

    async def observed(request: HttpRequest) -> HttpResponse:
        request_id = new_request_id()
        request.request_id = request_id
        started = time.monotonic()
        response = None
        with log_context(request_id=request_id) as fields:
            try:
                response = await get_response(request)
                if not response.has_header("x-request-id"):
                    response["x-request-id"] = request_id
                return response
            finally:
                if response is not None and response.streaming:
                    # A stream's line when it has ended (when the response
                    # is closed), with its whole time, and not between its
                    # first chunk and the caller.
                    response_on_close(response, lambda: _report(request, response, fields, started))
                else:
                    # Also when the client went away mid-request (the task
                    # is cancelled): that line is the only trace of it.
                    _report(request, response, fields, started)

    return observed


def _report(request: HttpRequest, response: HttpResponse | None, fields: dict, started: float) -> None:
    status = response.status_code if response is not None else CLIENT_GONE
    reason = error_code(response) if response is not None else "client_closed_request"
    match = getattr(request, "resolver_match", None)
    route = match.url_name if match is not None and match.url_name else "unmatched"
    api_response_observe(route=route, status=status)
    if status >= 400 and route in ADMITTING_ROUTES:
        refusal_observe(reason=reason, workload_id=fields.get("workload_id"), lane=fields.get("lane"))
    line = {
        **fields,
        "method": request.method,
        "path": _printable(request.path[:MAX_LOGGED_PATH]),
        "route": route,
        "status": status,
        "reason": reason,
        "total_ms": int((time.monotonic() - started) * 1000),
    }
    answered_as = response.get("x-request-id") if response is not None else None
    if answered_as and answered_as != fields.get("request_id"):
        line["replayed_request_id"] = answered_as  # an idempotent replay answers with the original's id
    access_log.log(logging.WARNING if status >= 500 else logging.INFO, "%s %s %s %s", request.method,
                   line["path"], status, reason, extra=line)
