"""A batch's input file checked line by line (``validating``): each line is
``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}``.

Two kinds of trouble, as OpenAI's Batch API has them:
- the file itself is wrong (a line that is not JSON, over the line limit,
  without custom_id, a duplicate custom_id, another URL or method, more
  lines than a batch may hold): the batch ends ``failed`` with ``errors``
  naming the lines, and nothing runs;
- one request is refused (a body the endpoint refuses, a model the workload
  may not use, a prompt over its cap): that line goes to the error file
  with the status and error a direct call would get, and the rest run.

Lines are read with a bounded ``readline``: a line past the limit is never
held whole (the rest of it is skipped in chunks)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from budgets.admission.estimation import Estimate
from budgets.errors import Rejected
from gateway.core.request.bodies import request_validate
from gateway.core.request.chat import parse_json_body, request_check
from gateway.core.request.context import CallerContext
from gateway.core.request.endpoints import ApiRequest
from gateway.models import BatchFile

SKIP_CHUNK = 64 * 1024
MAX_CUSTOM_ID = 512
# Enough to fix a file by; a file with more problems is told the first ones.
MAX_ERRORS = 100


@dataclass(frozen=True)
class LineError(Exception):
    """What is wrong with the file at one line (OpenAI's batch ``errors`` item)."""

    code: str
    message: str
    line: int | None
    param: str | None = None

    def view(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class Line:
    """One request of the file: runnable (``api_request`` and ``estimate``)
    or refused (``refused``, its line goes to the error file)."""

    number: int
    custom_id: str
    body: dict[str, Any]
    api_request: ApiRequest | None = None
    estimate: Estimate | None = None
    refused: Rejected | None = None


def raw_lines(stored: BatchFile, *, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, its bytes without the newline, or None for a
    line over ``max_bytes``). Blank lines are skipped but keep their number."""
    with stored.content.open("rb") as handle:
        number = 0
        while True:
            raw = handle.readline(max_bytes + 2)
            if not raw:
                return
            number += 1
            if not raw.endswith(b"\n") and len(raw) > max_bytes:
                while raw and not raw.endswith(b"\n"):
                    raw = handle.readline(SKIP_CHUNK)
                yield number, None
                continue
            text = raw.rstrip(b"\r\n")
            if len(text) > max_bytes:
                yield number, None
            elif text.strip():
                yield number, text


def _line_fields(raw: bytes, *, number: int, endpoint: str) -> tuple[str, dict]:
    try:
        item = parse_json_body(raw)
    except Rejected as rejected:
        raise LineError("invalid_json_line", f"This line is not a JSON object: {rejected.message}", number) from None
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", "Each line needs a 'custom_id' string.", number, "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise LineError("invalid_custom_id", f"'custom_id' is longer than {MAX_CUSTOM_ID} characters.", number,
                        "custom_id")
    if item.get("method") != "POST":
        raise LineError("invalid_method", "'method' must be 'POST'.", number, "method")
    if item.get("url") != endpoint:
        raise LineError("invalid_url", f"'url' must be this batch's endpoint, '{endpoint}'.", number, "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("missing_required_parameter", "Each line needs a 'body' object.", number, "body")
    return custom_id, body


def _request(ctx: CallerContext, *, endpoint: str, number: int, custom_id: str, body: dict) -> Line:
    try:
        api_request = request_validate(endpoint, body)
        request_check(ctx, api_request)
        estimate = api_request.estimate(ctx)
    except Rejected as refused:
        return Line(number=number, custom_id=custom_id, body=body, refused=refused)
    return Line(number=number, custom_id=custom_id, body=body, api_request=api_request, estimate=estimate)


@dataclass
class Checked:
    """What the file held: its errors (the batch fails when there are any)
    and how many requests it has."""

    errors: list[LineError]
    requests: int = 0


def lines_check(stored: BatchFile, *, ctx: CallerContext, endpoint: str, checked: Checked) -> Iterator[Line]:
    """The file's requests, checked; file-level problems go to
    ``checked.errors`` (iteration goes on to find more, up to MAX_ERRORS)."""
    seen: set[str] = set()
    max_lines = settings.SLUICE_BATCH_MAX_LINES
    for number, raw in raw_lines(stored, max_bytes=settings.SLUICE_BATCH_LINE_MAX_BYTES):
        if len(checked.errors) >= MAX_ERRORS:
            return
        if raw is None:
            checked.errors.append(LineError("line_too_large", "This line exceeds "
                                            f"{settings.SLUICE_BATCH_LINE_MAX_BYTES} bytes.", number))
            continue
        try:
            custom_id, body = _line_fields(raw, number=number, endpoint=endpoint)
        except LineError as error:
            checked.errors.append(error)
            continue
        if custom_id in seen:
            checked.errors.append(LineError("duplicate_custom_id", f"The custom_id '{custom_id[:100]}' is used by an "
                                            "earlier line: each request of a batch needs its own.", number,
                                            "custom_id"))
            continue
        seen.add(custom_id)
        checked.requests += 1
        if checked.requests > max_lines:
            checked.errors.append(LineError("too_many_requests", f"A batch holds at most {max_lines} requests.",
                                            number))
            return
        yield _request(ctx, endpoint=endpoint, number=number, custom_id=custom_id, body=body)
