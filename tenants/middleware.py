"""Finance auditors change nothing: any web-UI request from one that could
change state (POST, PUT, PATCH, DELETE) is refused before it reaches a view,
except signing out. The management API applies the same rule in its
permission classes (its token users are resolved inside DRF), and the
OpenAI-compatible API (/v1) is keyed by workload API keys, not users, so both
are left alone here. Sync and async capable: it must not push the async
gateway views through a thread."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseForbidden

from tenants.roles import user_is_finance_auditor

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
EXEMPT_PREFIXES = ("/v1/", "/api/", "/healthz", "/readyz", "/accounts/logout/")


def _applies(request: HttpRequest) -> bool:
    return request.method not in SAFE_METHODS and not request.path.startswith(EXEMPT_PREFIXES)


def _forbidden() -> HttpResponseForbidden:
    return HttpResponseForbidden("Finance auditors have read-only access.")


class FinanceReadOnlyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        if _applies(request) and user_is_finance_auditor(request.user):
            return _forbidden()
        return self.get_response(request)

    async def __acall__(self, request: HttpRequest):
        if _applies(request):
            user = await request.auser()
            if await _is_finance(user):
                return _forbidden()
        return await self.get_response(request)


async def _is_finance(user) -> bool:
    from asgiref.sync import sync_to_async

    return await sync_to_async(user_is_finance_auditor)(user)
