"""Seed a scenario's pool, tenant, workloads and reservations straight through
Django's models and services (no `manage.py shell`). Needs django.setup()
(bench.platform.Services.up does it)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class Seeded:
    workload_id: int
    slug: str
    api_key: str
    reserved_tpm: int
    ceiling_tpm: int
    rpm: int


def pool_create(*, slug: str, base_url: str, provider_tpm: int, provider_rpm: int, headroom: float = 0.8,
                burst_seconds: float = 15.0, max_concurrency: int = 1024):
    from budgets.models import InferencePool, ModelPrice
    from django.utils import timezone

    pool = InferencePool(name=slug, slug=slug, base_url=base_url, served_models=["sim-small", "sim-large"],
                         provider_tpm=provider_tpm, provider_rpm=provider_rpm, headroom=headroom,
                         burst_seconds=burst_seconds, max_concurrency=max_concurrency,
                         is_simulator=True)  # scenarios steer inference_sim per request ("sim")
    pool.full_clean()
    pool.save()
    for model, price_in, price_out in (("sim-small", "0.15", "0.60"), ("sim-large", "2.50", "10.00")):
        ModelPrice.objects.get_or_create(
            model=model, pool=None, effective_from=timezone.make_aware(timezone.datetime(2026, 1, 1)),
            defaults={"input_per_million": Decimal(price_in), "output_per_million": Decimal(price_out)})
    return pool


def pool_price_set(*, pool, model: str, input_per_million: str, output_per_million: str):
    """The model's price on this pool only (it overrides the model's general
    price there: an overflow provider costs more than the reserved pool)."""
    from budgets.models import ModelPrice
    from django.utils import timezone

    return ModelPrice.objects.create(model=model, pool=pool, input_per_million=Decimal(input_per_million),
                                     output_per_million=Decimal(output_per_million),
                                     effective_from=timezone.make_aware(timezone.datetime(2026, 1, 1)))


def slice_add(*, workload_id: int, pool, rank: int, reserved_tpm: int, ceiling_tpm: int, rpm: int,
              lend_fraction: float = 0.0) -> None:
    """A further slice of a seeded workload on another pool (``rank``: equal
    to the primary's 0 for a replica, above it for overflow)."""
    from budgets.models import Reservation
    from budgets.services.reservations import reservation_save

    reservation_save(reservation=Reservation(workload_id=workload_id, pool=pool, rank=rank, reserved_tpm=reserved_tpm,
                                             ceiling_tpm=ceiling_tpm, lend_fraction=lend_fraction, rpm=rpm))


def scaled_slice_add(*, scale, workload_id: int, pool, rank: int, reserved_tpm: int, ceiling_tpm: int,
                     rpm: int) -> None:
    """``slice_add`` with TPM/RPM per simulated minute (see scaled_pool)."""
    slice_add(workload_id=workload_id, pool=pool, rank=rank, reserved_tpm=round(scale.real_rate(reserved_tpm)),
              ceiling_tpm=round(scale.real_rate(ceiling_tpm)), rpm=round(scale.real_rate(rpm)))


def workload_create(*, pool, slug: str, workload_class: str, reserved_tpm: int, ceiling_tpm: int, rpm: int,
                    lend_fraction: float = 0.0, prompt_tokens_cap: int = 8_000, max_tokens_cap: int = 1_024,
                    max_tokens_default: int = 256, queue_timeout_s: float = 10.0, max_concurrency: int = 0) -> Seeded:
    from budgets.models import Reservation
    from budgets.services.reservations import reservation_save
    from tenants.models import Tenant, Workload
    from tenants.services import api_key_create

    tenant, _ = Tenant.objects.get_or_create(slug=f"{pool.slug}-tenant",
                                             defaults={"name": f"{pool.slug} tenant", "cost_center": "BENCH"})
    workload = Workload(tenant=tenant, name=slug, slug=slug, workload_class=workload_class,
                        prompt_tokens_cap=prompt_tokens_cap, max_tokens_cap=max_tokens_cap,
                        max_tokens_default=max_tokens_default, queue_timeout_s=queue_timeout_s)
    workload.full_clean()
    workload.save()
    reservation = Reservation(workload=workload, pool=pool, reserved_tpm=reserved_tpm, ceiling_tpm=ceiling_tpm,
                              lend_fraction=lend_fraction, rpm=rpm, max_concurrency=max_concurrency)
    reservation_save(reservation=reservation)
    key = api_key_create(workload=workload, name="bench")
    return Seeded(workload_id=workload.id, slug=slug, api_key=key.raw_key, reserved_tpm=reserved_tpm,
                  ceiling_tpm=ceiling_tpm, rpm=rpm)


@dataclass(frozen=True)
class Spine:
    """The path benches' platform: a zero-latency pool, a workload that is
    never over budget and one that almost always is."""
    pool: object
    open: Seeded
    tight: Seeded


def spine_setup(platform, *, name: str, seed: int) -> Spine:
    """Start a zero-latency simulator, seed the spine's pool and workloads,
    and start Sluice on them (scenarios 5 and 9 measure the same path)."""
    platform.start_sim(["--zero-latency", "--seed", str(seed)])
    pool = pool_create(slug=f"{name}-pool", base_url=f"{platform.sim_url}/v1", provider_tpm=50_000_000,
                       provider_rpm=2_000_000)
    open_wl = workload_create(pool=pool, slug=f"{name}-open", workload_class="interactive",
                              reserved_tpm=20_000_000, ceiling_tpm=30_000_000, rpm=1_000_000,
                              prompt_tokens_cap=2_000, max_tokens_cap=256, max_tokens_default=16)
    tight_wl = workload_create(pool=pool, slug=f"{name}-tight", workload_class="interactive",
                               reserved_tpm=1_000, ceiling_tpm=1_000, rpm=20, prompt_tokens_cap=100,
                               max_tokens_cap=16, max_tokens_default=16)
    config_push(pool)
    platform.start_sluice()
    return Spine(pool=pool, open=open_wl, tight=tight_wl)


def config_push(pool) -> None:
    from budgets.admission.pool_config import pool_config_push

    pool_config_push(pool=pool)


def ledger_rows(*, pool_id: int) -> list[dict]:
    """Every ledger row of the pool, oldest first (admission time)."""
    from budgets.models import UsageRecord

    rows = UsageRecord.objects.filter(pool_id=pool_id).order_by("created_at").values(
        "request_id", "created_at", "workload_id", "lane", "status", "borrowed", "estimated_input_tokens",
        "estimated_output_tokens", "actual_input_tokens", "actual_output_tokens", "queue_wait_ms", "upstream_ms",
        "total_ms", "attempts", "error")
    return [{**row, "created_at": row["created_at"].timestamp()} for row in rows]


def scaled_pool(*, scale, slug: str, base_url: str, provider_tpm: int, provider_rpm: int, headroom: float = 0.8,
                burst_seconds: float = 15.0, max_concurrency: int = 1024):
    """A pool whose limits are given per *simulated* minute and burst in
    simulated seconds: the gateway's buckets run on the wall clock, so rates
    are multiplied and durations divided by the time scale."""
    return pool_create(slug=slug, base_url=base_url, provider_tpm=round(scale.real_rate(provider_tpm)),
                       provider_rpm=round(scale.real_rate(provider_rpm)), headroom=headroom,
                       burst_seconds=scale.real_s(burst_seconds), max_concurrency=max_concurrency)


def scaled_workload(*, scale, pool, slug: str, workload_class: str, reserved_tpm: int, ceiling_tpm: int, rpm: int,
                    queue_timeout_s: float, **caps) -> Seeded:
    """A workload whose TPM/RPM are per simulated minute and queue timeout in
    simulated seconds (see scaled_pool). The returned Seeded keeps the
    simulated-time numbers."""
    seeded = workload_create(pool=pool, slug=slug, workload_class=workload_class,
                             reserved_tpm=round(scale.real_rate(reserved_tpm)),
                             ceiling_tpm=round(scale.real_rate(ceiling_tpm)), rpm=round(scale.real_rate(rpm)),
                             queue_timeout_s=scale.real_s(queue_timeout_s), **caps)
    return Seeded(workload_id=seeded.workload_id, slug=slug, api_key=seeded.api_key, reserved_tpm=reserved_tpm,
                  ceiling_tpm=ceiling_tpm, rpm=rpm)
