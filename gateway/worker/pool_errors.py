"""The openai SDK's exception for a pool's error answer, built with the SDK's
public exception classes from an answer the worker read itself
(gateway/worker/pool_client.py sends without the SDK's request building).

The retry policy (gateway/worker/execution.py) and the provider-limit
bookkeeping tell answers apart by these classes, their ``status_code``,
``body`` and ``response.headers`` (retry-after, x-ratelimit-*): what
``client.chat.completions.create`` raises for the same answer.
tests/gateway/test_pool_errors.py holds the two side by side for every
status the SDK tells apart, so an SDK upgrade that changes its mapping fails
there."""

from __future__ import annotations

import json
from collections.abc import Mapping

import httpx
import openai

# The SDK's classes by status; any other error status >= 500 is an
# InternalServerError, anything else the base APIStatusError.
_BY_STATUS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    403: openai.PermissionDeniedError,
    404: openai.NotFoundError,
    409: openai.ConflictError,
    422: openai.UnprocessableEntityError,
    429: openai.RateLimitError,
}


def pool_status_error(response: httpx.Response) -> openai.APIStatusError:
    """The SDK's exception for ``response`` (status >= 400), read to its end
    or closed unread (an error body the connection lost on the way: no body).
    Its ``body`` is the JSON's ``error`` object (else the JSON, else the
    text), its message ``Error code: <status>`` and that error's ``message``,
    as the SDK words them."""
    status = response.status_code
    message = f"Error code: {status}"
    body: object = None
    if response.is_stream_consumed or not response.is_closed:
        text = response.text.strip()
        body = text
        try:
            body = json.loads(text)
        except (ValueError, RecursionError):  # not JSON (or nested past the parser): the text
            pass
        if isinstance(body, Mapping):
            body = body.get("error", body)
            if isinstance(body, Mapping) and isinstance(body.get("message"), str) and body["message"]:
                message += f" - {body['message']}"
    error_class = _BY_STATUS.get(status) or (openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return error_class(message, response=response, body=body)


# How much of a pool's own error message the ledger keeps.
POOL_MESSAGE_CHARS = 200


def pool_error_message(exc: openai.APIStatusError) -> str:
    """The pool's own words for its error answer, short and on one line:
    the JSON error's ``message`` (or the JSON's, or the text), truncated."""
    body = exc.body
    message = body.get("message") if isinstance(body, Mapping) else body
    if not isinstance(message, str) or not message:
        message = exc.response.text if exc.response is not None else ""
    message = " ".join(message.replace("\x00", "").split())
    return message if len(message) <= POOL_MESSAGE_CHARS else message[:POOL_MESSAGE_CHARS - 1] + "…"
