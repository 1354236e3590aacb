"""ASGI entry point.

The OpenAI-compatible API (/v1/*), /healthz, /readyz and /metrics are served
by async views on a handler with no middleware (adapters/django.py): they
need none of the browser's (sessions, CSRF, cookie auth, messages), and in
an async stack Django runs each request through thread hops for them. A
scrape or a probe needs no session either. Everything else (web UI, admin,
management API) goes through the full Django stack.

A request waiting for its lane's worker parks on an awaitable Redis read,
not on a thread. Every /v1 answer is OpenAI-shaped JSON (gateway/web/edge.py)
and gets a request id, an access log line and its metrics
(gateway/web/access_log.py)."""

import atexit
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
django_application = get_asgi_application()

import llm_tokens  # noqa: E402
from adapters.django import MiddlewareFreeASGIHandler  # noqa: E402  (after django.setup())
from budgets.models import InferencePool  # noqa: E402
from budgets.ledger.rejections import rejection_tally_send_at_exit  # noqa: E402
from gateway.core.request.endpoints import POOL_PATHS  # noqa: E402
from gateway.web.access_log import api_observed  # noqa: E402
from gateway.web.admission_turns import admission_turns  # noqa: E402
from django.conf import settings  # noqa: E402
from gateway.web.body_limit import MULTIPART_ROOM, body_limit, body_limit_streamed  # noqa: E402
from gateway.web.edge import api_answered, as_openai_error  # noqa: E402
from gateway.web.loop_lag import loop_lag_watch  # noqa: E402
from llm_platform.api_input import api_too_large_body  # noqa: E402
from llm_platform.gc_tuning import gc_tune  # noqa: E402

# A web process that stops sends the rejections it counted and has not sent
# yet (budgets/ledger/rejections.py), once uvicorn has let go of the loop.
atexit.register(rejection_tally_send_at_exit)

API_PREFIXES = ("/v1/",)
API_PATHS = {"/v1", "/healthz", "/readyz", "/metrics"}
MANAGEMENT_PREFIX = "/api/"

# The body is read (at most SLUICE_MAX_BODY_BYTES of it) before Django sees it.
api_handler = MiddlewareFreeASGIHandler(
    answer=api_answered, observe=api_observed, observed_prefixes=API_PREFIXES, request_error=as_openai_error)
api_application = body_limit(api_handler)
# The endpoints that admit a request take turns at the door
# (gateway/web/admission_turns.py) once their whole body has arrived: a
# caller that trickles its body holds nothing but its own connection.
# They are the endpoints the pool serves, at the same paths (OpenAI's).
ADMITTING_PATHS = frozenset(f"/v1/{path}" for path in POOL_PATHS.values())
admitting_application = body_limit(admission_turns(api_handler))
# A file upload is the one /v1 body allowed past that: streamed, to its own limit.
FILES_PATH = "/v1/files"
files_application = body_limit_streamed(api_handler,
                                        limit=lambda: settings.SLUICE_BATCH_FILE_MAX_BYTES + MULTIPART_ROOM)
# The management API's bodies are bounded the same way (its JSON guards:
# llm_platform/api_input.py); Django alone would spool any body to disk first.
management_application = body_limit(django_application, refusal=api_too_large_body)


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith(API_PREFIXES):
        loop_lag_watch()  # the loop's turns on /metrics (gateway/web/loop_lag.py)
    if scope["type"] == "http" and scope["path"] == FILES_PATH and scope.get("method") == "POST":
        return await files_application(scope, receive, send)
    if scope["type"] == "http" and scope["path"] in ADMITTING_PATHS and scope.get("method") == "POST":
        return await admitting_application(scope, receive, send)
    if scope["type"] == "http" and (scope["path"].startswith(API_PREFIXES) or scope["path"] in API_PATHS):
        return await api_application(scope, receive, send)
    if scope["type"] == "http" and scope["path"].startswith(MANAGEMENT_PREFIX):
        return await management_application(scope, receive, send)
    return await django_application(scope, receive, send)

# The default pool tokenizer's ranks, parsed now rather than on the event
# loop by the first request (another pool's tokenizer is loaded on a thread
# by its first request: gateway/web/dispatch.py).
llm_tokens.get_encoding(InferencePool._meta.get_field("tokenizer").default)

# Everything the web process keeps for life is built by now (django.setup(),
# the handlers, the tokenizer): freeze it out of the collector (llm_platform/gc_tuning.py).
gc_tune()
