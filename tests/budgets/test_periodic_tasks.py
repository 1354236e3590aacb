"""The beat tasks of the read models call their services (run eagerly here,
against the real database and Redis)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from budgets.ledger import rejections
from budgets.models import DailyUsage, RejectionStat
from budgets.tasks import expire_budget_requests, flush_rejections, reconcile_spend, rollup_daily_usage
from budgets.ledger.spend import spend_month_key
from tests.people import ledger_add, world  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db


def test_beat_tasks_are_scheduled():
    from llm_platform.celery import app

    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert {"budgets.flush_rejections", "budgets.rollup_daily_usage", "budgets.reconcile_spend",
            "budgets.expire_budget_requests"} <= scheduled
    assert {"budgets.flush_rejections", "budgets.rollup_daily_usage", "budgets.reconcile_spend",
            "budgets.expire_budget_requests"} <= set(app.tasks)


def test_tasks_run_their_services(world, redis_client, monkeypatch):
    now = timezone.now()
    ledger_add(workload=world.wl_a, pool=world.pool, at=now - timedelta(minutes=1))
    rejections.rejection_count(pool_id=world.pool.id, workload_id=world.wl_a.id, tenant_id=world.tenant_a.id,
                               reason="workload_tpm", estimated_tokens=1, retry_after_ms=1)
    real_time = time.time
    monkeypatch.setattr(rejections.time, "time", lambda: real_time() + 3600)
    assert flush_rejections.apply().get()["stats"] == 1
    monkeypatch.undo()
    assert RejectionStat.objects.get().count == 1
    assert rollup_daily_usage.apply().get() >= 1 and DailyUsage.objects.exists()
    # tenant A: itself and its workload; tenant B: itself (nothing spent)
    assert reconcile_spend.apply().get()["fields"] == 3
    assert redis_client.hget(spend_month_key(tenant_id=world.tenant_a.id, at=now), f"T{world.tenant_a.id}") is not None
    assert expire_budget_requests.apply().get() == 0
