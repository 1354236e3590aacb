"""Find a request by any id a caller may hold: the request id (the
``x-request-id`` of any answer, a refusal's included), the ``chatcmpl-...``
id the SDK returned, or a job id. Used by the request log's search box and
``GET /api/requests/{id}``; scoped like every tenant read (``tenant_ids``
None: every tenant), so another tenant's id is simply not found (404, never
403: tenants/access.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from budgets.selectors.request_log import request_exists_for_tenants, request_id_of_completion
from gateway.models import Job

MAX_QUERY_CHARS = 200


@dataclass(frozen=True)
class FoundRequest:
    request_id: str | None  # the ledger row's or refusal's id; None for a job that has not run yet
    job: Job | None = None  # the job, when the id was a job's


def _job_of_tenants(*, tenant_ids: frozenset[int] | None, job_id: uuid.UUID) -> Job | None:
    jobs = Job.objects.select_related("workload", "tenant").filter(pk=job_id)
    if tenant_ids is not None:
        jobs = jobs.filter(tenant_id__in=tenant_ids)
    return jobs.first()


def request_find(*, tenant_ids: frozenset[int] | None, query: str) -> FoundRequest | None:
    """The request (or job) ``query`` names in the caller's scope, else None."""
    query = (query or "").strip()
    if not query or len(query) > MAX_QUERY_CHARS or not query.isprintable():
        return None
    try:
        job_id = uuid.UUID(query)
    except ValueError:
        job_id = None
    if job_id is not None:
        job = _job_of_tenants(tenant_ids=tenant_ids, job_id=job_id)
        if job is not None:
            if job.request_id and request_exists_for_tenants(tenant_ids=tenant_ids, request_id=job.request_id):
                return FoundRequest(request_id=job.request_id, job=job)
            return FoundRequest(request_id=None, job=job)
    if query.startswith("chatcmpl-"):
        request_id = request_id_of_completion(tenant_ids=tenant_ids, completion_id=query)
        return FoundRequest(request_id=request_id) if request_id else None
    if request_exists_for_tenants(tenant_ids=tenant_ids, request_id=query):
        return FoundRequest(request_id=query)
    # Another pool's or server's answer id without the usual prefix.
    request_id = request_id_of_completion(tenant_ids=tenant_ids, completion_id=query)
    return FoundRequest(request_id=request_id) if request_id else None
