"""Static files (the web UI's and the API docs' assets) through WhiteNoise,
without putting the OpenAI-compatible API behind a thread hop.

WhiteNoise's middleware is sync-only, so in the middle of an async stack it
makes Django run every request, /v1 included, through a thread (measured:
~half the CPU of a rejection under load). This wrapper is async-capable,
answers only STATIC_URL paths from WhiteNoise's file table, and passes
everything else straight on."""

from __future__ import annotations

from pathlib import Path

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest
from whitenoise.middleware import WhiteNoiseMiddleware


def _no_view(request: HttpRequest):  # WhiteNoise wants one; we never call through it
    return None


class StaticFilesMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        # Assets are found in the installed apps (WHITENOISE_USE_FINDERS) until
        # collectstatic fills STATIC_ROOT; an absent root only makes WhiteNoise warn.
        Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
        self.whitenoise = WhiteNoiseMiddleware(_no_view)
        self.prefix = "/" + settings.STATIC_URL.lstrip("/")
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    def _static(self, request: HttpRequest):
        if not request.path_info.startswith(self.prefix):
            return None
        whitenoise = self.whitenoise
        found = whitenoise.find_file(request.path_info) if whitenoise.autorefresh else whitenoise.files.get(request.path_info)
        return whitenoise.serve(found, request) if found is not None else None

    def __call__(self, request: HttpRequest):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self._static(request) or self.get_response(request)

    async def __acall__(self, request: HttpRequest):
        if request.path_info.startswith(self.prefix):
            response = await sync_to_async(self._static, thread_sensitive=False)(request)
            if response is not None:
                return response
        return await self.get_response(request)
