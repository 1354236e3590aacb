"""Hostile input on the management API (/api/*) and the pages' query
parameters: the same depth, size and number guards as /v1
(gateway/core/request/chat.py parse_json_body, SLUICE_MAX_BODY_BYTES), in
DRF's shape, authenticated or not; custom ranges at the calendar's end and
paging cursors with non-ASCII digits are a 400 or ignored, never a 500."""

from __future__ import annotations

import httpx
import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

DEPTH = 50_000
DEEP_ARRAY = b"[" * DEPTH + b"]" * DEPTH
DEEP_OBJECT = b'{"username": ' + b'{"a": ' * DEPTH + b"1" + b"}" * DEPTH + b"}"
TOO_DEEP = {"detail": "The request body nests arrays/objects deeper than 64 levels.", "code": "invalid_json"}


def _token_client(user) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return api


@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_OBJECT], ids=["array", "object"])
def test_deep_json_to_the_token_endpoint_is_a_400_without_signing_in(body):
    response = APIClient().post("/api/auth/token/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == TOO_DEEP


@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_OBJECT], ids=["array", "object"])
def test_deep_json_to_budget_requests_is_a_400_for_a_member(world, body):
    response = _token_client(world.member_a).post("/api/budget-requests/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == TOO_DEEP


def test_deep_json_without_credentials_is_a_401_not_a_500():
    response = APIClient().post("/api/budget-requests/", DEEP_ARRAY, content_type="application/json")
    assert response.status_code == 401


def test_json_64_levels_deep_is_still_parsed(world):
    # 64 levels are allowed (as on /v1): the serializer then refuses the value itself
    body = b'{"justification": ' + b"[" * 63 + b"]" * 63 + b"}"
    response = _token_client(world.member_a).post("/api/budget-requests/", body, content_type="application/json")
    assert response.status_code == 400
    assert "justification" in response.json()


@pytest.mark.parametrize("body,detail,code", [
    (b'{"username": 1e999, "password": "x"}',
     "The request body is not acceptable JSON: the number 1e999 is out of range.", "invalid_json"),
    (b'{"username": NaN, "password": "x"}',
     "The request body is not acceptable JSON: NaN is not a JSON number.", "invalid_json"),
    (b'{"username": ' + b"9" * 5000 + b', "password": "x"}',
     "The request body is not acceptable JSON: the integer 99999999999999999999... is out of range "
     "(at most 9223372036854775807 in magnitude).", "invalid_json"),
    (b'{"username": "a\\u0000b", "password": "x"}',
     "'username' holds a NUL character (\\u0000), which no pool request or database row can carry.",
     "invalid_string"),
    (b"[1, 2]", "The request body must be a JSON object.", "invalid_json"),
])
def test_numbers_and_strings_json_cannot_carry_are_a_400(body, detail, code):
    response = APIClient().post("/api/auth/token/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {"detail": detail, "code": code}


def test_a_body_over_the_size_limit_is_a_413(settings, world):
    settings.SLUICE_MAX_BODY_BYTES = 1_000
    body = b'{"justification": "' + b"x" * 1_000 + b'"}'
    for api, url in ((APIClient(), "/api/auth/token/"), (_token_client(world.member_a), "/api/budget-requests/")):
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 413
        assert response.json() == {"detail": "The request body exceeds 1000 bytes.", "code": "body_too_large"}


@pytest.mark.django_db(transaction=True)
def test_the_server_refuses_an_oversized_or_deep_management_body_before_django(platform):
    limit = settings.SLUICE_MAX_BODY_BYTES
    with httpx.Client(timeout=30) as client:
        # a body over the limit, declared or streamed without a length
        declared = client.post(f"{platform.base_url}/api/auth/token/", content=b"{" + b" " * limit + b"}",
                               headers={"Content-Type": "application/json"})
        streamed = client.post(f"{platform.base_url}/api/budget-requests/",
                               content=iter([b"{" + b" " * limit, b"}"]), headers={"Content-Type": "application/json"})
        deep = client.post(f"{platform.base_url}/api/auth/token/", content=DEEP_ARRAY,
                           headers={"Content-Type": "application/json"})
    too_large = {"detail": f"The request body exceeds {limit} bytes.", "code": "body_too_large"}
    assert (declared.status_code, declared.json()) == (413, too_large)
    assert (streamed.status_code, streamed.json()) == (413, too_large)
    assert (deep.status_code, deep.json()) == (400, TOO_DEEP)
