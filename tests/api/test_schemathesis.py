"""Property-based fuzzing of the management API from its own OpenAPI schema
(/api/schema/): schemathesis generates valid and invalid requests for every
operation, sent as a platform admin and as a tenant member, with random path
parameters and with ones that name real objects (so what lies behind "does
it exist" runs too). No answer may be a 5xx.

Sized for CI: a bounded number of examples per operation, no example
database, derandomized (the same cases every run), well under two minutes.
Requests go to Django's WSGI handler in-process, inside the test's
transaction."""

from __future__ import annotations

import re
from datetime import date, timedelta

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode

from budgets.services.budget_requests import budget_request_submit

pytestmark = pytest.mark.django_db

POSITIVE_EXAMPLES = 10
NEGATIVE_EXAMPLES = 5
# Any day of the calendar, its ends included: date arithmetic near them overflows.
ANY_DAY = st.one_of(st.sampled_from([date.min, date.max, date(1999, 12, 31), date(2101, 1, 1)]), st.dates())


@pytest.fixture
def wsgi_app(settings):
    """Django's WSGI handler, kept from closing the test's connection at the
    end of each request (what Django's own test client does). Unknown users
    still cost one password hash each (Django's timing defence): a fast
    hasher first keeps /api/auth/token/ from dominating the run."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *settings.PASSWORD_HASHERS]
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield WSGIHandler()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def _with_valid_day_ranges(strategy):
    """Half the cases get a start..end range that validation's ordering and
    400-day cap let through, drawn from the whole calendar: two independent
    random dates almost never pass those checks, and then nothing behind
    them would be fuzzed."""

    def apply(drawn):
        case, start, span, keep = drawn
        if not keep:
            end = date.max if (date.max - start).days < span else start + timedelta(days=span)
            case.query["start"], case.query["end"] = start.isoformat(), end.isoformat()
        return case

    return st.tuples(strategy, ANY_DAY, st.integers(0, 400), st.booleans()).map(apply)


def _fuzz(schema, *, token: str, known: dict[str, object]) -> list[str]:
    """Run every operation; returns the 5xx answers found (empty: none)."""
    failures: list[str] = []
    headers = {"Authorization": f"Token {token}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    for operation in operations:
        names = re.findall(r"{(\w+)}", operation.path)
        variants = [None]
        if names:
            variants.append({name: known[f"pool_{name}" if operation.path.startswith("/api/pools/") else name]
                             for name in names})
        query_names = {parameter.name for parameter in operation.query}
        runs = [(GenerationMode.POSITIVE, POSITIVE_EXAMPLES)]
        if query_names or operation.body:
            # Invalid queries and bodies; with neither there is nothing
            # but the path to spoil, and random paths run above.
            runs.append((GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES))
        for path_parameters in variants:
            for mode, examples in runs:
                strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
                if mode is GenerationMode.POSITIVE and {"start", "end"} <= query_names:
                    strategy = _with_valid_day_ranges(strategy)

                @hypothesis_settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                     phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case):
                    try:
                        status = case.call(headers=headers).status_code
                    except Exception as exc:  # an exception the handler let escape: a 500 to a real client
                        status = f"500 ({type(exc).__name__}: {exc})"
                    if not isinstance(status, int) or status >= 500:
                        failures.append(f"{operation.label} -> {status}: {case.as_curl_command(headers=headers)}")

                try:
                    run()
                except Unsatisfiable:
                    # Nothing in this operation can be made invalid.
                    assert mode is GenerationMode.NEGATIVE, operation.label
    return failures


def test_no_management_api_operation_answers_5xx_to_admin_or_member(world, wsgi_app):
    # given an admin and a member with API tokens, and a budget request to act on
    pending = budget_request_submit(
        tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a, new_workload_name="",
        new_workload_class="", reserved_tpm=1_000, ceiling_tpm=2_000, rpm=10, lend_fraction=0.0,
        justification="fuzzing", ends_on=None, monthly_spend_budget=None, spend_soft_threshold=0.8,
        spend_hard_cap=False,
    )
    admin_token = Token.objects.create(user=world.admin).key
    member_token = Token.objects.create(user=world.member_a).key
    # The management API only: the schema also documents /v1 (bearer API keys,
    # fuzzed at the door by tests/gateway/test_hostile_input.py and friends).
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app,
                                            headers={"Authorization": f"Token {admin_token}"}).include(
                                                path_regex=r"^/api/")
    known = {"slug": world.tenant_a.slug, "pool_slug": world.pool.slug, "workload_id": world.wl_a.id,
             "key_id": world.wl_a.api_keys.get().id, "request_id": pending.pk}
    # when schemathesis runs every operation as each of them
    failures = []
    for token in (admin_token, member_token):
        failures += _fuzz(schema, token=token, known=known)
    # then nothing answered a server error
    assert failures == []
