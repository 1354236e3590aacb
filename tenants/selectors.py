from __future__ import annotations

from tenants.keys import api_key_hash
from tenants.models import ApiKey


def api_key_lookup(*, raw_key: str) -> ApiKey | None:
    """The active key matching ``raw_key``, with its workload and tenant."""
    return (
        ApiKey.objects.select_related("workload", "workload__tenant")
        .filter(key_hash=api_key_hash(raw_key), revoked_at__isnull=True, workload__is_active=True)
        .first()
    )
