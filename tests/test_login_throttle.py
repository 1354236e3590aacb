"""Password guessing: failed sign-ins are counted per user and per client
address in Redis, on every door that checks a password (the login page,
Django admin's login, /api/auth/token/); past a limit the answer is a 429
that says so, even for the right password, until the window ends."""

from __future__ import annotations

import re
import threading
import time

import pytest
from django.test import Client

from budgets.redis.clients import reset_clients
from llm_platform.login import login_address_budget, login_user_budget
from llm_platform.login import login_attempt_take
from tests.people import PASSWORD, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def limits(settings):
    # A fast hash: PBKDF2's deliberate slowness would make this module take minutes.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *settings.PASSWORD_HASHERS]
    settings.SLUICE_LOGIN_FAILURES_PER_USER = 3
    settings.SLUICE_LOGIN_FAILURES_PER_ADDRESS = 100
    settings.SLUICE_LOGIN_FAILURE_WINDOW_S = 60
    return settings


@pytest.fixture
def admin(limits):
    user = make_user(f"root-{time.monotonic_ns()}", staff=True, superuser=True)
    user.set_password(PASSWORD)
    user.save()
    return user


def sign_in(client: Client, username: str, password: str, path: str = "/accounts/login/"):
    return client.post(path, {"username": username, "password": password})


def signed_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_the_login_page_states_the_limits(client, limits):
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    assert "After 3 failed sign-ins for one user, or 100 from one address, sign-in pauses for up to 1 minutes." in \
        re.sub(r"\s+", " ", page.content.decode())


def test_wrong_passwords_for_one_user_pause_its_sign_in_even_for_the_right_one(client, limits, admin):
    # given three wrong passwords for the admin
    wrong = [sign_in(client, admin.username, f"guess-{n}") for n in range(3)]
    assert [r.status_code for r in wrong] == [200, 200, 200]
    assert all("didn't match" in r.content.decode() for r in wrong)
    # when the right one comes next
    response = sign_in(client, admin.username, PASSWORD)
    # then it is refused without checking it: a 429 that says why and for how long
    assert response.status_code == 429
    assert 1 <= int(response["Retry-After"]) <= 60
    assert "Too many failed sign-ins" in response.content.decode()
    assert not signed_in(client)


def test_sign_in_works_again_when_the_window_ends(client, limits, admin):
    limits.SLUICE_LOGIN_FAILURE_WINDOW_S = 2
    for n in range(3):
        sign_in(client, admin.username, f"guess-{n}")
    assert sign_in(client, admin.username, PASSWORD).status_code == 429
    deadline = time.monotonic() + 5
    while (response := sign_in(client, admin.username, PASSWORD)).status_code == 429:
        assert time.monotonic() < deadline, "still refused after the window"
        time.sleep(0.1)
    assert response.status_code == 302 and signed_in(client)


def test_a_good_sign_in_does_not_count_as_a_failure(client, limits, admin):
    # given two failures and then the right password
    sign_in(client, admin.username, "guess-1")
    sign_in(client, admin.username, "guess-2")
    assert sign_in(client, admin.username, PASSWORD).status_code == 302
    client.logout()
    # then one more failure is allowed before the pause, not zero
    assert sign_in(client, admin.username, "guess-3").status_code == 200
    assert sign_in(client, admin.username, "guess-4").status_code == 429


def test_one_address_guessing_many_users_is_paused(client, limits, admin):
    limits.SLUICE_LOGIN_FAILURES_PER_USER = 100
    limits.SLUICE_LOGIN_FAILURES_PER_ADDRESS = 4
    assert [sign_in(client, f"nobody-{n}", "x").status_code for n in range(4)] == [200] * 4
    assert sign_in(client, admin.username, PASSWORD).status_code == 429
    # from another address the admin signs in
    other = Client(REMOTE_ADDR="198.51.100.20")
    assert sign_in(other, admin.username, PASSWORD).status_code == 302


def test_other_spellings_of_a_username_share_its_budget(client, limits, admin):
    # The login form NFKC-normalizes: fullwidth "ａｄｍｉｎ" signs in as "admin".
    fullwidth = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in admin.username)
    for n in range(3):
        assert sign_in(client, fullwidth, f"guess-{n}").status_code == 200
    assert sign_in(client, admin.username, PASSWORD).status_code == 429


def test_django_admins_login_is_throttled_too(client, limits, admin):
    for n in range(3):
        assert sign_in(client, admin.username, f"guess-{n}", path="/admin/login/").status_code == 200
    response = sign_in(client, admin.username, PASSWORD, path="/admin/login/")
    assert response.status_code == 429
    assert not signed_in(client)


def test_a_signed_in_member_guessing_the_admins_password_is_counted(client, limits, admin):
    member = make_user(f"member-{time.monotonic_ns()}")
    client.force_login(member)
    # admin's login page takes a POST from a signed-in non-staff user
    for n in range(3):
        assert sign_in(client, admin.username, f"guess-{n}", path="/admin/login/").status_code == 200
    assert sign_in(client, admin.username, PASSWORD, path="/admin/login/").status_code == 429


def test_the_api_token_endpoint_is_throttled_with_the_same_budget(limits, admin):
    api = Client()
    for n in range(2):
        assert api.post("/api/auth/token/", {"username": admin.username, "password": f"guess-{n}"}).status_code == 400
    # a third failure through the login page uses up the same user's budget
    sign_in(Client(), admin.username, "guess-2")
    response = api.post("/api/auth/token/", {"username": admin.username, "password": PASSWORD})
    assert response.status_code == 429
    assert response.json()["detail"].startswith("Too many failed sign-ins")
    assert 1 <= int(response["Retry-After"]) <= 60


def test_a_token_from_the_right_password_does_not_count(limits, admin):
    api = Client()
    for _ in range(5):
        response = api.post("/api/auth/token/", {"username": admin.username, "password": PASSWORD})
        assert response.status_code == 200 and response.json()["token"]


def test_concurrent_guesses_for_one_user_pass_the_limit_exactly(limits, redis_client):
    limits.SLUICE_LOGIN_FAILURES_PER_USER = 5
    barrier = threading.Barrier(50)
    allowed = []
    lock = threading.Lock()

    def guess(n: int):
        barrier.wait()
        attempt = login_attempt_take(username="victim", address=f"198.51.100.{n}")
        with lock:
            allowed.append(attempt.allowed)

    # when 50 addresses guess one user's password at the same moment
    threads = [threading.Thread(target=guess, args=(n,)) for n in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # then exactly 5 got to try
    assert sorted(allowed) == [False] * 45 + [True] * 5
    assert redis_client.get(login_user_budget().counter_key("victim")) == "5"


def test_an_address_over_its_limit_gives_back_the_users_attempt(limits, redis_client):
    limits.SLUICE_LOGIN_FAILURES_PER_ADDRESS = 2
    assert [login_attempt_take(username=f"u{n}", address="203.0.113.1").allowed for n in range(4)] == \
        [True, True, False, False]
    # the refused attempts left no mark on their users' budgets
    assert [redis_client.get(login_user_budget().counter_key(f"u{n}")) for n in range(4)] == ["1", "1", "0", "0"]
    assert redis_client.get(login_address_budget().counter_key("203.0.113.1")) == "2"


def test_with_redis_away_sign_in_is_a_503_not_an_unthrottled_guess(client, limits, admin, settings):
    original = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    reset_clients()
    try:
        response = sign_in(client, admin.username, PASSWORD)
    finally:
        settings.REDIS_URL = original
        reset_clients()
    assert response.status_code == 503
    assert not signed_in(client)
