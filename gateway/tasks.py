from celery import shared_task

from .execution import request_execute


@shared_task(name="gateway.execute_request", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute_request(request_id: str) -> str:
    """Run one admitted request (thin: the record lives in Redis, keyed by id)."""
    return request_execute(request_id=request_id)
