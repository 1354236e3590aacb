"""Seed the demo platform, idempotently: one simulated pool, two tenants,
workloads of each class with reservations, prices, users. Each run issues
fresh API keys (older ones keep working)."""

from __future__ import annotations

import json
import secrets
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from budgets.models import InferencePool, ModelPrice, Reservation
from budgets.admission.pool_config import pool_config_push
from budgets.services.reservations import reservation_save
from tenants.models import Membership, Tenant, Workload
from tenants.services import api_key_create

POOL = {
    "slug": "sim-pool",
    "name": "Simulated GPU pool",
    "served_models": ["sim-small", "sim-large"],
    "provider_tpm": 200_000,
    "provider_rpm": 600,
    "headroom": 0.8,
    "burst_seconds": 15.0,
    "max_concurrency": 64,
    # The demo's pool is inference_sim: its test switches ("sim" in a body)
    # work where SLUICE_SIM_CONTROLS is on (make run turns it on).
    "is_simulator": True,
}

# (tenant slug, tenant name, cost center, [workloads])
TENANTS = [
    ("acme", "Acme Corp", "CC-1001", [
        # slug, class, reserved, ceiling, lend, rpm, prompt cap, max_tokens cap, default, queue timeout
        ("acme-chat", "interactive", 60_000, 80_000, 0.5, 200, 8_000, 1_024, 256, 10.0),
        ("acme-summarizer", "batch", 30_000, 50_000, 0.0, 100, 8_000, 2_048, 512, 60.0),
        ("acme-nightly", "scheduled", 10_000, 10_000, 0.0, 30, 1_500, 512, 256, 120.0),
    ]),
    ("globex", "Globex Inc", "CC-2002", [
        ("globex-assistant", "interactive", 30_000, 60_000, 0.0, 100, 8_000, 1_024, 256, 10.0),
    ]),
]

PRICES = [
    ("sim-small", Decimal("0.150000"), Decimal("0.600000")),
    ("sim-large", Decimal("2.500000"), Decimal("10.000000")),
]


class Command(BaseCommand):
    help = "Seed the demo tenants, workloads, pool and prices; print API keys."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print machine-readable JSON only.")
        parser.add_argument("--base-url", default=None, help="The gateway's public base URL (default from PORT).")
        parser.add_argument("--pool-url", default=None, help="The pool's base URL (default SLUICE_SIM_URL).")

    @transaction.atomic
    def _seed(self, pool_url: str) -> tuple[dict, dict[str, str]]:
        pool, _ = InferencePool.objects.update_or_create(slug=POOL["slug"], defaults={**POOL, "base_url": pool_url})
        for model, input_price, output_price in PRICES:
            ModelPrice.objects.get_or_create(
                model=model,
                effective_from=timezone.make_aware(timezone.datetime(2026, 1, 1)),
                defaults={"input_per_million": input_price, "output_per_million": output_price},
            )
        workloads: dict[str, dict] = {}
        for tenant_slug, tenant_name, cost_center, specs in TENANTS:
            tenant, _ = Tenant.objects.update_or_create(slug=tenant_slug, defaults={"name": tenant_name, "cost_center": cost_center})
            for slug, wclass, reserved, ceiling, lend, rpm, prompt_cap, max_cap, default, timeout in specs:
                workload, _ = Workload.objects.update_or_create(
                    slug=slug,
                    defaults={"tenant": tenant, "name": slug.replace("-", " ").title(), "workload_class": wclass,
                              "prompt_tokens_cap": prompt_cap, "max_tokens_cap": max_cap,
                              "max_tokens_default": default, "queue_timeout_s": timeout},
                )
                reservation = Reservation.objects.filter(workload=workload).first() or Reservation(workload=workload)
                for field, value in {"pool": pool, "reserved_tpm": reserved, "ceiling_tpm": ceiling,
                                     "lend_fraction": lend, "rpm": rpm}.items():
                    setattr(reservation, field, value)
                reservation_save(reservation=reservation)
                key = api_key_create(workload=workload, name="demo")
                workloads[slug] = {
                    "api_key": key.raw_key, "class": wclass, "tenant": tenant_slug, "reserved_tpm": reserved,
                    "ceiling_tpm": ceiling, "lend_fraction": lend, "rpm": rpm, "prompt_tokens_cap": prompt_cap,
                    "max_tokens_cap": max_cap, "pool": pool.slug,
                }
        logins = self._ensure_users()
        return workloads, logins

    def _ensure_users(self) -> dict[str, str]:
        """Demo logins, one per role: a platform admin, a finance auditor and a
        member of each tenant. Passwords are random, made once per machine and
        kept in var/demo-logins.json (mode 600), never in the repository."""
        from django.contrib.auth.models import Group

        User = get_user_model()
        logins_file = settings.VAR_DIR / "demo-logins.json"
        logins: dict[str, str] = json.loads(logins_file.read_text()) if logins_file.exists() else {}
        people = [
            ("admin", {"is_staff": True, "is_superuser": True}, None),
            ("finance", {}, "Finance auditors"),
            ("acme-dev", {}, None),
            ("globex-dev", {}, None),
        ]
        for username, flags, group in people:
            user, created = User.objects.get_or_create(username=username, defaults={"email": f"{username}@sluice.local", **flags})
            if created or username not in logins:
                logins[username] = logins.get(username) or secrets.token_urlsafe(12)
                user.set_password(logins[username])
                user.save()
            if group:
                user.groups.add(Group.objects.get(name=group))
        for tenant_slug in ("acme", "globex"):
            Membership.objects.get_or_create(tenant=Tenant.objects.get(slug=tenant_slug),
                                             user=User.objects.get(username=f"{tenant_slug}-dev"))
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
        logins_file.write_text(json.dumps(logins, indent=2) + "\n")
        logins_file.chmod(0o600)
        return logins

    def handle(self, *args, **options):
        pool_url = options["pool_url"] or settings.SLUICE_SIM_URL
        workloads, logins = self._seed(pool_url)
        pool_config_push(pool=InferencePool.objects.get(slug=POOL["slug"]))
        base_url = options["base_url"] or f"http://127.0.0.1:{settings.PORT}/v1"
        if options["json"]:
            self.stdout.write(json.dumps({"base_url": base_url, "workloads": workloads}, indent=2))
            return
        self.stdout.write(f"Seeded pool {POOL['slug']} and {len(workloads)} workloads.")
        for slug, info in workloads.items():
            self.stdout.write(f"  {slug:18s} {info['class']:12s} key {info['api_key']}")
        for username, password in logins.items():
            self.stdout.write(f"Login: {username} / {password}")
