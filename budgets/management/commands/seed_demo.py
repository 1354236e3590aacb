"""Seed the demo platform: a simulated pool and a pricier simulated overflow
pool behind it, two tenants, workloads of each class with their slices,
prices, users.

What is there stays as it is. A run creates only what is missing and never
changes an existing pool, reservation, price or user: an approval made in the
UI, a price an admin set, a password someone changed all survive ``make run``
restarts and repeated seeding. ``--reset`` puts the demo values back and
says, line by line, what it overwrote.

Keys: the demo's plaintext keys live only in ``var/demo-keys.json`` (mode
600, outside the database and the repository; the database keeps hashes), so
``--json`` can print a usable key per workload on every run without minting
one. A key is minted for a demo workload only when it has no usable demo key
(it was just created, the file was lost, the key was revoked or expired), or
for every demo workload with ``--new-key`` (older keys keep working)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from budgets.models import InferencePool, ModelPrice, Reservation
from budgets.admission.pool_config import pool_config_push
from budgets.selectors.reservations import callable_models
from budgets.services.reservations import reservation_save
from tenants.models import Membership, Tenant, Workload
from tenants.selectors import api_key_lookup
from tenants.services import api_key_create

POOL = {
    "slug": "sim-pool",
    "name": "Simulated GPU pool",
    "served_models": ["sim-small", "sim-large", "sim-embed"],
    "provider_tpm": 200_000,
    "provider_rpm": 600,
    "headroom": 0.8,
    "burst_seconds": 15.0,
    "max_concurrency": 64,
    # The demo's pool is inference_sim: its test switches ("sim" in a body)
    # work where SLUICE_SIM_CONTROLS is on (make run turns it on).
    "is_simulator": True,
}

# Pay-as-you-go capacity behind sim-pool: its own simulator process under
# `make run`, serving sim-small only, at a higher price (OVERFLOW_PRICES).
OVERFLOW_POOL = {
    "slug": "sim-overflow",
    "name": "Simulated overflow pool (pay as you go)",
    "served_models": ["sim-small"],
    "provider_tpm": 100_000,
    "provider_rpm": 300,
    "headroom": 0.8,
    "burst_seconds": 15.0,
    "max_concurrency": 32,
    "is_simulator": True,
}

# Second slices (on the overflow pool), by workload: reserved, ceiling, lend, rpm.
OVERFLOW_SLICES = {
    "acme-chat": (20_000, 40_000, 0.0, 100),
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

# The demo's embeddings model (inference_sim serves it on /v1/embeddings):
# priced per input token, its output price 0.
EMBEDDING_MODEL = "sim-embed"
PRICES = [
    ("sim-small", Decimal("0.150000"), Decimal("0.600000")),
    ("sim-large", Decimal("2.500000"), Decimal("10.000000")),
    (EMBEDDING_MODEL, Decimal("0.020000"), Decimal("0")),
]
PRICES_FROM = (2026, 1, 1)
# The overflow pool's own prices (model, input, output per million).
OVERFLOW_PRICES = [
    ("sim-small", Decimal("0.600000"), Decimal("2.400000")),
]

# username, flags, group, tenant it is a member of
PEOPLE = [
    ("admin", {"is_staff": True, "is_superuser": True}, None, None),
    ("finance", {"is_staff": False, "is_superuser": False}, "Finance auditors", None),
    ("acme-dev", {"is_staff": False, "is_superuser": False}, None, "acme"),
    ("globex-dev", {"is_staff": False, "is_superuser": False}, None, "globex"),
]


def demo_logins_file() -> Path:
    return settings.VAR_DIR / "demo-logins.json"


def demo_keys_file() -> Path:
    return settings.VAR_DIR / "demo-keys.json"


def _read_json(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return {}


def _write_private(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` readable by its owner only (made 600 before
    any secret is in it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _group(name: str) -> Group:
    """The finance auditors' group, as tenants' migration 0003 makes it (a
    database flushed since, as in tests, has lost it)."""
    group, created = Group.objects.get_or_create(name=name)
    if created:
        group.permissions.add(Permission.objects.get(content_type__app_label="tenants", codename="audit_all_tenants"))
    return group


@dataclass
class SeedReport:
    created: list[str] = field(default_factory=list)
    overwritten: list[str] = field(default_factory=list)  # "<what>: <field> <old> -> <new>"
    keys_minted: list[str] = field(default_factory=list)


def _apply(obj, values: dict, *, label: str, report: SeedReport) -> bool:
    """Set ``values`` on ``obj``, noting each field that changes."""
    changed = False
    for name, value in values.items():
        old = getattr(obj, name)
        if old != value:
            report.overwritten.append(f"{label}: {name} {old!r} -> {value!r}")
            setattr(obj, name, value)
            changed = True
    return changed


def _ensure(found, *, new, values: dict, label: str, reset: bool, report: SeedReport, save):
    """A demo object: when missing, ``new()`` (unsaved) is ``save``d; with
    --reset its demo ``values`` are put back (each overwritten value
    reported) and it is ``save``d; otherwise it is left as it is."""
    if found is None:
        obj = new()
        save(obj)
        report.created.append(label)
        return obj
    if reset and _apply(found, values, label=label, report=report):
        save(found)
    return found


class Command(BaseCommand):
    help = ("Seed the demo pool, tenants, workloads, prices and logins where missing (never changing what exists); "
            "print a usable API key per demo workload.")

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print machine-readable JSON only.")
        parser.add_argument("--base-url", default=None, help="The gateway's public base URL (default from PORT).")
        parser.add_argument("--pool-url", default=None, help="The pool's base URL (default SLUICE_SIM_URL).")
        parser.add_argument("--overflow-url", default=None,
                            help="The overflow pool's base URL (default SLUICE_SIM_OVERFLOW_URL).")
        parser.add_argument("--reset", action="store_true",
                            help="Put the demo values back on existing demo objects, printing what was overwritten.")
        parser.add_argument("--new-key", action="store_true",
                            help="Mint a new key for every demo workload (older keys keep working).")
        parser.add_argument("--if-empty", action="store_true",
                            help="Seed only a database with no tenant and no pool (make run); else change nothing.")
        parser.add_argument("--follow-sim", action="store_true",
                            help="Point the demo simulator pools at --pool-url and --overflow-url even when they "
                                 "exist (make run: the simulators' ports can change between runs). Only their "
                                 "base_url, only if is_simulator.")

    # --- seeding --------------------------------------------------------------------------

    def _seed_pool(self, spec: dict, *, pool_url: str, reset: bool, report: SeedReport) -> InferencePool:
        values = {**spec, "base_url": pool_url}

        def save(pool: InferencePool) -> None:
            pool.full_clean()
            pool.save()

        return _ensure(InferencePool.objects.filter(slug=spec["slug"]).first(),
                       new=lambda: InferencePool(**values), values=values,
                       label=f"pool {spec['slug']}", reset=reset, report=report, save=save)

    def _follow_sim(self, *, urls: dict[str, str], report: SeedReport) -> None:
        """Where the local simulators listen is plumbing, not configuration:
        the demo simulator pools follow them; nothing else of a pool changes."""
        for slug, url in urls.items():
            pool = InferencePool.objects.filter(slug=slug, is_simulator=True).first()
            if pool is not None and _apply(pool, {"base_url": url}, label=f"pool {pool.slug}", report=report):
                pool.save(update_fields=["base_url"])

    def _seed_prices(self, *, overflow: InferencePool, reset: bool, report: SeedReport) -> None:
        effective_from = timezone.make_aware(timezone.datetime(*PRICES_FROM))
        table = [(None, *row) for row in PRICES] + [(overflow, *row) for row in OVERFLOW_PRICES]
        for pool, model, input_price, output_price in table:
            price, created = ModelPrice.objects.get_or_create(
                model=model, pool=pool, effective_from=effective_from,
                defaults={"input_per_million": input_price, "output_per_million": output_price},
            )
            label = f"price {model}" + (f" on {pool.slug}" if pool else "")
            if created:
                report.created.append(label)
            elif reset and _apply(price, {"input_per_million": input_price, "output_per_million": output_price},
                                  label=f"{label} from {effective_from:%Y-%m-%d}", report=report):
                price.save()

    def _seed_workloads(self, *, pool: InferencePool, overflow: InferencePool, reset: bool,
                        report: SeedReport) -> list[Workload]:
        workloads = []
        for tenant_slug, tenant_name, cost_center, specs in TENANTS:
            tenant_values = {"name": tenant_name, "cost_center": cost_center}
            tenant = _ensure(Tenant.objects.filter(slug=tenant_slug).first(),
                             new=lambda: Tenant(slug=tenant_slug, **tenant_values),
                             values=tenant_values, label=f"tenant {tenant_slug}", reset=reset, report=report,
                             save=lambda tenant: tenant.save())
            for slug, wclass, reserved, ceiling, lend, rpm, prompt_cap, max_cap, default, timeout in specs:
                values = {"tenant": tenant, "name": slug.replace("-", " ").title(), "workload_class": wclass,
                          "prompt_tokens_cap": prompt_cap, "max_tokens_cap": max_cap,
                          "max_tokens_default": default, "queue_timeout_s": timeout, "is_active": True}
                workload = _ensure(Workload.objects.filter(slug=slug).first(),
                                   new=lambda: Workload(slug=slug, **values), values=values,
                                   label=f"workload {slug}", reset=reset, report=report,
                                   save=lambda workload: workload.save())
                demo = {"pool": pool, "reserved_tpm": reserved, "ceiling_tpm": ceiling, "lend_fraction": lend,
                        "rpm": rpm}
                _ensure(Reservation.objects.filter(workload=workload, pool=pool).first(),
                        new=lambda: Reservation(workload=workload, rank=0, **demo),
                        values=demo, label=f"reservation {slug}", reset=reset, report=report,
                        save=lambda reservation: reservation_save(reservation=reservation))
                if slug in OVERFLOW_SLICES:
                    reserved, ceiling, lend, rpm = OVERFLOW_SLICES[slug]
                    second = {"pool": overflow, "rank": 1, "reserved_tpm": reserved, "ceiling_tpm": ceiling,
                              "lend_fraction": lend, "rpm": rpm}
                    _ensure(Reservation.objects.filter(workload=workload, pool=overflow).first(),
                            new=lambda: Reservation(workload=workload, **second),
                            values=second, label=f"overflow slice {slug}", reset=reset, report=report,
                            save=lambda reservation: reservation_save(reservation=reservation))
                workloads.append(workload)
        return workloads

    def _seed_people(self, *, reset: bool, report: SeedReport) -> dict[str, str]:
        """Demo logins, one per role. Passwords are random, made once per
        machine and kept in var/demo-logins.json (mode 600), never in the
        repository; an existing user's password is left alone unless --reset."""
        User = get_user_model()
        logins = _read_json(demo_logins_file())
        for username, flags, group, tenant_slug in PEOPLE:
            user = User.objects.filter(username=username).first()
            created = user is None
            if created:
                user = User(username=username, email=f"{username}@sluice.local", **flags)
                logins[username] = logins.get(username) or secrets.token_urlsafe(12)
                user.set_password(logins[username])
                user.save()
                report.created.append(f"user {username}")
            elif reset:
                changed = _apply(user, {**flags, "is_active": True}, label=f"user {username}", report=report)
                logins[username] = logins.get(username) or secrets.token_urlsafe(12)
                if not user.check_password(logins[username]):
                    user.set_password(logins[username])
                    report.overwritten.append(f"user {username}: password -> the one in {demo_logins_file()}")
                    changed = True
                if changed:
                    user.save()
            if group and (created or reset):
                user.groups.add(_group(group))
            if tenant_slug and (created or reset):
                Membership.objects.get_or_create(tenant=Tenant.objects.get(slug=tenant_slug), user=user)
        _write_private(demo_logins_file(), logins)
        return logins

    def _demo_keys(self, *, workloads: list[Workload], new_key: bool, mint: bool,
                   report: SeedReport) -> dict[str, str]:
        """A usable plaintext key per demo workload, from var/demo-keys.json;
        minted where there is none (``mint``) or for all with ``new_key``."""
        stored = _read_json(demo_keys_file())
        keys: dict[str, str] = {}
        for workload in workloads:
            raw = stored.get(workload.slug)
            usable = raw is not None and not new_key and (found := api_key_lookup(raw_key=raw)) is not None \
                and found.workload_id == workload.id
            if usable:
                keys[workload.slug] = raw
            elif mint or new_key:
                keys[workload.slug] = api_key_create(workload=workload, name="demo").raw_key
                report.keys_minted.append(workload.slug)
        if report.keys_minted:
            _write_private(demo_keys_file(), {**stored, **keys})
        return keys

    # --- the command ------------------------------------------------------------------------

    def handle(self, *args, **options):
        pool_url = options["pool_url"] or settings.SLUICE_SIM_URL
        overflow_url = options["overflow_url"] or settings.SLUICE_SIM_OVERFLOW_URL
        report = SeedReport()
        empty = not Tenant.objects.exists() and not InferencePool.objects.exists()
        seed = empty or not options["if_empty"]
        with transaction.atomic():
            if seed:
                pool = self._seed_pool(POOL, pool_url=pool_url, reset=options["reset"], report=report)
                overflow = self._seed_pool(OVERFLOW_POOL, pool_url=overflow_url, reset=options["reset"], report=report)
                self._seed_prices(overflow=overflow, reset=options["reset"], report=report)
                self._seed_workloads(pool=pool, overflow=overflow, reset=options["reset"], report=report)
                logins = self._seed_people(reset=options["reset"], report=report)
            else:
                logins = _read_json(demo_logins_file())
            if options["follow_sim"] and not options["reset"]:
                self._follow_sim(urls={POOL["slug"]: pool_url, OVERFLOW_POOL["slug"]: overflow_url}, report=report)
            demo_slugs = [spec[0] for _, _, _, specs in TENANTS for spec in specs]
            workloads = list(Workload.objects.filter(slug__in=demo_slugs).select_related("tenant")
                             .prefetch_related("slices__pool"))
            workloads.sort(key=lambda w: demo_slugs.index(w.slug))
            keys = self._demo_keys(workloads=workloads, new_key=options["new_key"], mint=seed, report=report)
        for pool in InferencePool.objects.filter(reservations__workload__in=workloads).distinct():
            pool_config_push(pool=pool)
        info = {}
        for workload in workloads:
            slices = sorted(workload.slices.all(), key=lambda s: (s.rank, s.id))
            reservation = slices[0] if slices else None  # the primary
            info[workload.slug] = {
                "api_key": keys.get(workload.slug), "class": workload.workload_class, "tenant": workload.tenant.slug,
                "reserved_tpm": reservation.reserved_tpm if reservation else 0,
                "ceiling_tpm": reservation.ceiling_tpm if reservation else 0,
                "lend_fraction": reservation.lend_fraction if reservation else 0.0,
                "rpm": reservation.rpm if reservation else 0,
                "prompt_tokens_cap": workload.prompt_tokens_cap, "max_tokens_cap": workload.max_tokens_cap,
                "pool": reservation.pool.slug if reservation else None,
                # Its route: every pool it holds a slice of, primary first.
                "pools": [s.pool.slug for s in slices],
                # What it may call (the API's /v1/models and admission agree).
                "models": list(callable_models(workload=workload, slices=slices)),
            }
        base_url = options["base_url"] or f"http://127.0.0.1:{settings.PORT}/v1"
        # With --json, stdout is the JSON alone; what changed goes to stderr.
        notes = self.stderr if options["json"] else self.stdout
        if not seed:
            notes.write("The database already holds tenants or pools: seeded nothing (seed_demo adds what is missing).")
        for line in report.created:
            notes.write(f"created {line}")
        for line in report.overwritten:
            notes.write(f"overwrote {line}")
        if options["reset"] and not report.overwritten:
            notes.write("reset: every demo object already had its demo values.")
        for slug in report.keys_minted:
            notes.write(f"minted a key for {slug} (kept in {demo_keys_file()})")
        if options["json"]:
            self.stdout.write(json.dumps({"base_url": base_url, "embedding_model": EMBEDDING_MODEL, "workloads": info},
                                         indent=2))
            return
        self.stdout.write(f"Demo pools {POOL['slug']} and {OVERFLOW_POOL['slug']} (overflow), {len(info)} workloads.")
        for slug, item in info.items():
            self.stdout.write(f"  {slug:18s} {item['class']:12s} key {item['api_key'] or '(none: --new-key mints one)'}")
        for username, password in logins.items():
            self.stdout.write(f"Login: {username} / {password}")

