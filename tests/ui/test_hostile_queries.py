"""The pages' query parameters under hostile input: a custom range at the
calendar's end is a 400 that says why (the bounds are checked before any
day is added), a paging cursor with a non-ASCII digit is ignored (the page
starts at the top), and a property-based run over every page's parameters
finds no answer >= 500, as a platform admin and as a tenant member."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from budgets.selectors.request_log import Cursor
from budgets.web.ranges import RangeError, time_range_from

pytestmark = pytest.mark.django_db

RANGE_REFUSED = "Choose times between 2000 and 2100."
NOW = datetime(2026, 12, 5, 12, 0, tzinfo=dt_timezone.utc)


@pytest.mark.parametrize("params", [
    {"range": "custom", "from": "2026-01-01", "to": "9999-12-31"},
    {"range": "custom", "from": "9999-12-30", "to": "9999-12-31"},
    {"range": "custom", "from": "9999-12-31T23:59"},
    {"range": "custom", "from": "0001-01-01", "to": "0001-01-02"},
    {"range": "custom", "from": "2100-12-30", "to": "2100-12-31"},  # the day after is 2101
])
def test_a_range_past_the_bounds_is_refused_before_any_arithmetic(params):
    with pytest.raises(RangeError, match=RANGE_REFUSED):
        time_range_from(params, now=NOW)


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


# -- property-based: every page's query parameters -----------------------------------

EXAMPLES_PER_PAGE = 20
NUMERIC_JUNK = ["\u00b2", "\u2460", "\u0661\u0662", "\uff11\uff12", "+1", "-1", "1_0", " 7", "1e3", "0x1f", "NaN", "inf",
                "9" * 30, "-" + "9" * 30, "00"]
CHOICES = ["1h", "24h", "7d", "30d", "this_month", "last_month", "last_7_days", "this_year", "last_hour", "last_24_hours",
           "tenant", "cost_center", "workload", "model", "pool", "day", "month", "ok", "error", "rejected",
           "pending", "approved", "queued", "interactive", "workload_tpm", "sim-small", "__class__", "<x>"]
junk_text = st.one_of(st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
                      st.binary(max_size=12))  # sent percent-encoded: not always UTF-8
# Days and minutes over the whole calendar, as a page's form takes them (a
# day, or a day and a time), its ends a third of the time: arithmetic near
# them overflows.
EDGE_TIMES = ["9999-12-31", "9999-12-31T23:59", "0001-01-01", "0001-01-01T00:00", "2100-12-31", "2101-01-01",
              "1999-12-31T23:59", "2026-02-30"]
calendar_day = st.dates()
date_value = st.one_of(
    st.sampled_from(EDGE_TIMES),
    st.one_of(calendar_day.map(lambda day: f"{day.year:04d}-{day.month:02d}-{day.day:02d}"),
              st.tuples(calendar_day, st.integers(0, 24), st.integers(0, 60)).map(
                  lambda t: f"{t[0].year:04d}-{t[0].month:02d}-{t[0].day:02d}T{t[1]:02d}:{t[2]:02d}")),
    st.one_of(st.sampled_from(["\u0662\u0660\u0662\u0666-01-01", "2026-1-1", ""]), junk_text))
number_value = st.one_of(st.sampled_from(NUMERIC_JUNK), st.integers(-(2**70), 2**70).map(str), junk_text)
# Digits of any script: str.isdigit() is true for some that int() refuses.
digits_or_junk = st.one_of(st.integers(0, 2**64).map(str), st.sampled_from(["\u00b2", "\u2460", "\u00b9"]),
                           st.sampled_from(NUMERIC_JUNK))
cursor_value = st.one_of(
    st.builds(lambda micros, kind, tiebreak: f"{micros}.{kind}.{tiebreak}", digits_or_junk,
              st.sampled_from(["1", "0", "\u00b9"]), digits_or_junk),
    st.one_of(st.uuids().map(str), junk_text))
BY_NAME = {"from": date_value, "to": date_value, "start": date_value, "end": date_value, "after": cursor_value,
           "limit": number_value, "range": st.one_of(st.just("custom"), st.one_of(st.sampled_from(CHOICES), junk_text))}


def _query(params: dict[str, str | bytes]) -> str:
    return "&".join(f"{quote(name)}={quote(value, safe='')}" for name, value in params.items() if value != "")


def _page_parameters(world) -> dict[str, list[str]]:
    a, times = world.tenant_a.slug, ["range", "from", "to"]
    log = [*times, "workload", "key", "status", "reason", "lane", "model", "after"]
    finance = ["period", "start", "end", "tenant", "cost_center", "workload", "model", "group_by"]
    return {
        "/": ["range"], "/t/": ["range"], f"/t/{a}/": times, f"/t/{a}/log/": log, "/log/": log,
        f"/t/{a}/alerts": times, f"/t/{a}/requests/new": ["workload"], f"/ops/pools/{world.pool.slug}/": times,
        "/ops/pools/": times, "/ops/requests/": ["status"], "/finance/": finance, "/finance/ledger.csv": finance,
        f"/t/{a}/workloads/{world.wl_a.slug}/jobs": ["status", "after", "limit"],
        f"/t/{a}/workloads/{world.wl_a.slug}/batches": ["status", "after", "limit"],
    }


def test_no_page_answers_5xx_to_any_query(client, world):
    # Known values a page can act on, beside the junk: the world's own ids and slugs.
    known = {"workload": [str(world.wl_a.id), world.wl_a.slug], "key": [str(world.wl_a.api_keys.get().id)],
             "tenant": [world.tenant_a.slug], "cost_center": [world.tenant_a.cost_center]}
    failures: list[str] = []
    for user in (world.admin, world.member_a):
        client.force_login(user)
        for page, names in _page_parameters(world).items():
            values = {name: st.one_of(BY_NAME.get(name, st.one_of(st.sampled_from(CHOICES), number_value)),
                                      st.sampled_from(known.get(name, [""])))
                      for name in names}

            @hypothesis_settings(max_examples=EXAMPLES_PER_PAGE, deadline=None, database=None, derandomize=True,
                                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(params=st.fixed_dictionaries(values))
            def run(params):
                query = _query(params)
                try:
                    status = client.get(f"{page}?{query}").status_code
                except Exception as exc:  # what the test client re-raises is a 500 to a real browser
                    status = f"500 ({type(exc).__name__}: {exc})"
                if not isinstance(status, int) or status >= 500:
                    failures.append(f"{user.username} GET {page}?{query} -> {status}")

            run()
    assert failures == []
