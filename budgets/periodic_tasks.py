"""Beat tasks of the read models and guardrails: each one calls one
idempotent service, so a redelivery (acks_late) or an overlap is harmless."""

from __future__ import annotations

from dataclasses import asdict

from celery import shared_task


@shared_task(name="budgets.flush_rejections", ignore_result=True)
def flush_rejections() -> dict:
    """Move closed minutes of rejection counters from Redis to the database."""
    from .rejections import rejection_samples_prune, rejections_flush

    result = asdict(rejections_flush())
    result["pruned_samples"] = rejection_samples_prune()
    return result


@shared_task(name="budgets.rollup_daily_usage", ignore_result=True)
def rollup_daily_usage() -> int:
    """Bring the daily usage rollups up to date with the ledger."""
    from .rollups import daily_usage_refresh

    return daily_usage_refresh().rows


@shared_task(name="budgets.reconcile_spend", ignore_result=True)
def reconcile_spend() -> dict:
    """Overwrite month-to-date spend in Redis from the ledger; notify thresholds."""
    from .spend import spend_reconcile

    return asdict(spend_reconcile())


@shared_task(name="budgets.expire_budget_requests", ignore_result=True)
def expire_budget_requests() -> int:
    """Lapse approved slices whose end date has passed."""
    from .budget_requests import budget_requests_expire

    return budget_requests_expire()
