"""budgets' beat tasks: each one calls one idempotent service, so a
redelivery (acks_late) or an overlap is harmless. Task names are stable: beat
schedules and queued messages refer to them."""

from __future__ import annotations

from dataclasses import asdict

from celery import shared_task

from budgets.admission.pool_config import pool_config_push_all
from budgets.ledger.rejections import rejection_samples_prune, rejections_flush
from budgets.ledger.rollups import daily_usage_refresh
from budgets.ledger.spend import spend_reconcile
from budgets.services.alert_spikes import rejection_spikes_check
from budgets.services.alerts import DELIVER_ALERT_TASK, alert_deliver, alert_retries_release
from budgets.services.budget_requests import budget_requests_expire


@shared_task(name="budgets.push_pool_configs", ignore_result=True)
def push_pool_configs() -> int:
    """Re-push every pool's bucket config: catches edits made while Redis was
    away and rebuilds config after a Redis restart."""
    return pool_config_push_all()


@shared_task(name="budgets.flush_rejections", ignore_result=True)
def flush_rejections() -> dict:
    """Move closed minutes of rejection counters from Redis to the database."""
    result = asdict(rejections_flush())
    result["pruned_samples"] = rejection_samples_prune()
    return result


@shared_task(name="budgets.rollup_daily_usage", ignore_result=True)
def rollup_daily_usage() -> int:
    """Bring the daily usage rollups up to date with the ledger."""
    return daily_usage_refresh().rows


@shared_task(name="budgets.reconcile_spend", ignore_result=True)
def reconcile_spend() -> dict:
    """Overwrite month-to-date spend in Redis from the ledger; notify thresholds."""
    return asdict(spend_reconcile())


@shared_task(name="budgets.expire_budget_requests", ignore_result=True)
def expire_budget_requests() -> int:
    """Lapse approved slices whose end date has passed."""
    return budget_requests_expire()


@shared_task(name=DELIVER_ALERT_TASK, acks_late=True, ignore_result=True)
def deliver_alert(notification_id: int, channel: str, attempt: int = 1) -> str:
    """One attempt to send one alert by e-mail or webhook (logged; a failure parks the next)."""
    return alert_deliver(notification_id=notification_id, channel=channel, attempt=attempt)


@shared_task(name="budgets.release_alert_retries", ignore_result=True)
def release_alert_retries() -> int:
    """Enqueue alert attempts whose backoff is over. The pacer does this at
    each step (gateway/worker/pacer.py); the task is kept for a run by hand."""
    return alert_retries_release()


@shared_task(name="budgets.check_rejection_spikes", ignore_result=True)
def check_rejection_spikes() -> int:
    """Notify tenants under a sustained rejection spike (once an hour each)."""
    return rejection_spikes_check()
