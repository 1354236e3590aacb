"""ASGI entry point.

The OpenAI-compatible API (/v1/*), /healthz and /readyz are served by async views on a
handler with no middleware: they need none of the browser's (sessions, CSRF,
cookie auth, messages), and in an async stack Django runs each of those
through a thread hop per request (measured: about a third of the web
process's CPU under a 429 storm). Everything else (web UI, admin,
management API) goes through the full Django stack.

A request waiting for its lane's worker parks on an awaitable Redis read,
not on a thread."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
django_application = get_asgi_application()

from django.core.handlers.asgi import ASGIHandler  # noqa: E402  (after django.setup())
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402

API_PREFIXES = ("/v1/",)
API_PATHS = {"/healthz", "/readyz"}


class ApiHandler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


api_application = ApiHandler()


async def application(scope, receive, send):
    if scope["type"] == "http" and (scope["path"].startswith(API_PREFIXES) or scope["path"] in API_PATHS):
        return await api_application(scope, receive, send)
    return await django_application(scope, receive, send)
