"""What a management API (/api/*) body may be: the same guards as /v1, in
DRF's shape. A body over SLUICE_MAX_BODY_BYTES is a 413 (before Django on
the ASGI server: llm_platform/asgi.py wraps /api in gateway/web/body_limit.py;
here again for any other server); JSON goes through /v1's own parser
(gateway/core/request/chat.py ``parse_json_body``: nesting past 64 levels
refused before parsing, numbers finite and int64, strings free of NUL and
lone surrogates), whose refusals api_exception_handler answers as
``{"detail", "code"}`` 400s. DRF's own JSONParser lets a deeply nested body
raise RecursionError: a 500 to anyone, signed in or not."""

from __future__ import annotations

from django.conf import settings
from rest_framework.parsers import JSONParser

from gateway.core.errors import bad_request
from gateway.core.request.chat import parse_json_body
from gateway.web.body_limit import too_large_message


def api_too_large_body(limit: int) -> dict:
    """The 413's body on /api, as api_exception_handler shapes a refusal."""
    return {"detail": too_large_message(limit), "code": "body_too_large"}


class GuardedJSONParser(JSONParser):
    """DRF's JSON parser with /v1's limits (size, depth, numbers, strings)."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.SLUICE_MAX_BODY_BYTES
        raw = stream.read(limit + 1)
        if len(raw) > limit:
            raise bad_request(too_large_message(limit), code="body_too_large", status=413)
        return parse_json_body(raw)
