from celery import shared_task

from .execution import request_execute


@shared_task(name="gateway.execute_request", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute_request(request_id: str) -> str:
    """Run one admitted request (thin: the record lives in Redis, keyed by id)."""
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
