"""seed_demo keeps what exists: it creates only what is missing, mints no key
unless a demo workload has none (or --new-key), and --reset puts the demo
back saying what it overwrote. A restart of the platform after an approval
keeps the approved numbers in the database, in Redis and in the headers."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections

from budgets.admission import keys as admission_keys
from budgets.models import InferencePool, ModelPrice, Reservation
from budgets.services.budget_requests import budget_request_approve, budget_request_submit
from tenants.models import ApiKey, Tenant, Workload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def var_dir(tmp_path, settings):
    settings.VAR_DIR = tmp_path
    return tmp_path


def seed(*args: str) -> tuple[dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("seed_demo", *args, stdout=out, stderr=err)
    text = out.getvalue()
    return (json.loads(text) if "--json" in args else None), text + err.getvalue()


def test_a_second_run_changes_nothing_and_mints_no_key(var_dir):
    # given a seeded database
    first, _ = seed("--json", "--pool-url", "http://127.0.0.1:9/v1")
    assert ApiKey.objects.count() == 4
    assert stat.S_IMODE((var_dir / "demo-keys.json").stat().st_mode) == 0o600
    # and an admin's changes to a reservation, a price, the pool and a password
    chat = Reservation.objects.get(workload__slug="acme-chat", rank=0)
    chat.reserved_tpm, chat.ceiling_tpm = 61_000, 81_000
    chat.save()
    ModelPrice.objects.filter(model="sim-small", pool=None).update(input_per_million="0.2")
    InferencePool.objects.filter(slug="sim-pool").update(provider_rpm=700)
    admin = get_user_model().objects.get(username="admin")
    admin.set_password("changed-by-a-human")
    admin.save()
    # when it runs again
    second, notes = seed("--json", "--pool-url", "http://127.0.0.1:10/v1")
    # then every change survives, no key was minted and the JSON shows the same keys and the real numbers
    chat.refresh_from_db()
    assert (chat.reserved_tpm, chat.ceiling_tpm) == (61_000, 81_000)
    assert str(ModelPrice.objects.get(model="sim-small", pool=None).input_per_million) == "0.200000"
    pool = InferencePool.objects.get(slug="sim-pool")
    assert (pool.provider_rpm, pool.base_url) == (700, "http://127.0.0.1:9/v1")
    assert get_user_model().objects.get(username="admin").check_password("changed-by-a-human")
    assert ApiKey.objects.count() == 4
    assert {s: w["api_key"] for s, w in second["workloads"].items()} == \
        {s: w["api_key"] for s, w in first["workloads"].items()}
    assert second["workloads"]["acme-chat"]["reserved_tpm"] == 61_000
    # and each workload names its route, primary first: acme-chat spills over to sim-overflow
    assert second["workloads"]["acme-chat"]["pools"] == ["sim-pool", "sim-overflow"]
    assert second["workloads"]["globex-assistant"]["pools"] == ["sim-pool"]
    # and names its embeddings model, which every workload may call, priced per input token only
    assert second["embedding_model"] == "sim-embed"
    assert second["workloads"]["acme-chat"]["models"] == ["sim-embed", "sim-large", "sim-small"]
    assert second["workloads"]["globex-assistant"]["models"] == ["sim-embed", "sim-large", "sim-small"]
    embed_price = ModelPrice.objects.get(model="sim-embed", pool=None)
    assert (str(embed_price.input_per_million), str(embed_price.output_per_million)) == ("0.020000", "0.000000")
    overflow_price = ModelPrice.objects.get(model="sim-small", pool__slug="sim-overflow")
    assert overflow_price.input_per_million > ModelPrice.objects.get(model="sim-small", pool=None).input_per_million
    assert "created" not in notes and "minted" not in notes


def test_reset_restores_the_demo_and_says_what_it_overwrote(var_dir):
    seed("--pool-url", "http://127.0.0.1:9/v1")
    Reservation.objects.filter(workload__slug="acme-chat", rank=0).update(reserved_tpm=61_000)
    ModelPrice.objects.filter(model="sim-small", pool=None).update(input_per_million="0.2")
    _, notes = seed("--reset", "--pool-url", "http://127.0.0.1:9/v1")
    assert Reservation.objects.get(workload__slug="acme-chat", rank=0).reserved_tpm == 60_000
    assert str(ModelPrice.objects.get(model="sim-small", pool=None).input_per_million) == "0.150000"
    assert "overwrote reservation acme-chat: reserved_tpm 61000 -> 60000" in notes
    assert "overwrote price sim-small from 2026-01-01: input_per_million Decimal('0.200000') -> Decimal('0.150000')" in notes
    # and a reset of an untouched demo says so
    _, notes = seed("--reset", "--pool-url", "http://127.0.0.1:9/v1")
    assert "every demo object already had its demo values" in notes


def test_keys_are_minted_only_where_missing_or_when_asked(var_dir):
    first, _ = seed("--json")
    # a revoked demo key is replaced for that workload only
    ApiKey.objects.filter(workload__slug="acme-nightly").update(revoked_at="2026-01-02T00:00:00Z")
    second, notes = seed("--json")
    assert ApiKey.objects.count() == 5
    assert second["workloads"]["acme-nightly"]["api_key"] != first["workloads"]["acme-nightly"]["api_key"]
    assert second["workloads"]["acme-chat"]["api_key"] == first["workloads"]["acme-chat"]["api_key"]
    assert "minted a key for acme-nightly" in notes
    # --new-key mints one per demo workload; the old ones keep working
    third, _ = seed("--json", "--new-key")
    assert ApiKey.objects.count() == 9
    assert third["workloads"]["acme-chat"]["api_key"] != first["workloads"]["acme-chat"]["api_key"]
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == 8


def test_if_empty_seeds_nothing_into_a_used_database(var_dir):
    Tenant.objects.create(name="Someone", slug="someone")
    data, notes = seed("--json", "--if-empty")
    assert data["workloads"] == {}
    assert not Workload.objects.exists() and not ApiKey.objects.exists()
    assert "seeded nothing" in notes


def _delete_sluice_keys(redis_client) -> None:
    doomed = [k for k in redis_client.scan_iter(match="sluice:*", count=1000) if k != "sluice:workers:ready"]
    if doomed:
        redis_client.delete(*doomed)


def test_approved_numbers_survive_a_restart(platform, var_dir, redis_client):
    # given the demo, seeded the way make run seeds an empty database
    demo, _ = seed("--json", "--if-empty", "--follow-sim", "--pool-url", f"{platform.sim_url}/v1")
    api_key = demo["workloads"]["acme-chat"]["api_key"]
    # and an approved request for acme-chat: 70,000 reserved, 90,000 ceiling, 250 RPM
    workload = Workload.objects.get(slug="acme-chat")
    request = budget_request_submit(tenant=workload.tenant, user=get_user_model().objects.get(username="acme-dev"),
                                    pool=InferencePool.objects.get(slug="sim-pool"), workload=workload,
                                    reserved_tpm=70_000, ceiling_tpm=90_000, rpm=250, lend_fraction=0.5,
                                    justification="launch")
    budget_request_approve(request_id=request.pk, approver=get_user_model().objects.get(username="admin"))
    # when the platform restarts as make run restarts it: web down, Redis empty (make run's
    # embedded Redis keeps nothing), seed_demo --if-empty in a fresh process, web up
    platform.web.stop()
    _delete_sluice_keys(redis_client)
    connections.close_all()
    env = {**platform.env, "SLUICE_VAR_DIR": str(var_dir)}
    seeded = subprocess.run([sys.executable, "manage.py", "seed_demo", "--json", "--if-empty", "--follow-sim",
                             "--pool-url", f"{platform.sim_url}/v1"], env=env, capture_output=True, text=True,
                            timeout=60, cwd=os.getcwd())
    assert seeded.returncode == 0, seeded.stderr
    platform.start_web()
    # then the database, Redis's bucket config and the response headers all say 90,000
    after = json.loads(seeded.stdout)["workloads"]["acme-chat"]
    assert (after["api_key"], after["reserved_tpm"], after["ceiling_tpm"], after["rpm"]) == (api_key, 70_000, 90_000, 250)
    reservation = Reservation.objects.get(workload=workload, pool__slug="sim-pool")
    assert (reservation.reserved_tpm, reservation.ceiling_tpm, reservation.rpm) == (70_000, 90_000, 250)
    config = redis_client.hgetall(admission_keys.pool_config(reservation.pool_id))
    assert float(config[f"{workload.id}.E.tok.rate"]) == pytest.approx(90_000 / 60_000)
    assert float(config[f"{workload.id}.Q.tok.rate"]) == pytest.approx(35_000 / 60_000)
    response = httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"},
                          json={"model": "sim-small", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Hello after the restart"}]})
    assert response.status_code == 200, response.text
    assert response.headers["x-ratelimit-limit-tokens"] == "90000"
    assert response.headers["x-ratelimit-limit-requests"] == "250"
    assert "created" not in seeded.stderr and "minted" not in seeded.stderr
