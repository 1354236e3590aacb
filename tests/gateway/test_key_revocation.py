"""Revoked and expired keys stop working within a second on every web
process, however long the key cache (SLUICE_AUTH_CACHE_S) is; last use is
written to the database in batches, not per request."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from gateway.core.key_usage import key_last_used_flush
from llm_platform import processes
from tenants.models import ApiKey
from tenants.services import api_key_create, api_key_revoke
from tests.platform_harness import Process, free_port, wait_http

pytestmark = pytest.mark.django_db(transaction=True)

# Long enough that only the revocation poll (0.5 s) can explain a refusal
# within a second.
LONG_CACHE = {"SLUICE_AUTH_CACHE_S": "60", "SLUICE_AUTH_REVOCATION_POLL_S": "0.5", "SLUICE_KEY_LAST_USED_PUSH_S": "0"}


@pytest.fixture
def two_webs(platform):
    """The session's web process and a second one, both with a 60 s key cache."""
    with platform.environment(LONG_CACHE, lanes=[]):
        port = free_port()
        second = Process("web-2", processes.web_command(port=port), platform.env, platform.log_dir).start()
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", second)
            yield [platform.base_url, f"http://127.0.0.1:{port}"]
        finally:
            second.stop()


def status(base_url: str, api_key: str) -> int:
    return httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=5).status_code


def first_refusal_s(webs: list[str], api_key: str, *, since: float, limit_s: float = 5.0) -> list[float]:
    """Seconds from ``since`` until each web process first answers 401 (poll, with a deadline)."""
    found: dict[str, float] = {}
    deadline = since + limit_s
    while len(found) < len(webs) and time.monotonic() < deadline:
        for web in webs:
            if web not in found and status(web, api_key) == 401:
                found[web] = time.monotonic() - since
        time.sleep(0.02)
    return [found.get(web, float("inf")) for web in webs]


def test_a_revoked_key_is_refused_by_every_web_process_within_a_second(two_webs, make_caller):
    # given a key both processes have cached (a 60 s cache)
    caller = make_caller()
    assert [status(web, caller.api_key) for web in two_webs] == [200, 200]
    # when it is revoked
    api_key_revoke(api_key=ApiKey.objects.get(workload=caller.workload))
    revoked = time.monotonic()
    # then both refuse it within a second
    assert max(first_refusal_s(two_webs, caller.api_key, since=revoked)) <= 1.0
    # and a key revoked nowhere near keeps working on both
    other = make_caller()
    assert [status(web, other.api_key) for web in two_webs] == [200, 200]


def test_an_expired_key_is_refused_from_its_expiry_on(two_webs, make_caller):
    caller = make_caller()
    expires = timezone.now() + timedelta(seconds=2)
    raw = api_key_create(workload=caller.workload, name="short", expires_at=expires).raw_key
    expires_mono = time.monotonic() + (expires - timezone.now()).total_seconds()
    assert [status(web, raw) for web in two_webs] == [200, 200]  # cached in both, for "60 s"
    refused = first_refusal_s(two_webs, raw, since=expires_mono - 2.0, limit_s=5.0)
    # not before it expired (a little clock slack), and at most a second after
    assert all(1.9 <= s <= 3.0 for s in refused), refused


def test_last_use_is_written_in_one_batch(two_webs, make_caller):
    caller = make_caller()
    key = ApiKey.objects.get(workload=caller.workload)
    assert key.last_used_at is None
    before = timezone.now()
    # twenty calls across both processes
    for n in range(20):
        assert status(two_webs[n % 2], caller.api_key) == 200
    # each process pushes its notes at its next tick: poll the flush until the key shows up
    deadline = time.monotonic() + 5
    changed = 0
    while time.monotonic() < deadline and not changed:
        changed = key_last_used_flush()
        time.sleep(0.1)
    key.refresh_from_db()
    assert changed == 1  # one row, not twenty updates
    assert key.last_used_at is not None and before - timedelta(seconds=1) <= key.last_used_at <= timezone.now()
    connection.close()


def test_a_process_that_goes_quiet_after_one_call_still_reports_its_last_use(two_webs, make_caller):
    # given one call, and no other request to that process after it
    caller = make_caller()
    assert status(two_webs[0], caller.api_key) == 200

    # when the flush runs, for up to 5 s
    deadline = time.monotonic() + 5
    changed = 0
    while time.monotonic() < deadline and not changed:
        changed = key_last_used_flush()
        time.sleep(0.1)

    # then the call's use reached the key (the note was sent without waiting for another request)
    assert changed == 1
    assert ApiKey.objects.get(workload=caller.workload).last_used_at is not None
    connection.close()
