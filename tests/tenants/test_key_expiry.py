"""Keys may expire: set at creation (page or API), shown, and refused at
auth from then on (the lookup itself; the cache is tests/gateway/test_key_revocation.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import ApiKey
from tenants.selectors import api_key_lookup
from tenants.services import api_key_create

pytestmark = pytest.mark.django_db


def test_a_key_made_on_the_page_expires_when_chosen(login, world):
    client = login(world.member_a)
    before = timezone.now()
    response = client.post(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_a.id, "name": "week",
                                                                   "expires_in_days": "7"})
    assert response.status_code == 200 and "It expires on" in response.content.decode()
    key = ApiKey.objects.get(name="week")
    assert before + timedelta(days=7) <= key.expires_at <= timezone.now() + timedelta(days=7)
    page = client.get(f"/t/{world.tenant_a.slug}/").content.decode()
    assert key.expires_at.strftime("%Y-%m-%d %H:%M") in page
    # an expiry not offered is refused, and no key is made
    assert client.post(f"/t/{world.tenant_a.slug}/keys/new", {"workload": world.wl_a.id, "name": "odd",
                                                             "expires_in_days": "3"}).status_code == 400
    assert not ApiKey.objects.filter(name="odd").exists()


def test_an_expired_key_is_not_found_at_auth(world):
    live = api_key_create(workload=world.wl_a, name="live", expires_at=timezone.now() + timedelta(hours=1))
    gone = api_key_create(workload=world.wl_a, name="gone", expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=gone.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert api_key_lookup(raw_key=live.raw_key).pk == live.api_key.pk
    assert api_key_lookup(raw_key=gone.raw_key) is None
    gone.api_key.refresh_from_db()
    assert gone.api_key.is_expired and not gone.api_key.is_active


def test_the_api_sets_and_checks_expiry(world):
    from rest_framework.authtoken.models import Token

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=world.member_a).key}")
    url = f"/api/tenants/{world.tenant_a.slug}/keys/"
    at = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
    created = api.post(url, {"workload_id": world.wl_a.id, "name": "api", "expires_at": at.isoformat()}, format="json")
    assert created.status_code == 201 and created.json()["expires_at"] is not None
    assert ApiKey.objects.get(name="api").expires_at == at
    past = api.post(url, {"workload_id": world.wl_a.id, "expires_at": "2020-01-01T00:00:00Z"}, format="json")
    assert past.status_code == 400 and past.json()["expires_at"] == ["The expiry must be in the future."]
