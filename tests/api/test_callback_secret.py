"""The tenant's job-callback signing secret: its members and platform admins
read and rotate it (API and tenant page); other tenants' members and finance
auditors neither see nor change it."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tenants.models import Tenant

pytestmark = pytest.mark.django_db


def api_as(user) -> APIClient:
    api = APIClient()
    api.force_authenticate(user)
    return api


def test_members_and_admins_read_the_secret_others_get_a_404(world):
    url = f"/api/tenants/{world.tenant_a.slug}/callback-secret/"
    for user in (world.member_a, world.admin):
        response = api_as(user).get(url)
        assert response.status_code == 200
        assert response.json()["callback_secret"] == world.tenant_a.callback_secret
        assert response["Cache-Control"] == "no-store"
    for user in (world.member_b, world.finance):
        response = api_as(user).get(url)
        assert response.status_code == 404
        assert world.tenant_a.callback_secret not in response.content.decode()


def test_a_member_rotates_the_secret_others_cannot(world):
    before = world.tenant_a.callback_secret
    url = f"/api/tenants/{world.tenant_a.slug}/callback-secret/rotate/"
    assert api_as(world.member_b).post(url).status_code == 404
    assert api_as(world.finance).post(url).status_code in (403, 404)
    assert Tenant.objects.get(pk=world.tenant_a.pk).callback_secret == before
    response = api_as(world.member_a).post(url)
    assert response.status_code == 200
    after = Tenant.objects.get(pk=world.tenant_a.pk)
    assert response.json()["callback_secret"] == after.callback_secret != before
    assert after.callback_secret_rotated_at is not None


def test_the_tenant_page_shows_the_secret_to_members_not_to_finance(client, world):
    client.force_login(world.member_a)
    page = client.get(f"/t/{world.tenant_a.slug}/")
    assert page.status_code == 200 and world.tenant_a.callback_secret in page.content.decode()
    client.force_login(world.finance)
    page = client.get(f"/t/{world.tenant_a.slug}/")
    assert page.status_code == 200 and world.tenant_a.callback_secret not in page.content.decode()


def test_rotating_from_the_tenant_page(client, world):
    before = world.tenant_a.callback_secret
    client.force_login(world.member_b)
    assert client.post(f"/t/{world.tenant_a.slug}/callback-secret/rotate").status_code == 404
    client.force_login(world.member_a)
    response = client.post(f"/t/{world.tenant_a.slug}/callback-secret/rotate")
    assert response.status_code == 302 and response["Location"].endswith("#callbacks")
    assert Tenant.objects.get(pk=world.tenant_a.pk).callback_secret != before
