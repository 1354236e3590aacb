"""Redis (the buckets, spend, rejection counts, the queue) being unreachable
or hung is not a server error. Pages that can fall back to the database do
(month-to-date spend from the ledger, flushed rejections) and say so in a
banner and an ``X-Sluice-Degraded`` header; a page that cannot answers a 503 page that says what is missing and
reloads itself; the management API answers a DRF-shaped 503
(llm_platform/api_errors.py); /v1 answers OpenAI's shape (gateway/web/views.py).
Each answers within the Redis client's timeout (SLUICE_REDIS_TIMEOUT_S) per
Redis call."""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string

from budgets.redis.clients import REDIS_UNAVAILABLE, unavailable_note_start, unavailable_noted
from budgets.errors import BudgetUnavailable

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
DEGRADED_HEADER = "X-Sluice-Degraded"
STORE_UNAVAILABLE = (BudgetUnavailable, *REDIS_UNAVAILABLE)


class StoreUnavailableMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        unavailable_note_start()
        response = self.get_response(request)
        noted = unavailable_noted()
        if noted:
            # Machine-readable for API clients: the answer came from the
            # database alone, without the live parts named here.
            response[DEGRADED_HEADER] = "; ".join(noted)
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, STORE_UNAVAILABLE):
            return None
        logger.warning("%s %s: Redis unavailable: %s", request.method, request.path, exception)
        # The page reloads itself with a meta refresh (no script), and its one
        # style block carries the response's CSP nonce.
        nonce = str(request.csp_nonce) if hasattr(request, "csp_nonce") else ""  # str(): the nonce is lazy
        context = {"retry_after_s": RETRY_AFTER_S, "csp_nonce": nonce}
        response = HttpResponse(render_to_string("503.html", context), status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response


def store_status(request: HttpRequest) -> dict:
    """Template context: what this page had to show without Redis."""
    return {"store_unavailable": unavailable_noted()}
