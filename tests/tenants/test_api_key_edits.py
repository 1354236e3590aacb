"""A key's expiry can be changed after creation, and the revoke
confirmation shows the key's freshest last use (the gateway buffers uses in
its memory and Redis before the database has them)."""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from gateway.core.key_usage import key_last_used_at, key_last_used_flush, key_last_used_push
from tenants.models import ApiKey
from tenants.services import api_key_expiry_set, api_key_revoke

pytestmark = pytest.mark.django_db


def _key(world) -> ApiKey:
    return ApiKey.objects.get(workload=world.wl_a)


def test_a_member_changes_a_keys_expiry_from_the_tenant_page(login, world):
    key = _key(world)
    client = login(world.member_a)
    page = client.get(f"/t/{world.tenant_a.slug}/").content.decode()
    assert f'action="/t/{world.tenant_a.slug}/keys/{key.id}/expiry"' in page

    # when the member sets 30 days, then never
    before = timezone.now()
    response = client.post(f"/t/{world.tenant_a.slug}/keys/{key.id}/expiry", {"expires_in_days": "30"})
    assert response.status_code == 302 and response["Location"] == f"/t/{world.tenant_a.slug}/#keys"
    key.refresh_from_db()
    assert before + timedelta(days=30) <= key.expires_at <= timezone.now() + timedelta(days=30)
    client.post(f"/t/{world.tenant_a.slug}/keys/{key.id}/expiry", {"expires_in_days": "0"})
    key.refresh_from_db()
    assert key.expires_at is None

    # a choice not on the list changes nothing and says why
    response = client.post(f"/t/{world.tenant_a.slug}/keys/{key.id}/expiry", {"expires_in_days": "2"}, follow=True)
    assert "Choose when the key expires from the list." in response.content.decode()
    key.refresh_from_db()
    assert key.expires_at is None


def test_only_the_keys_tenant_may_change_its_expiry_and_never_on_a_revoked_key(login, world):
    key = _key(world)
    for user in (world.member_b, world.finance):
        response = login(user).post(f"/t/{world.tenant_a.slug}/keys/{key.id}/expiry", {"expires_in_days": "7"})
        assert response.status_code in (403, 404)
    # a key of tenant B named under tenant A's URL
    key_b = ApiKey.objects.get(workload=world.wl_b)
    assert login(world.member_a).post(f"/t/{world.tenant_a.slug}/keys/{key_b.id}/expiry",
                                      {"expires_in_days": "7"}).status_code == 404
    assert ApiKey.objects.filter(expires_at__isnull=False).count() == 0
    api_key_revoke(api_key=key)
    with pytest.raises(ValidationError) as refused:
        api_key_expiry_set(api_key=key, expires_at=timezone.now() + timedelta(days=1))
    assert refused.value.message_dict == {"expires_at": ["A revoked key cannot be given a new expiry."]}
    with pytest.raises(ValidationError):
        api_key_expiry_set(api_key=key_b, expires_at=timezone.now() - timedelta(seconds=1))


def test_the_revoke_confirmation_shows_a_use_seconds_old(login, world, redis_client):
    key = _key(world)
    client = login(world.member_a)
    url = f"/t/{world.tenant_a.slug}/keys/{key.id}/revoke"
    assert re.search(r'id="last-used">never<', client.get(url).content.decode())

    # when a web process pushes a use of three seconds ago to Redis (the database has none yet)
    used = int(time.time()) - 3
    asyncio.run(key_last_used_push(last_used={key.id: float(used)}))
    shown = f"{datetime.fromtimestamp(used, tz=dt_timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
    key.refresh_from_db()
    assert key.last_used_at is None
    assert re.search(rf'id="last-used">{shown}<', client.get(url).content.decode())

    # and after the flush wrote it to the database, the same time
    assert key_last_used_flush() == 1
    assert re.search(rf'id="last-used">{shown}<', client.get(url).content.decode())

    # a use this process noted and has not pushed is fresher still
    stored = datetime.fromtimestamp(used, tz=dt_timezone.utc)
    assert key_last_used_at(key_id=key.id, stored=stored, noted=used + 2.0) == stored + timedelta(seconds=2)
    assert key_last_used_at(key_id=key.id, stored=None) is None  # flushed: Redis holds it no longer
    assert key_last_used_at(key_id=key.id + 10_000, stored=None) is None
