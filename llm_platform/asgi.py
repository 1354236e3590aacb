"""ASGI entry point.

The OpenAI-compatible API (/v1/*), /healthz and /readyz are served by async views on a
handler with no middleware: they need none of the browser's (sessions, CSRF,
cookie auth, messages), and in an async stack Django runs each of those
through a thread hop per request (measured: about a third of the web
process's CPU under a 429 storm). Everything else (web UI, admin,
management API) goes through the full Django stack.

A request waiting for its lane's worker parks on an awaitable Redis read,
not on a thread. Every /v1 answer gets a request id, an access log line and
its metrics (gateway/web/access_log.py); /metrics is served here too, for
the same reason as /healthz: a scrape needs no session."""

import asyncio
import atexit
import functools
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402  (after django.setup())
from django.core.exceptions import RequestAborted  # noqa: E402
from django.urls import get_resolver, set_script_prefix, set_urlconf  # noqa: E402

from budgets.ledger.rejections import rejection_tally_send_at_exit  # noqa: E402
from gateway.web.access_log import api_observed  # noqa: E402
from gateway.web.edge import api_error_response, as_openai_error, body_limit  # noqa: E402
from llm_platform.gc_tuning import gc_tune  # noqa: E402

# A web process that stops sends the rejections it counted and has not sent
# yet (budgets/ledger/rejections.py), once uvicorn has let go of the loop.
atexit.register(rejection_tally_send_at_exit)

API_PREFIXES = ("/v1/",)
API_PATHS = {"/v1", "/healthz", "/readyz", "/metrics"}


def _response_close(response) -> None:
    """HttpResponse.close without the request_finished signal: its receivers
    (close_old_connections, close_caches, reset_urlconf) touch only this
    thread's database connections and caches, and the loop's thread has
    none (every blocking call under /v1 runs with thread_sensitive=False);
    the urlconf is set per request. Sending it was a few percent of a
    refusal's CPU (bench/PROFILE.md, round 3)."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:  # noqa: BLE001 - as HttpResponse.close
            pass
    response._resource_closers.clear()
    response.closed = True


# How often a view whose client left is cancelled again until it ends.
CANCEL_AGAIN_S = 0.25


def cancel_until_done(task: asyncio.Task, finished, every_s: float = CANCEL_AGAIN_S) -> None:
    """Cancel ``task``, and again every ``every_s`` until ``finished()``.
    One cancel is not enough on Python 3.11: ``asyncio.wait_for`` (redis-py
    wraps each command's write in one) returns its result instead of
    raising when the cancel reaches it in the same turn of the loop as its
    inner call finishes (CPython gh-86296, fixed in 3.12). A stream relay
    whose cancel was lost that way would run on to the stream's end for a
    caller who left: the pool call not stopped, the caller billed in full.
    Seen in the bench's sampler, which has the same shape (bench/load.py)."""
    if finished() or task.done():
        return
    task.cancel()
    asyncio.get_running_loop().call_later(every_s, cancel_until_done, task, finished, every_s)


# Paths resolved lately, per resolver: the API has a handful of routes, and
# a job's path (its id) is the only one that varies.
RESOLVED_PATHS = 512


@functools.lru_cache(maxsize=RESOLVED_PATHS)
def _resolved(resolver, path_info: str):
    """``resolver.resolve(path_info)``, kept: the same path resolves to the
    same match while the URLconf is the same (a new one is a new resolver,
    so a new key). A path that resolves to nothing raises each time and is
    not kept, so unknown paths cannot fill the cache."""
    return resolver.resolve(path_info)


class ApiHandler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain, every error
    answered as OpenAI-shaped JSON (gateway/web/edge.py), not an HTML page,
    and one access-log line per /v1 answer (gateway/web/access_log.py)."""

    async def __call__(self, scope, receive, send):
        """One request, without the thread Django's handler starts for it.
        Django enters a ThreadSensitiveContext per request and closes the
        response through sync_to_async: a new thread started and joined per
        request, a third of the web process's samples on the refusal path
        (bench/PROFILE.md). Nothing under /v1 needs it: every blocking call
        there runs with thread_sensitive=False, so the response closes here,
        on the loop: its closers, without request_finished (_response_close),
        whose receivers touch only this thread's database connections, and
        the loop has none. request_started is not sent, for the same reason.
        A client that disconnects still cancels its view, as in Django's."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            _response_close(error_response)
            return
        # The view runs in this task; one more task listens for the client
        # leaving and cancels this one (cheaper than two tasks and an
        # asyncio.wait per request: bench/PROFILE.md, round 3).
        this_task = asyncio.current_task()
        client_left = finished = False

        def on_disconnect(task: asyncio.Task) -> None:
            nonlocal client_left
            if finished or task.cancelled():
                return
            task.exception()  # RequestAborted: the client left
            client_left = True
            cancel_until_done(this_task, lambda: finished)

        disconnect = asyncio.ensure_future(self.listen_for_disconnect(receive))
        disconnect.add_done_callback(on_disconnect)
        response = None
        try:
            response = await self.get_response_async(request)
            await self.send_response(response, send)
        except asyncio.CancelledError:
            if not client_left:
                raise
            # the client went away: its view, or our answer to it, was cancelled
        finally:
            finished = True
            disconnect.remove_done_callback(on_disconnect)
            if not disconnect.done():
                disconnect.cancel()
            elif not disconnect.cancelled():
                disconnect.exception()  # retrieved: the client left as its answer ended
            body_file.close()
            if response is not None:
                _response_close(response)

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = self._api_response
        self._observed_chain = api_observed(self._middleware_chain)

    async def _api_response(self, request):
        try:
            # A bad Host is refused before any view runs: a view that asked
            # only after its work (a job created) would answer 400 for work done.
            request.get_host()
            response = await self._get_response_async(request)
        except Exception as exc:  # noqa: BLE001 - every /v1 answer is JSON, whatever went wrong
            response = api_error_response(request, exc)
        return as_openai_error(response)

    async def get_response_async(self, request):
        if not request.path.startswith(API_PREFIXES):
            return await super().get_response_async(request)
        # Django's own version also logs every 4xx/5xx answer (django.request),
        # each through a thread hop. The access log has a line for every /v1
        # answer, with its reason; an unhandled exception is still logged,
        # with its traceback, where it is caught (inside the request's log
        # context, so with its request id).
        set_urlconf(settings.ROOT_URLCONF)
        response = await self._observed_chain(request)
        response._resource_closers.append(request.close)
        return response

    def resolve_request(self, request):
        """Django's, with the match kept per path (``_resolved``): the
        resolver's walk of the patterns was about 3% of a refusal's CPU
        (bench/PROFILE.md, round 15). The match is shared between requests
        to one path; Django and the views only read it."""
        urlconf = getattr(request, "urlconf", None)
        if urlconf is not None:
            set_urlconf(urlconf)
        resolver_match = _resolved(get_resolver(urlconf), request.path_info)
        request.resolver_match = resolver_match
        return resolver_match

    def create_request(self, scope, body_file):
        request, error_response = super().create_request(scope, body_file)
        return request, (as_openai_error(error_response) if error_response is not None else None)


# The body is read (at most SLUICE_MAX_BODY_BYTES of it) before Django sees it.
api_application = body_limit(ApiHandler())


async def application(scope, receive, send):
    if scope["type"] == "http" and (scope["path"].startswith(API_PREFIXES) or scope["path"] in API_PATHS):
        return await api_application(scope, receive, send)
    return await django_application(scope, receive, send)

# Everything the web process keeps for life is built by now (django.setup(),
# the handlers): freeze it out of the collector (llm_platform/gc_tuning.py).
gc_tune()
