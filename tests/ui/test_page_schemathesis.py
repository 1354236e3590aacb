"""Schemathesis over the pages' query parameters: the UI has no OpenAPI
document of its own, so this test writes one (every page that reads its
query string, each parameter as what the page's form takes, or any string)
and lets schemathesis generate the cases, sent to Django's WSGI handler
with a platform admin's and a tenant member's session. No answer may be a
5xx. Sized for CI like tests/api/test_schemathesis.py: derandomized, a few
examples per page."""

from __future__ import annotations

import pytest
import schemathesis
from django.conf import settings
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.api.test_schemathesis import wsgi_app  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db

EXAMPLES = 6
ANY = {"type": "string"}
# A day, a day and a time (what the range and finance forms take), or anything.
TIME = {"anyOf": [{"type": "string", "format": "date"},
                  {"type": "string", "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"}, ANY]}
NUMBER = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9\u00b2\u2460\u0660-\u0669]{1,20}$"}, ANY]}
CURSOR = {"anyOf": [{"type": "string", "pattern": r"^[0-9]{1,20}\.[01]\.[0-9\u00b2\u2460]{1,6}$"}, ANY]}
RANGE = {"anyOf": [{"enum": ["custom", "1h", "24h", "7d", "30d"]}, ANY]}


# The document's examples (run first, one case per page) are the inputs
# that once were 500s: a range ending on the calendar's last day, a cursor
# and numbers holding digits int() refuses.
EXAMPLES_BY_NAME = {"range": "custom", "from": "2026-01-01", "to": "9999-12-31", "start": "2026-01-01",
                    "end": "9999-12-31", "after": "1764936000000000.1.\u00b2", "workload": "\u2460", "key": "\u00b2",
                    "limit": "\u2460"}


def _param(name: str, schema: dict, *, example: bool = True) -> dict:
    parameter = {"name": name, "in": "query", "required": False, "schema": schema}
    if example and name in EXAMPLES_BY_NAME:
        parameter["example"] = EXAMPLES_BY_NAME[name]
    return parameter


def pages_document(world) -> dict:
    a = world.tenant_a.slug
    times = [_param("range", RANGE), _param("from", TIME), _param("to", TIME)]
    # The log's example is a valid range and filters (so it reaches the cursor) and the cursor.
    log = [_param("range", RANGE), _param("from", TIME), _param("to", TIME, example=False),
           _param("workload", NUMBER, example=False), _param("key", NUMBER, example=False), _param("status", ANY),
           _param("reason", ANY), _param("lane", ANY), _param("model", ANY), _param("after", CURSOR)]
    finance = [_param("period", ANY), _param("start", TIME), _param("end", TIME), _param("tenant", ANY),
               _param("cost_center", ANY), _param("workload", ANY), _param("model", ANY), _param("group_by", ANY)]
    pages = {
        f"/t/{a}/": times, f"/t/{a}/log/": log, "/log/": log, f"/t/{a}/alerts": times,
        f"/t/{a}/requests/new": [_param("workload", NUMBER)], f"/ops/pools/{world.pool.slug}/": times,
        "/ops/requests/": [_param("status", ANY)], "/finance/": finance, "/finance/ledger.csv": finance,
        f"/t/{a}/workloads/{world.wl_a.slug}/jobs": [_param("status", ANY), _param("after", ANY), _param("limit", NUMBER)],
        f"/t/{a}/workloads/{world.wl_a.slug}/batches": [_param("status", ANY), _param("after", ANY),
                                                         _param("limit", NUMBER)],
    }
    return {
        "openapi": "3.0.3", "info": {"title": "Sluice pages (for fuzzing)", "version": "1"},
        "paths": {path: {"get": {"parameters": parameters, "responses": {"200": {"description": "the page"}}}}
                  for path, parameters in pages.items()},
    }


def test_no_page_answers_5xx_to_schemathesis_queries(client, world, wsgi_app):  # noqa: F811
    schema = schemathesis.openapi.from_dict(pages_document(world))
    schema.app = wsgi_app
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 11
    failures: list[str] = []
    answered: dict[int, int] = {}  # status -> how many
    for user in (world.admin, world.member_a):
        client.force_login(user)
        session = {settings.SESSION_COOKIE_NAME: client.cookies[settings.SESSION_COOKIE_NAME].value}
        for operation in operations:
            strategies = [*operation.get_strategies_from_examples(),
                          operation.as_strategy(generation_mode=GenerationMode.POSITIVE)]

            @hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=st.one_of(strategies))
            def run(case):
                try:
                    status = case.call(cookies=session).status_code
                except Exception as exc:  # an exception the handler let escape: a 500 to a real browser
                    status = f"500 ({type(exc).__name__}: {exc})"
                if not isinstance(status, int) or status >= 500:
                    failures.append(f"{user.username} {operation.label} -> {status}: {case.query}")
                else:
                    answered[status] = answered.get(status, 0) + 1

            run()
    assert failures == []
    # the sessions held: pages were rendered (200) and refused for what they were sent (400), not redirected to sign in
    assert answered.get(200, 0) > 0 and answered.get(400, 0) > 0 and 302 not in answered, answered
