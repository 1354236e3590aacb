"""adapters/django.py against the installed Django: the private names it
relies on still exist with the shapes it uses, and a request through its
handler is answered and closed as Django would, without request_finished.
A Django upgrade that changes any of this fails here first."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest
from django.core import signals
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
from django.http import HttpResponse, HttpResponseBase

from adapters.django import MiddlewareFreeASGIHandler, response_close, response_on_close
from tests.asgi_calls import asgi_call, get_scope


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_handler_methods_it_calls_or_overrides_keep_their_signatures():
    assert _parameters(BaseHandler._get_response_async) == ["self", "request"]
    assert _parameters(BaseHandler.get_response_async) == ["self", "request"]
    assert _parameters(BaseHandler.load_middleware) == ["self", "is_async"]
    assert _parameters(ASGIHandler.read_body) == ["self", "receive"]
    assert _parameters(ASGIHandler.create_request) == ["self", "scope", "body_file"]
    assert _parameters(ASGIHandler.send_response) == ["self", "response", "send"]
    assert _parameters(ASGIHandler.listen_for_disconnect) == ["self", "receive"]
    assert all(inspect.iscoroutinefunction(f) for f in (BaseHandler._get_response_async, ASGIHandler.read_body,
                                                        ASGIHandler.send_response, ASGIHandler.listen_for_disconnect))


def test_load_middleware_still_fills_the_attributes_the_adapter_replaces():
    # Django's own handler, with the project's MIDDLEWARE, sets exactly what
    # the adapter's load_middleware sets instead, and _get_response_async reads them.
    handler = ASGIHandler()
    replaced = ("_view_middleware", "_template_response_middleware", "_exception_middleware", "_middleware_chain")
    assert all(hasattr(handler, name) for name in replaced)
    reads = inspect.getsource(BaseHandler._get_response_async) + inspect.getsource(BaseHandler.process_exception_by_middleware)
    assert all(name in reads for name in replaced[:3])


# Django's own close sends request_finished, whose receivers close stale database connections.
@pytest.mark.django_db
def test_response_close_is_django_close_without_request_finished():
    # given two responses with the same closers
    finished, ran = [], []

    def on_finished(**kwargs):
        finished.append(kwargs["sender"])

    signals.request_finished.connect(on_finished)
    try:
        ours, djangos = HttpResponse(), HttpResponse()
        for response in (ours, djangos):
            assert isinstance(response._resource_closers, list)
            response_on_close(response, lambda r=response: ran.append(r))
            response_on_close(response, lambda: 1 / 0)  # a failing closer is skipped, as in Django's
        # when one is closed by Django, the other by the adapter
        djangos.close()
        response_close(ours)
    finally:
        signals.request_finished.disconnect(on_finished)
    # then both ran their closers once and are closed; only Django's sent request_finished
    assert ran == [djangos, ours]
    assert ours.closed and djangos.closed and ours._resource_closers == djangos._resource_closers == []
    assert len(finished) == 1
    assert "_resource_closers" in inspect.getsource(HttpResponseBase.close)


def test_a_request_through_the_handler_is_answered_and_closes_its_resources():
    # given a handler whose observing wrapper registers a closer on each answer
    events: list[str] = []

    def answer(view_response):
        async def answered(request):
            events.append("answer")
            return await view_response(request)  # Django's resolve and view
        return answered

    def observe(get_response):
        async def observed(request):
            response = await get_response(request)
            response_on_close(response, lambda: events.append(f"closed {response.status_code}"))
            return response
        return observed

    finished = []

    def on_finished(**kwargs):
        finished.append(kwargs["sender"])

    handler = MiddlewareFreeASGIHandler(answer=answer, observe=observe, observed_prefixes=("/v1/",))
    signals.request_finished.connect(on_finished)
    try:
        # when /v1/models is called without a key (its view answers 401 on the loop)
        sent = asyncio.run(asgi_call(handler, get_scope("/v1/models")))
    finally:
        signals.request_finished.disconnect(on_finished)
    # then the view's JSON answer was sent, the closers ran after it, and request_finished was not sent
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["code"] == "missing_api_key"
    assert events == ["answer", "closed 401"]
    assert finished == []
