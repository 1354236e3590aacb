from __future__ import annotations

from .keys import api_key_hash
from .models import ApiKey, Tenant, Workload


def api_key_lookup(*, raw_key: str) -> ApiKey | None:
    """The active key matching ``raw_key``, with its workload and tenant."""
    return (
        ApiKey.objects.select_related("workload", "workload__tenant")
        .filter(key_hash=api_key_hash(raw_key), revoked_at__isnull=True, workload__is_active=True)
        .first()
    )


def workload_get(*, tenant: Tenant, workload_id: int) -> Workload:
    """A workload of ``tenant``; another tenant's id raises DoesNotExist."""
    return Workload.objects.get(tenant=tenant, pk=workload_id)


def workloads_of_tenant(*, tenant: Tenant):
    return Workload.objects.filter(tenant=tenant)
