"""Finance drill-down: tenant -> workload -> model -> the filtered request
log, each a link over the page's exact range; the export repeats the range
the page shows (a preset is not evaluated again at a later "now"); one
period on the page; costs summed as exact Decimals; the cross-tenant log
names tenants by slug and filters by tenant."""

from __future__ import annotations

import csv
import html
import io
import re
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal
from urllib.parse import parse_qs, urlsplit

import pytest
from django.utils import timezone

from budgets.models import UsageRecord
from budgets.selectors.usage import UsageRow, cost_exact
from tests.people import ledger_add

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 10, tzinfo=dt_timezone.utc)


def _body(response) -> str:
    assert response.status_code == 200, response.content.decode()[:500]
    return response.content.decode()


def _links(body: str) -> dict[str, str]:
    """Each spend-table row's label -> its drill-down href."""
    table = body.split('id="spend-table"')[1].split("</table>")[0]
    return {label: html.unescape(href) for href, label in re.findall(r'<a href="([^"]+)" class="drill">([^<]+)</a>', table)}


def _log_ids(body: str) -> set[str]:
    table = body.split('id="request-log"')[1].split("</table>")[0]
    return set(re.findall(r'data-request-id="([^"]+)"', table))


def test_tenant_to_workload_to_model_to_the_request_log(login, world):
    # given two tenants' traffic on two models in one custom range, and a row outside it
    at = DAY + timedelta(hours=10)
    a_small = [ledger_add(workload=world.wl_a, pool=world.pool, at=at + timedelta(minutes=i)) for i in range(3)]
    a_large = ledger_add(workload=world.wl_a, pool=world.pool, at=at + timedelta(minutes=5), model="sim-large")
    ledger_add(workload=world.wl_b, pool=world.pool, at=at + timedelta(minutes=6))
    ledger_add(workload=world.wl_a, pool=world.pool, at=at + timedelta(hours=3))  # after the range
    client = login(world.finance)
    query = "start=2026-11-10T10:00&end=2026-11-10T12:00&group_by=tenant"

    # when finance follows the links from the tenant row down
    tenants = _links(_body(client.get(f"/finance/?{query}")))
    assert set(tenants) == {world.tenant_a.slug, world.tenant_b.slug}
    assert parse_qs(urlsplit(tenants[world.tenant_a.slug]).query) == {
        "start": ["2026-11-10T10:00"], "end": ["2026-11-10T12:00"], "tenant": [world.tenant_a.slug],
        "group_by": ["workload"]}
    workloads = _links(_body(client.get(f"/finance/{tenants[world.tenant_a.slug]}")))
    assert list(workloads) == [world.wl_a.slug]
    models_body = _body(client.get(f"/finance/{workloads[world.wl_a.slug]}"))
    models = _links(models_body)
    assert set(models) == {"sim-small", "sim-large"}
    assert re.search(r'id="total-requests" data-value="(\d+)"', models_body).group(1) == "4"

    # then the model row opens the request log over the same range, tenant, workload and model
    log_href = models["sim-small"]
    assert urlsplit(log_href).path == "/log/"
    assert parse_qs(urlsplit(log_href).query) == {
        "range": ["custom"], "from": ["2026-11-10T10:00"], "to": ["2026-11-10T12:00"],
        "tenant": [world.tenant_a.slug], "workload": [str(world.wl_a.id)], "model": ["sim-small"]}
    assert _log_ids(_body(client.get(log_href))) == set(a_small)
    assert _log_ids(_body(client.get(models["sim-large"]))) == {a_large}


def _shown_time(text: str) -> datetime:
    fmt = "%Y-%m-%d %H:%M:%S" if text.count(":") == 2 else "%Y-%m-%d %H:%M"
    return datetime.strptime(text, fmt).replace(tzinfo=dt_timezone.utc)


def test_a_preset_range_exports_the_exact_range_the_page_shows(login, world):
    # given rows inside the last hour, and one just before it
    now = timezone.now()
    inside = [ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=m)) for m in (1, 30)]
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=61))
    client = login(world.finance)
    body = _body(client.get("/finance/?period=last_hour&group_by=workload"))
    shown = re.search(r'id="finance-range">(\S+ \S+) — (\S+ \S+) UTC', body)
    start_at, end_at = _shown_time(shown.group(1)), _shown_time(shown.group(2))
    assert end_at - start_at == timedelta(hours=1) and end_at <= timezone.now()
    assert re.search(r'id="total-requests" data-value="(\d+)"', body).group(1) == "2"
    export_href = html.unescape(re.search(r'id="export-csv" href="([^"]+)"', body).group(1))

    # when traffic goes on after the page was drawn
    ledger_add(workload=world.wl_a, pool=world.pool, at=end_at)
    ledger_add(workload=world.wl_a, pool=world.pool, at=timezone.now())

    # then the export names the shown range, not the preset, and holds exactly the page's rows
    fmt = "%Y-%m-%dT%H:%M:%S" if start_at.second or end_at.second else "%Y-%m-%dT%H:%M"
    assert parse_qs(urlsplit(export_href).query) == {
        "start": [start_at.strftime(fmt)], "end": [end_at.strftime(fmt)], "group_by": ["workload"]}
    rows = list(csv.DictReader(io.StringIO(b"".join(client.get(export_href).streaming_content).decode())))
    assert sorted(r["request_id"] for r in rows) == sorted(inside)


def test_explicit_dates_make_the_period_custom(login, world):
    client = login(world.finance)
    body = _body(client.get("/finance/?period=this_month&start=2026-11-10&end=2026-11-12"))
    select = body.split('name="period"')[1].split("</select>")[0]
    assert re.findall(r'<option value="([^"]*)" selected>', select) == [""]
    assert "2026-11-10 — 2026-11-12 (UTC days)" in body
    body = _body(client.get("/finance/?period=this_month"))
    select = body.split('name="period"')[1].split("</select>")[0]
    assert re.findall(r'<option value="([^"]*)" selected>', select) == ["this_month"]


def test_costs_add_up_as_exact_decimals(login, world):
    # a float sum (what SQLite hands back) is snapped to the ledger's 8 places
    row = UsageRow(key={})
    row.add({"cost": 0.1 + 0.0200679})
    row.add({"cost": Decimal("0.00000001")})
    assert row.cost == Decimal("0.12006791")
    assert str(cost_exact(0.1200679000000001)) == "0.12006790"
    # and the page's total is the ledger's exact sum
    for minutes in range(7):
        ledger_add(workload=world.wl_a, pool=world.pool, at=DAY + timedelta(minutes=minutes), input_tokens=333 + minutes,
                   output_tokens=77)
    expected = sum(UsageRecord.objects.values_list("cost", flat=True), Decimal(0))
    body = _body(login(world.finance).get("/finance/?start=2026-11-10&end=2026-11-10"))
    assert Decimal(re.search(r'id="total-cost" data-value="([\d.]+)"', body).group(1)) == expected


def test_the_cross_tenant_log_names_tenants_by_slug_and_filters_by_tenant(login, world):
    a = ledger_add(workload=world.wl_a, pool=world.pool, at=DAY)
    b = ledger_add(workload=world.wl_b, pool=world.pool, at=DAY)
    client = login(world.finance)
    window = "range=custom&from=2026-11-09T00:00&to=2026-11-11T00:00"
    body = _body(client.get(f"/log/?{window}"))
    assert _log_ids(body) == {a, b}
    tenant_cells = re.findall(r'<td class="tenant">([^<]*)</td>', body)
    assert sorted(tenant_cells) == sorted([world.tenant_a.slug, world.tenant_b.slug])
    assert _log_ids(_body(client.get(f"/log/?{window}&tenant={world.tenant_b.slug}"))) == {b}
    assert client.get(f"/log/?{window}&tenant=no-such-tenant").status_code == 400
    # a member's own log offers no tenant filter, and naming another tenant changes nothing
    member = login(world.member_a)
    own = _body(member.get(f"/t/{world.tenant_a.slug}/log/?{window}&tenant={world.tenant_b.slug}"))
    assert _log_ids(own) == {a}
    assert 'name="tenant"' not in own
