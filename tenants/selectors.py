from __future__ import annotations

from datetime import datetime

from django.db.models import Q
from django.utils import timezone

from tenants.keys import api_key_hash
from tenants.models import ApiKey, Tenant


def api_key_lookup(*, raw_key: str) -> ApiKey | None:
    """The active key matching ``raw_key`` (not revoked, not expired, its
    workload active), with its workload and tenant."""
    return (
        ApiKey.objects.select_related("workload", "workload__tenant")
        .filter(key_hash=api_key_hash(raw_key), revoked_at__isnull=True, workload__is_active=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        .first()
    )


def api_key_hashes_revoked_since(*, since: datetime) -> list[str]:
    """Digests of the keys revoked at or after ``since`` (an index range on
    revoked_at): what each web process drops from its key cache."""
    return list(ApiKey.objects.filter(revoked_at__gte=since).values_list("key_hash", flat=True))


def tenant_slugs_by_id(*, tenant_ids: set[int]) -> dict[int, str]:
    """Slugs for pages that list rows of several tenants (admins, finance)."""
    return dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("id", "slug")) if tenant_ids else {}
