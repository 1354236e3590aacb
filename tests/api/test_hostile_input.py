"""Hostile input on the management API (/api/*) and the pages' query
parameters: the same depth, size and number guards as /v1
(gateway/core/request/chat.py parse_json_body, SLUICE_MAX_BODY_BYTES), in
DRF's shape, authenticated or not; custom ranges at the calendar's end and
paging cursors with non-ASCII digits are a 400 or ignored, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest
from django.conf import settings
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
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


# -- property-based: hostile JSON to every management API endpoint --------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                      st.text(st.characters(exclude_categories=["Cs"]), max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                          max_leaves=12)
NUMBER_LITERALS = [b"1e999", b"-1e999", b"NaN", b"Infinity", b"-" + b"9" * 5000, b"9" * 30, b"1" + b"0" * 400 + b".5"]


@st.composite
def hostile_bodies(draw) -> bytes:
    """A JSON object with one value swapped for something /v1 refuses:
    nesting past 64 levels, a number past int64 or float, a NUL or a lone
    surrogate (as a JSON escape), or not an object at all."""
    base = draw(st.dictionaries(st.sampled_from(["username", "password", "pool", "reserved_tpm", "ceiling_tpm", "rpm",
                                                 "justification", "name", "comment", "workload_id", "expires_at"]),
                                json_value, min_size=1, max_size=4))
    name = draw(st.sampled_from(sorted(base)))
    depth = draw(st.integers(65, 20_000))
    opener = draw(st.sampled_from([b"[", b'{"a": ']))
    closer = b"]" if opener == b"[" else b"}"
    hostile = draw(st.sampled_from([
        opener * depth + b"1" + closer * depth, *NUMBER_LITERALS, b'"a\\u0000b"', b'"\\ud800"', b"[" * depth,
    ]))
    body = json.dumps({**base, name: "__HOSTILE__"}).encode().replace(b'"__HOSTILE__"', hostile)
    return draw(st.sampled_from([body, hostile]))


def test_no_management_api_endpoint_answers_5xx_to_hostile_json(world):
    a = world.tenant_a.slug
    targets = [("post", "/api/auth/token/"), ("post", "/api/budget-requests/"), ("post", f"/api/tenants/{a}/keys/"),
               ("post", "/api/budget-requests/999999/approve/"), ("post", "/api/budget-requests/999999/reject/"),
               ("post", f"/api/tenants/{a}/callback-secret/rotate/"), ("patch", f"/api/tenants/{a}/workloads/{world.wl_a.id}/"),
               ("put", f"/api/tenants/{a}/workloads/{world.wl_a.id}/"), ("post", "/api/spend-budgets/"),
               ("patch", f"/api/tenants/{a}/")]
    clients = {"anonymous": APIClient(), "admin": _token_client(world.admin), "member": _token_client(world.member_a)}
    failures: list[str] = []

    @hypothesis_settings(max_examples=60, deadline=None, database=None, derandomize=True,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(who=st.sampled_from(sorted(clients)), target=st.sampled_from(targets), body=hostile_bodies())
    def run(who, target, body):
        method, url = target
        try:
            status = getattr(clients[who], method)(url, body, content_type="application/json").status_code
        except Exception as exc:  # what the test client re-raises is a 500 to a real caller
            status = f"500 ({type(exc).__name__})"
        if not isinstance(status, int) or status >= 500:
            failures.append(f"{who} {method.upper()} {url} {body[:80]!r} -> {status}")

    run()
    assert failures == []
