"""Sign-in with throttling, wherever a password is checked: the web UI's
login page, Django admin's login and the management API's token endpoint.
Failed attempts are counted per user and per client address in Redis
(gateway/core/protection/throttle.py); past either limit the answer is 429 with
Retry-After until the window ends, without checking the password. Redis
away: the attempt cannot be counted, so it is not made (a 503, like every
page that needs Redis), never an unthrottled password check."""

from __future__ import annotations

import functools
import math
import unicodedata
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.exceptions import Throttled
from rest_framework.parsers import FormParser, MultiPartParser

from gateway.core.protection.throttle import AttemptBudget, request_client_address
from llm_platform.api_input import GuardedJSONParser


# Failed sign-ins per username and per client address, per window; read from
# settings at each use, so a changed setting (or a test's) applies.
def login_user_budget() -> AttemptBudget:
    return AttemptBudget("login-user", settings.SLUICE_LOGIN_FAILURES_PER_USER, settings.SLUICE_LOGIN_FAILURE_WINDOW_S)


def login_address_budget() -> AttemptBudget:
    return AttemptBudget("login-address", settings.SLUICE_LOGIN_FAILURES_PER_ADDRESS,
                         settings.SLUICE_LOGIN_FAILURE_WINDOW_S, by_address=True)


@dataclass(frozen=True)
class LoginAttempt:
    """An attempt taken from the user's and the address's budgets, or refused."""

    allowed: bool
    retry_after_ms: int
    taken: tuple[tuple[AttemptBudget, str], ...] = ()

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.retry_after_ms / 1000))


def _username_subject(username: object) -> str:
    # The login form NFKC-normalizes usernames ("ａｄｍｉｎ" signs in as
    # "admin"), so every spelling of one user must share one budget.
    return unicodedata.normalize("NFKC", username if isinstance(username, str) else str(username))


def login_attempt_take(*, username: object, address: str) -> LoginAttempt:
    taken: list[tuple[AttemptBudget, str]] = []
    for budget, subject in ((login_user_budget(), _username_subject(username)), (login_address_budget(), address)):
        result = budget.take_call(subject).run()
        if not result.allowed:
            login_attempt_refund(LoginAttempt(allowed=True, retry_after_ms=0, taken=tuple(taken)))
            return LoginAttempt(allowed=False, retry_after_ms=result.retry_after_ms)
        taken.append((budget, subject))
    return LoginAttempt(allowed=True, retry_after_ms=0, taken=tuple(taken))


def login_attempt_refund(attempt: LoginAttempt) -> None:
    """The password was right: the attempt does not count as a failure."""
    for budget, subject in attempt.taken:
        budget.refund_call(subject).run()


def login_policy() -> dict:
    """What the login page tells people about the throttle."""
    return {"per_user": settings.SLUICE_LOGIN_FAILURES_PER_USER,
            "per_address": settings.SLUICE_LOGIN_FAILURES_PER_ADDRESS,
            "window_minutes": max(1, round(settings.SLUICE_LOGIN_FAILURE_WINDOW_S / 60))}


def _blocked_page(request: HttpRequest, attempt: LoginAttempt) -> HttpResponse:
    form = AuthenticationForm(request, initial={"username": str(request.POST.get("username", ""))[:150]})
    response = render(request, "registration/login.html", {
        "form": form, "next": request.POST.get("next", ""), "login_policy": login_policy(),
        "throttled_minutes": max(1, math.ceil(attempt.retry_after_s / 60)),
    }, status=429)
    response["Retry-After"] = str(attempt.retry_after_s)
    return response


def login_throttled(view):
    """Wrap a view that signs a user in from a POSTed username/password form
    (Django's LoginView, admin's login). Success is a fresh login: the user
    is authenticated and the session was cycled (login() always cycles it),
    so an already signed-in user posting guesses for another account is
    still counted."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        attempt = login_attempt_take(username=request.POST.get("username", ""),
                                     address=request_client_address(request.META))
        if not attempt.allowed:
            return _blocked_page(request, attempt)
        session_before = request.session.session_key
        response = view(request, *args, **kwargs)
        if request.user.is_authenticated and request.session.session_key != session_before:
            login_attempt_refund(attempt)
        return response

    return wrapper


class SluiceLoginView(LoginView):
    """Django's login page, saying how many failures it allows."""

    redirect_authenticated_user = True

    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), "login_policy": login_policy()}


class ThrottledObtainAuthToken(ObtainAuthToken):
    """POST /api/auth/token/ (username + password -> token), throttled like
    the login page: it checks the same passwords. Its parsers are the API's
    (ObtainAuthToken names DRF's own, which a deeply nested body crashes)."""

    parser_classes = (FormParser, MultiPartParser, GuardedJSONParser)

    def post(self, request, *args, **kwargs):
        data = request.data
        username = data.get("username", "") if hasattr(data, "get") else ""
        attempt = login_attempt_take(username=username, address=request_client_address(request.META))
        if not attempt.allowed:
            raise Throttled(wait=attempt.retry_after_s,
                            detail=f"Too many failed sign-ins; retry in {attempt.retry_after_s} s.")
        response = super().post(request, *args, **kwargs)
        if response.status_code == 200:
            login_attempt_refund(attempt)
        return response
