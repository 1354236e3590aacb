from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from tenants.keys import api_key_display_prefix, api_key_generate, api_key_hash
from tenants.models import ApiKey, Workload


@dataclass(frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    raw_key: str  # shown once, never stored


def api_key_create(*, workload: Workload, name: str = "") -> CreatedApiKey:
    raw = api_key_generate()
    key = ApiKey.objects.create(
        workload=workload, name=name, prefix=api_key_display_prefix(raw), key_hash=api_key_hash(raw)
    )
    return CreatedApiKey(api_key=key, raw_key=raw)


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key
