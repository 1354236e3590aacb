"""Waits are shown as people read them ("26 d 16 h", not "2304170.0s"):
the Retry-After of a spend cap refused near a month's start is weeks."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from budgets.models import RejectionSample
from budgets.web.templatetags.sluice_ui import human_duration, seconds


@pytest.mark.parametrize("value, shown", [
    (0.4, "0.4 s"), (1, "1 s"), (2.5, "2.5 s"), (9.96, "10 s"), (12, "12 s"), (60, "1 min"), (303, "5 min 3 s"),
    (3600, "1 h"), (3660, "1 h 1 min"), (7322, "2 h 2 min"), (86_400, "1 d"), (90_061, "1 d 1 h"),
    (2_304_170, "26 d 16 h"),
])
def test_human_duration(value, shown):
    assert human_duration(value) == shown


def test_the_seconds_filter_reads_milliseconds():
    assert (seconds(2_304_170_000), seconds(1500), seconds(None), seconds("")) == ("26 d 16 h", "1.5 s", "—", "—")


@pytest.mark.django_db
def test_a_spend_cap_refusal_shows_its_wait_humanly(login, world):
    RejectionSample.objects.create(sample_id="rej_spendcap", at=timezone.now() - timedelta(minutes=1),
                                   tenant=world.tenant_a, workload=world.wl_a, pool=world.pool, reason="spend_budget",
                                   estimated_tokens=464, retry_after_ms=2_304_170_000)
    client = login(world.member_a)
    log = client.get(f"/t/{world.tenant_a.slug}/log/?range=1h").content.decode()
    assert re.search(r'spend_budget</span> · retry after 26 d 16 h</td>', log)
    assert "2304170" not in log
    page = client.get(f"/t/{world.tenant_a.slug}/").content.decode()
    assert '<td class="num">26 d 16 h</td>' in page
    refusal = client.get(f"/t/{world.tenant_a.slug}/log/rej_spendcap/").content.decode()
    assert 'id="refusal-retry-after">26 d 16 h (header: 2304170 s, 2,304,170,000 ms)<' in refusal


@pytest.mark.django_db
def test_a_refusal_weeks_long_is_flushed_to_the_database(world, redis_client):
    import time

    from budgets.ledger.rejections import rejection_count, rejections_flush

    # a hard spend cap refused on a month's fourth day: retry in 26 days, past a 32-bit column of milliseconds
    rejection_count(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                    reason="spend_budget", estimated_tokens=464, retry_after_ms=2_304_170_000)
    assert rejections_flush(now_s=time.time() + 3600).samples == 1
    assert RejectionSample.objects.get(workload=world.wl_a).retry_after_ms == 2_304_170_000
