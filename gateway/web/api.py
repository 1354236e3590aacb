"""Management API views whose data lives in gateway: ``GET /api/requests/{id}``
finds a request by any id a caller holds (request id, ``chatcmpl-...``, job
id) across the ledger, refusals and jobs; read-only, scoped to the tenants
the user may read (another tenant's id is a 404, never a 403)."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from budgets.models import RejectionSample, UsageRecord
from budgets.selectors.request_log import TIMINGS, log_entry_of_tenants, refusal_of_tenants
from gateway.core.request_lookup import request_find
from gateway.models import Job
from tenants.access import tenant_ids_for_user
from tenants.models import Tenant


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def _job_summary(job: Job | None) -> dict | None:
    if job is None:
        return None
    return {"id": str(job.id), "status": job.status, "reason": job.reason or None, "delays": job.delays,
            "delay_history": job.delay_history or [], "created_at": _iso(job.created_at),
            "released_at": _iso(job.released_at), "finished_at": _iso(job.finished_at)}


def _ledger_view(detail, job: Job | None) -> dict:
    row, entry = detail.row, detail.entry
    return {
        "kind": "ledger", "request_id": row.request_id, "completion_id": row.completion_id or None,
        "tenant": row.tenant.slug, "workload": entry.workload_slug, "api_key_prefix": entry.key_prefix or None,
        "status": row.status, "reason": entry.reason or None, "created_at": _iso(row.created_at),
        "pool": row.pool.slug, "model": row.model, "lane": row.lane, "borrowed": row.borrowed,
        "estimated_input_tokens": row.estimated_input_tokens, "estimated_output_tokens": row.estimated_output_tokens,
        "actual_input_tokens": row.actual_input_tokens, "actual_output_tokens": row.actual_output_tokens,
        "cost": str(row.cost), "currency": entry.currency or None, "attempts": row.attempts,
        "timings_ms": {name: entry.timings.get(name) for name in TIMINGS}, "job": _job_summary(job),
    }


def _refusal_view(refusal) -> dict:
    return {
        "kind": "refusal", "request_id": refusal.request_id, "completion_id": None,
        "tenant": Tenant.objects.filter(pk=refusal.tenant_id).values_list("slug", flat=True).first(),
        "workload": refusal.workload_slug, "api_key_prefix": refusal.key_prefix or None, "status": "rejected",
        "reason": refusal.reason, "message": refusal.message, "retry_after_ms": refusal.retry_after_ms,
        "retry_after_s": refusal.retry_after_s, "estimated_tokens": refusal.estimated_tokens,
        "created_at": _iso(refusal.at), "job": None,
    }


class RequestLookup(APIView):
    """A request by its id (``x-request-id``, a refusal's included), the
    ``chatcmpl-...`` id of its answer, or its job's id."""

    @extend_schema(responses=OpenApiTypes.OBJECT, summary="Find a request by request id, chatcmpl- id or job id")
    def get(self, request, request_id: str):
        scope = tenant_ids_for_user(user=request.user)
        tenant_ids = None if scope is None else frozenset(scope)
        found = request_find(tenant_ids=tenant_ids, query=request_id)
        if found is None:
            raise NotFound()
        if found.request_id is None:
            job = found.job
            return Response({"kind": "job", "request_id": None, "tenant": job.tenant.slug,
                             "workload": job.workload.slug, "status": job.status, "job": _job_summary(job)})
        job = found.job or Job.objects.filter(request_id=found.request_id).first()
        try:
            detail = log_entry_of_tenants(tenant_ids=tenant_ids, request_id=found.request_id)
        except UsageRecord.DoesNotExist:
            try:
                refusal = refusal_of_tenants(tenant_ids=tenant_ids, request_id=found.request_id)
            except RejectionSample.DoesNotExist:
                raise NotFound() from None
            return Response(_refusal_view(refusal))
        return Response(_ledger_view(detail, job))
