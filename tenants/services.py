from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from tenants.keys import api_key_display_prefix, api_key_generate, api_key_hash, callback_secret_generate
from tenants.models import ApiKey, Tenant, Workload


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


def tenant_callback_secret_rotate(*, tenant: Tenant) -> Tenant:
    """A new secret for the tenant's job callbacks; the old one stops
    signing at once (attempts already signed keep their signature)."""
    tenant.callback_secret = callback_secret_generate()
    tenant.callback_secret_rotated_at = timezone.now()
    tenant.save(update_fields=["callback_secret", "callback_secret_rotated_at"])
    return tenant
