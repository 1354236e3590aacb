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


def api_keys_issued_after(*, key_id: int) -> list[tuple[int, str, int]]:
    """(id, digest, tenant id) of the keys issued after ``key_id`` and not
    revoked (a range on the primary key; every key when 0): what each web
    process knows Sluice has issued, and whose each one is."""
    return list(ApiKey.objects.filter(pk__gt=key_id, revoked_at__isnull=True).order_by("pk")
                .values_list("pk", "key_hash", "workload__tenant_id"))


def api_key_changes(*, revoked_since: datetime,
                    issued_after_id: int) -> tuple[list[str], list[tuple[int, str, int]]]:
    """One poll of a web process: keys revoked since, keys issued after."""
    return (api_key_hashes_revoked_since(since=revoked_since), api_keys_issued_after(key_id=issued_after_id))


def tenant_slugs_by_id(*, tenant_ids: set[int]) -> dict[int, str]:
    """Slugs for pages that list rows of several tenants (admins, finance)."""
    return dict(Tenant.objects.filter(pk__in=tenant_ids).values_list("id", "slug")) if tenant_ids else {}
