"""Writing reservations (and the pool limits they are checked against): every
path, Django admin, approvals, expiry and the seed commands, goes through
here.

Approved reservations on a pool never sum above its admission budget. Two
writers that each check the sum and then save could both pass and together
exceed it, so a write locks the pool's row (``SELECT ... FOR UPDATE``) first,
then re-reads the pool and re-checks the headroom (``Reservation.clean``),
then saves, all in one transaction: writers on one pool run one after the
other and each sees the last one's reservation. A write locks exactly one
pool (the one the reservation takes headroom from; a reservation leaving a
pool only frees some) or, deleting several, its pools in id order, so no two
writers can deadlock on pool locks (budget_requests.py takes the same one
lock first)."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from django.db import transaction
from django.utils import timezone

from budgets.admission.pool_config import pool_config_push_on_commit
from budgets.models import InferencePool, Reservation, ReservationVersion


# Where the history of a reservation written before versions were kept starts.
HISTORY_START = datetime(2000, 1, 1, tzinfo=dt_timezone.utc)


def _version_baseline(*, reservation_id: int | None) -> None:
    """Before the first recorded change of a reservation that predates the
    history, record what it held until now, from the start of time: the best
    knowledge there is, and better than drawing no line at all."""
    if reservation_id is None:
        return
    stored = Reservation.objects.filter(pk=reservation_id).first()
    if stored is None or ReservationVersion.objects.filter(workload_id=stored.workload_id,
                                                           pool_id=stored.pool_id).exists():
        return
    _version_write(reservation=stored, valid_from=HISTORY_START)


def _version_write(*, reservation: Reservation, deleted: bool = False, valid_from: datetime | None = None) -> None:
    """The reservation as it is from now on (charts draw history from these)."""
    ReservationVersion.objects.create(
        workload_id=reservation.workload_id, pool_id=reservation.pool_id, reserved_tpm=reservation.reserved_tpm,
        ceiling_tpm=reservation.ceiling_tpm, rpm=reservation.rpm, lend_fraction=reservation.lend_fraction,
        deleted=deleted, valid_from=valid_from or timezone.now(),
    )


def pool_lock(*, pool_id: int) -> InferencePool:
    """Lock the pool's row until the caller's transaction ends and return it
    as committed now. Must run inside a transaction (``transaction.atomic``)."""
    return InferencePool.objects.select_for_update().get(pk=pool_id)


def reservation_save(*, reservation: Reservation) -> Reservation:
    """Create or change a reservation under its pool's lock. Raises
    ValidationError (field errors, e.g. "Reservations on <pool> would sum
    to ... TPM, above its admission budget") when it does not fit."""
    if reservation.pool_id is None:
        reservation.full_clean()  # says which fields are missing
    with transaction.atomic():
        reservation.pool = pool_lock(pool_id=reservation.pool_id)
        previous_pool_id = (
            Reservation.objects.filter(pk=reservation.pk).values_list("pool_id", flat=True).first()
            if reservation.pk else None
        )
        reservation.full_clean()
        _version_baseline(reservation_id=reservation.pk)
        reservation.save()
        _version_write(reservation=reservation)
        if previous_pool_id and previous_pool_id != reservation.pool_id:
            # The workload left that pool: its buckets go from that pool's config too.
            pool_config_push_on_commit(pool_id=previous_pool_id)
    return reservation


def reservation_delete(*, reservation: Reservation) -> None:
    """Remove a reservation under its pool's lock (an approval running on the
    pool at the same time then sees the pool as it will be)."""
    with transaction.atomic():
        pool_lock(pool_id=reservation.pool_id)
        _version_baseline(reservation_id=reservation.pk)
        _version_write(reservation=reservation, deleted=True)
        reservation.delete()


def reservations_delete(*, reservations: list[Reservation]) -> int:
    """Remove several reservations in one transaction, their pools locked in id order."""
    with transaction.atomic():
        for pool_id in sorted({r.pool_id for r in reservations}):
            pool_lock(pool_id=pool_id)
        for reservation in reservations:
            _version_baseline(reservation_id=reservation.pk)
            _version_write(reservation=reservation, deleted=True)
            reservation.delete()
    return len(reservations)


def pool_save(*, pool: InferencePool) -> InferencePool:
    """Create or change a pool; a change of its limits is checked against its
    reservations (``InferencePool.clean``) under the pool's lock, so an
    approval cannot slip a reservation in between the check and the save."""
    with transaction.atomic():
        if pool.pk:
            pool_lock(pool_id=pool.pk)
        pool.full_clean()
        pool.save()
    return pool
