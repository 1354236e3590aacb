from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.core.exceptions import ValidationError
from django.db.models import Q
from django.utils import timezone

from tenants.keys import api_key_display_prefix, api_key_generate, api_key_hash, callback_secret_generate
from tenants.models import ApiKey, Tenant, Workload


@dataclass(frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    raw_key: str  # shown once, never stored


def api_key_create(*, workload: Workload, name: str = "", expires_at: datetime | None = None) -> CreatedApiKey:
    """A new key for ``workload``; ``expires_at`` (optional, in the future)
    is when it stops working. Raises ValidationError for an expiry in the past."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future."})
    raw = api_key_generate()
    key = ApiKey.objects.create(
        workload=workload, name=name, prefix=api_key_display_prefix(raw), key_hash=api_key_hash(raw),
        expires_at=expires_at,
    )
    return CreatedApiKey(api_key=key, raw_key=raw)


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke the key. Every web process drops it from its key cache within
    about half a second (gateway/web/auth.py polls for revocations), so it
    stops working within a second everywhere; calls already admitted finish."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def api_key_expiry_set(*, api_key: ApiKey, expires_at: datetime | None) -> ApiKey:
    """Change when a key stops working (None: never). Only a future time: a
    key that must stop now is revoked, which every web process applies
    within a second; a new expiry reaches a process's key cache within
    SLUICE_AUTH_CACHE_S, long before any future expiry falls due. Raises
    ValidationError for a revoked key or a time in the past."""
    if api_key.revoked_at is not None:
        raise ValidationError({"expires_at": "A revoked key cannot be given a new expiry."})
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future; revoke the key to stop it now."})
    api_key.expires_at = expires_at
    api_key.save(update_fields=["expires_at"])
    return api_key


def api_keys_mark_used(*, last_used: dict[int, datetime]) -> int:
    """Record when keys were last used (a batch from the gateway's buffer):
    one UPDATE per key, and only where the time moves forward. Returns how
    many rows changed."""
    changed = 0
    for key_id, at in last_used.items():
        changed += ApiKey.objects.filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=at), pk=key_id).update(
            last_used_at=at)
    return changed


def tenant_callback_secret_rotate(*, tenant: Tenant) -> Tenant:
    """A new secret for the tenant's job callbacks; the old one stops
    signing at once (attempts already signed keep their signature)."""
    tenant.callback_secret = callback_secret_generate()
    tenant.callback_secret_rotated_at = timezone.now()
    tenant.save(update_fields=["callback_secret", "callback_secret_rotated_at"])
    return tenant
