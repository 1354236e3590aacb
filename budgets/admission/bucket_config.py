"""From Django models to the bucket rates and capacities admission reads in
Redis. Rates are tokens (or requests) per millisecond; every bucket of a pool
holds ``burst_seconds`` of its own refill."""

from __future__ import annotations

from budgets.models import InferencePool, Reservation

MS_PER_MINUTE = 60_000.0

# When the pool's effective capacity shrinks, protected reservations are
# covered in this order: interactive first, scheduled shed first.
SHED_ORDER = {"interactive": 0, "batch": 1, "scheduled": 2}


def _bucket(fields: dict[str, float], name: str, per_minute: float, burst_seconds: float) -> None:
    fields[f"{name}.rate"] = per_minute / MS_PER_MINUTE
    fields[f"{name}.cap"] = per_minute * burst_seconds / 60.0


def pool_bucket_fields(pool: InferencePool, reservations: list[Reservation]) -> dict[str, float]:
    burst = pool.burst_seconds
    # The provider's limits as configured: the provider's own headers are
    # read against them (provider_limits.lua).
    fields: dict[str, float] = {"P.conc": pool.max_concurrency, "P.provider_tpm": pool.provider_tpm,
                                "P.provider_rpm": pool.provider_rpm}
    _bucket(fields, "P.tok", pool.headroom * pool.provider_tpm, burst)
    _bucket(fields, "P.req", pool.headroom * pool.provider_rpm, burst)
    if pool.provider_input_tpm:
        _bucket(fields, "P.in", pool.headroom * pool.provider_input_tpm, burst)
    if pool.provider_output_tpm:
        _bucket(fields, "P.out", pool.headroom * pool.provider_output_tpm, burst)
    for reservation in reservations:
        wid = reservation.workload_id
        protected = 1.0 - reservation.lend_fraction
        _bucket(fields, f"{wid}.Q.tok", protected * reservation.reserved_tpm, burst)
        _bucket(fields, f"{wid}.E.tok", reservation.ceiling_tpm, burst)
        _bucket(fields, f"{wid}.Q.req", protected * reservation.rpm, burst)
        _bucket(fields, f"{wid}.E.req", reservation.rpm, burst)
        fields[f"{wid}.conc"] = reservation.max_concurrency
        fields[f"{wid}.prio"] = SHED_ORDER.get(reservation.workload.workload_class, 0)
    return fields

