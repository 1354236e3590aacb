"""Django adapter: an ASGI handler with no middleware and no thread per
request, for a JSON API whose views are all async.

Written against Django 5.2.19 (``django.core.handlers.asgi.ASGIHandler``,
``django.core.handlers.base.BaseHandler``, ``django.http.HttpResponseBase``).

What it replaces: Django's ``ASGIHandler`` for the paths it is routed
(llm_platform/asgi.py). Per request, Django's handler enters a
``ThreadSensitiveContext``, sends ``request_started``, runs ``MIDDLEWARE``
(a sync-only middleware in an async stack is a thread hop each way), runs
the view and a disconnect listener as two tasks under ``asyncio.wait``,
logs every 4xx/5xx answer through ``sync_to_async`` and closes the response
through ``sync_to_async`` (sending ``request_finished``). This handler runs
the view in the request's own task with one more task listening for a
disconnect, wraps it in the caller's own async chain instead of
``MIDDLEWARE``, and closes the response on the loop without
``request_finished``.

What its callers must uphold: every blocking call under it runs with
``thread_sensitive=False``, so the loop's thread never holds a database
connection; ``request_finished``'s receivers (``close_old_connections``,
``close_caches``, ``reset_urlconf``) then have nothing to do there, and the
urlconf is set per request.

Measured gain: CPU per refused /v1 request (GET /v1/models without a key,
a 401 decided on the loop), called in-process, 8 callers, 5 rounds of 3,000
alternated A/B, three runs on a shared 2-core machine (2026-12-05, Django
5.2.19, Python 3.11): this handler 253-315 us per refusal (medians 275-286),
Django's ASGIHandler with the project's MIDDLEWARE 2,451-2,754 (medians
2,552-2,629), with no middleware at all 1,461-1,644 (one run): about 2.3 ms saved per
refusal, most of it Django's thread hops, not the middleware. Reproduce:
``python -m bench.handler_overhead``.

Private names it relies on (tests/adapters/test_django.py fails when a
Django upgrade removes or reshapes one):

- ``BaseHandler.load_middleware`` fills ``_view_middleware``,
  ``_template_response_middleware``, ``_exception_middleware`` and
  ``_middleware_chain``, which ``_get_response_async(request)`` (resolve,
  view, template response, exception middleware) reads;
- ``HttpResponseBase._resource_closers``: the callables ``close()`` runs;
- ``ASGIHandler.read_body``, ``create_request``, ``send_response`` and
  ``listen_for_disconnect`` (undocumented, not underscored)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import set_script_prefix, set_urlconf

GetResponse = Callable[[HttpRequest], Awaitable[HttpResponse]]

# How often a view whose client left is cancelled again until it ends.
CANCEL_AGAIN_S = 0.25


def response_on_close(response: HttpResponseBase, closer: Callable[[], object]) -> None:
    """Run ``closer`` when ``response`` is closed (a streamed one: once its
    stream has ended). Django has no public hook for this; it keeps the
    response's own closers (a file's, the request's) in this list."""
    response._resource_closers.append(closer)


def response_close(response: HttpResponseBase) -> None:
    """``HttpResponse.close`` without the ``request_finished`` signal (see
    the module's docstring for why the handler may skip it)."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:  # noqa: BLE001 - as HttpResponse.close
            pass
    response._resource_closers.clear()
    response.closed = True


def cancel_until_done(task: asyncio.Task, finished: Callable[[], bool], every_s: float = CANCEL_AGAIN_S) -> None:
    """Cancel ``task``, and again every ``every_s`` until ``finished()``.
    One cancel is not enough on Python 3.11: ``asyncio.wait_for`` (redis-py
    wraps each command's write in one) returns its result instead of
    raising when the cancel reaches it in the same turn of the loop as its
    inner call finishes (CPython gh-86296, fixed in 3.12). A stream relay
    whose cancel was lost that way would run on to the stream's end for a
    caller who left: the pool call not stopped, the caller billed in full."""
    if finished() or task.done():
        return
    task.cancel()
    asyncio.get_running_loop().call_later(every_s, cancel_until_done, task, finished, every_s)


class MiddlewareFreeASGIHandler(ASGIHandler):
    """Django's ASGI handler with ``MIDDLEWARE`` replaced by ``answer``, an
    async wrapper around Django's own view call (URL resolution, the view,
    template responses). Paths under ``observed_prefixes`` are further
    wrapped by ``observe`` and are not logged by ``django.request`` (the
    wrapper logs them); other paths keep Django's per-error log line.
    ``request_error`` reshapes the answer to a request Django could not
    build (a 400 or 413 before any view)."""

    def __init__(self, *, answer: Callable[[GetResponse], GetResponse], observe: Callable[[GetResponse], GetResponse],
                 observed_prefixes: tuple[str, ...],
                 request_error: Callable[[HttpResponse], HttpResponse] = lambda response: response):
        self._answer = answer
        self._observe = observe
        self.observed_prefixes = observed_prefixes
        self.request_error = request_error
        super().__init__()  # calls load_middleware

    def load_middleware(self, is_async: bool = False) -> None:
        # No MIDDLEWARE: the chain is the caller's wrapper around Django's view call.
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = self._answer(self._get_response_async)
        self._observed_chain = self._observe(self._middleware_chain)

    async def __call__(self, scope, receive, send):
        """One request, without the ThreadSensitiveContext (a thread started
        and joined per request) nor ``request_started``; the response closes
        here, on the loop (``response_close``). A client that disconnects
        still cancels its view, as in Django's."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            response_close(error_response)
            return
        # The view runs in this task; one more task listens for the client
        # leaving and cancels this one (Django runs both as new tasks).
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
                response_close(response)

    async def get_response_async(self, request):
        if not request.path.startswith(self.observed_prefixes):
            return await super().get_response_async(request)
        # Django's, without its django.request line per 4xx/5xx (a thread
        # hop each): the observing wrapper logs every answer itself.
        set_urlconf(settings.ROOT_URLCONF)
        response = await self._observed_chain(request)
        response_on_close(response, request.close)
        return response

    def create_request(self, scope, body_file):
        request, error_response = super().create_request(scope, body_file)
        return request, (self.request_error(error_response) if error_response is not None else None)
