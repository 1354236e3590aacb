"""The key cache in one web process (gateway/web/auth.py, cachetools'
TLRUCache): a cached key is kept no later than its expiry, and a revocation the
poll finds drops it at once, however long SLUICE_AUTH_CACHE_S is. Across
processes: tests/gateway/test_key_revocation.py."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from gateway.web import auth
from gateway.web.auth import key_check
from tenants.models import ApiKey
from tenants.services import api_key_create

check = async_to_sync(key_check)
ADDRESS = "198.51.100.40"


@pytest.fixture(autouse=True)
def cache_alone(settings, monkeypatch, key_lookups_close_their_connections):
    """A 60 s cache, no revocation poll unless a test runs one, and lookups
    that close their executor threads' connections."""
    settings.SLUICE_AUTH_CACHE_S = 60
    monkeypatch.setattr(auth._tick, "next_poll", float("inf"))


def test_a_cached_key_is_kept_no_later_than_its_expiry(make_caller):
    # given a key that expires in a second, checked once (cached "for 60 s")
    caller = make_caller()
    expires = timezone.now() + timedelta(seconds=1)
    raw = api_key_create(workload=caller.workload, name="short", expires_at=expires).raw_key
    started = time.monotonic()
    assert check(raw, address=ADDRESS).context.workload_id == caller.workload.id
    # when it is checked until refused (poll, with a deadline)
    deadline = started + 5
    while check(raw, address=ADDRESS).context is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    # then it was refused from its expiry on, not 60 s later
    assert 0.8 <= time.monotonic() - started <= 1.5


def test_a_revocation_the_poll_finds_drops_the_cached_key(make_caller, monkeypatch):
    # given two cached keys
    revoked, kept = make_caller(), make_caller()
    for caller in (revoked, kept):
        assert check(caller.api_key, address=ADDRESS).context.workload_id == caller.workload.id
    # when one is revoked in the database, the cache still serves it until a poll
    ApiKey.objects.filter(workload=revoked.workload).update(revoked_at=timezone.now())
    assert check(revoked.api_key, address=ADDRESS).context is not None
    monkeypatch.setattr(auth._tick, "next_poll", 0.0)
    # then the next check runs the poll and refuses it; the other key still passes
    assert check(revoked.api_key, address=ADDRESS).context is None
    assert check(kept.api_key, address=ADDRESS).context.workload_id == kept.workload.id
