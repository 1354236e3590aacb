"""A small world for the web UI and management API tests: one pool, two
tenants (A and B) with a workload each, and the four kinds of people: a
platform admin, a finance auditor and a member of each tenant. Real
PostgreSQL and Redis, like every other test."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

import pytest
from django.utils import timezone

PASSWORD = "correct-horse-battery"
_seq = itertools.count(1)


@dataclass
class World:
    pool: object
    tenant_a: object
    tenant_b: object
    wl_a: object
    wl_b: object
    res_a: object
    res_b: object
    admin: object
    finance: object
    member_a: object
    member_b: object
    key_a: str
    key_b: str


_hash: list[str] = []


def _password_hash() -> str:
    """PASSWORD hashed once per process (PBKDF2 is slow on purpose; every
    user of the tests shares one salted hash, which still verifies)."""
    from django.contrib.auth.hashers import make_password

    if not _hash:
        _hash.append(make_password(PASSWORD))
    return _hash[0]


def make_user(username: str, *, staff: bool = False, finance: bool = False, superuser: bool = False):
    from django.contrib.auth.models import Group, User

    user = User(username=username, is_staff=staff or superuser, is_superuser=superuser, password=_password_hash())
    user.save()
    if finance:
        # Created by migration tenants/0003; a transactional test's flush empties
        # it, so make sure it is there.
        from django.contrib.auth.models import Permission

        group, _ = Group.objects.get_or_create(name="Finance auditors")
        group.permissions.add(Permission.objects.get(content_type__app_label="tenants", codename="audit_all_tenants"))
        user.groups.add(group)
    return user


def build_world(*, base_url: str = "http://127.0.0.1:9/v1", provider_tpm: int = 1_000_000, provider_rpm: int = 10_000,
                suffix: str | None = None) -> World:
    from budgets.models import InferencePool, ModelPrice, Reservation
    from budgets.admission.pool_config import pool_config_push
    from tenants.models import Membership, Tenant, Workload
    from tenants.services import api_key_create

    n = suffix or f"{next(_seq)}{uuid.uuid4().hex[:4]}"
    pool = InferencePool(name=f"Pool {n}", slug=f"pool-{n}", base_url=base_url, served_models=["sim-small", "sim-large"],
                         provider_tpm=provider_tpm, provider_rpm=provider_rpm, headroom=0.8, burst_seconds=15.0,
                         is_simulator=True)  # the browser story steers inference_sim per request ("sim")
    pool.full_clean()
    pool.save()
    ModelPrice.objects.get_or_create(
        model="sim-small", effective_from=datetime(2020, 1, 1, tzinfo=dt_timezone.utc),
        defaults={"input_per_million": Decimal("0.150000"), "output_per_million": Decimal("0.600000")},
    )
    ModelPrice.objects.get_or_create(
        model="sim-large", effective_from=datetime(2020, 1, 1, tzinfo=dt_timezone.utc),
        defaults={"input_per_million": Decimal("2.500000"), "output_per_million": Decimal("10.000000")},
    )
    tenant_a = Tenant.objects.create(name=f"Acme {n}", slug=f"acme-{n}", cost_center="CC-A")
    tenant_b = Tenant.objects.create(name=f"Globex {n}", slug=f"globex-{n}", cost_center="CC-B")
    wl_a = Workload.objects.create(tenant=tenant_a, name="Acme chat", slug=f"acme-chat-{n}", prompt_tokens_cap=2_000,
                                   max_tokens_cap=400, max_tokens_default=64)
    wl_b = Workload.objects.create(tenant=tenant_b, name="Globex bot", slug=f"globex-bot-{n}", prompt_tokens_cap=2_000,
                                   max_tokens_cap=400, max_tokens_default=64)
    res_a = Reservation(workload=wl_a, pool=pool, reserved_tpm=100_000, ceiling_tpm=150_000, rpm=600)
    res_a.full_clean()
    res_a.save()
    res_b = Reservation(workload=wl_b, pool=pool, reserved_tpm=50_000, ceiling_tpm=80_000, rpm=300)
    res_b.full_clean()
    res_b.save()
    pool_config_push(pool=pool)
    admin = make_user(f"admin-{n}", staff=True, superuser=True)
    finance = make_user(f"finance-{n}", finance=True)
    member_a = make_user(f"alice-{n}")
    member_b = make_user(f"bob-{n}")
    Membership.objects.create(tenant=tenant_a, user=member_a)
    Membership.objects.create(tenant=tenant_b, user=member_b)
    key_a = api_key_create(workload=wl_a, name="a").raw_key
    key_b = api_key_create(workload=wl_b, name="b").raw_key
    return World(pool=pool, tenant_a=tenant_a, tenant_b=tenant_b, wl_a=wl_a, wl_b=wl_b, res_a=res_a, res_b=res_b,
                 admin=admin, finance=finance, member_a=member_a, member_b=member_b, key_a=key_a, key_b=key_b)


def ledger_add(*, workload, pool, at: datetime, model: str = "sim-small", input_tokens: int = 100,
               output_tokens: int = 50, estimated_output: int = 64, status: str = "ok",
               endpoint: str = "/v1/chat/completions", overflow: bool = False) -> str:
    """One ledger row through the real writer (price lookup included)."""
    from budgets.ledger.writer import LedgerEntry, usage_record_write

    request_id = "req_" + uuid.uuid4().hex
    usage_record_write(entry=LedgerEntry(
        request_id=request_id, created_at=at, tenant_id=workload.tenant_id, workload_id=workload.id, pool_id=pool.id,
        model=model, lane="interactive", status=status, borrowed=False, estimated_input_tokens=input_tokens,
        estimated_output_tokens=estimated_output, actual_input_tokens=input_tokens if status == "ok" else 0,
        actual_output_tokens=output_tokens if status == "ok" else 0, endpoint=endpoint, overflow=overflow,
    ))
    return request_id


def ledger_now() -> datetime:
    """The anchor for ``ledger_spread`` in tests that window its rows by
    date: now, except in the first half hour of a UTC day, half an hour ago.
    The rows go minutes before the anchor, so an anchor just past midnight
    would put each day's rows on the day before, and the oldest day's outside
    a window the test derives from the same anchor (seen at 00:06 UTC)."""
    now = timezone.now()
    if now - now.replace(hour=0, minute=0, second=0, microsecond=0) < timedelta(minutes=30):
        return now - timedelta(minutes=31)
    return now


def ledger_spread(*, world: World, now: datetime, days: int = 5, per_day: int = 3) -> int:
    """A few rows a day for both tenants, for both models, over ``days`` days."""
    count = 0
    for d in range(days):
        at = now - timedelta(days=d, minutes=5)
        for i in range(per_day):
            ledger_add(workload=world.wl_a, pool=world.pool, at=at - timedelta(minutes=i), input_tokens=100 + i,
                       output_tokens=40 + d)
            ledger_add(workload=world.wl_b, pool=world.pool, at=at - timedelta(minutes=i), model="sim-large",
                       input_tokens=200 + i, output_tokens=80)
            count += 2
    return count


@pytest.fixture
def world(db, redis_client) -> World:
    return build_world()


@pytest.fixture
def login(client):
    """Sign the test client in as a user (the real login form, CSRF off as Django's test client does)."""

    def sign_in(user):
        client.force_login(user)
        return client

    return sign_in
