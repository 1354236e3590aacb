from celery import shared_task

from .services import pool_config_push_all


@shared_task(name="budgets.push_pool_configs", ignore_result=True)
def push_pool_configs() -> int:
    """Re-push every pool's bucket config: catches edits made while Redis was
    away and rebuilds config after a Redis restart."""
    return pool_config_push_all()


# Beat tasks of the web UI's read models and the spend guardrails.
from .periodic_tasks import expire_budget_requests, flush_rejections, reconcile_spend, rollup_daily_usage  # noqa: E402,F401
