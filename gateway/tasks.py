from celery import shared_task
from django.db import InterfaceError, OperationalError, close_old_connections
from redis.exceptions import ConnectionError as RedisConnectionError

from .execution import request_execute


@shared_task(
    name="gateway.execute_request",
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    # PostgreSQL or Redis restarting must not lose an accepted request: every
    # step of request_execute is idempotent, so run it again (the pool is not
    # called twice: its answer is kept in Redis). Short, capped backoff.
    autoretry_for=(OperationalError, InterfaceError, RedisConnectionError),
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=40,
)
def execute_request(request_id: str) -> str:
    """Run one admitted request (thin: the record lives in Redis, keyed by id)."""
    close_old_connections()  # a connection broken by a database restart is replaced
    return request_execute(request_id=request_id)


@shared_task(name="gateway.reap_leases", ignore_result=True)
def reap_leases() -> int:
    from budgets.models import InferencePool

    from .execution import leases_reap

    return leases_reap(pool_ids=list(InferencePool.objects.values_list("id", flat=True)))


@shared_task(name="gateway.run_schedule", ignore_result=True)
def run_schedule(schedule_id: int) -> int:
    from .schedules import schedule_run

    return len(schedule_run(schedule_id=schedule_id))
