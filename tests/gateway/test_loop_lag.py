"""The web loop's lag on /metrics (gateway/web/loop_lag.py): a turn that holds
the loop shows as a late timer, once per loop, from its first /v1 request."""

from __future__ import annotations

import asyncio
import time

import prometheus_client
import pytest

from gateway.web import loop_lag
from gateway.web.loop_lag import loop_lag_watch
from tests.asgi_calls import asgi_call, get_scope

NAME = "sluice_web_loop_lag_seconds"


def _count() -> float:
    return prometheus_client.REGISTRY.get_sample_value(f"{NAME}_count") or 0.0


def _within(le: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(f"{NAME}_bucket", {"le": le}) or 0.0


def test_a_turn_that_holds_the_loop_is_one_late_timer(monkeypatch):
    monkeypatch.setattr(loop_lag, "INTERVAL_S", 0.05)
    count_before, quick_before = _count(), _within("0.25")

    async def main():
        loop_lag_watch()
        loop_lag_watch()  # once per loop: a second call sets no second timer
        await asyncio.sleep(0.2)  # a few timers on time
        time.sleep(0.5)  # one turn that holds the loop past the next timer
        await asyncio.sleep(0.2)

    asyncio.run(main())
    seen = _count() - count_before
    late = seen - (_within("0.25") - quick_before)
    # The held turn's timer ran at least 0.45 s late; one timer per loop, so
    # one late sample (two with a second timer), and the others on time.
    assert late == 1
    assert 4 <= seen <= 12


@pytest.mark.django_db
def test_the_watch_starts_with_the_loops_first_v1_request(monkeypatch):
    from llm_platform.asgi import application

    monkeypatch.setattr(loop_lag, "INTERVAL_S", 0.05)

    async def main():
        count_before = _count()
        await asyncio.sleep(0.2)  # a new loop, no /v1 request yet: not watched
        unwatched = _count() - count_before
        sent = await asgi_call(application, get_scope("/v1/models"))
        count_after_request = _count()
        await asyncio.sleep(0.2)
        return unwatched, _count() - count_after_request, sent[0]["status"]

    unwatched, watched, status = asyncio.run(main())
    assert unwatched == 0
    assert watched >= 2
    assert status == 401  # no key: answered, and the loop watched all the same
