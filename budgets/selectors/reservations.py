"""Selectors that read budgets."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet

from tenants.models import Workload

from budgets.models import InferencePool, Reservation, ReservationVersion


def slices_of_workload(*, workload: Workload) -> list[Reservation]:
    """The workload's slices in route order (rank, then the order they were made)."""
    return list(Reservation.objects.select_related("pool").filter(workload=workload).order_by("rank", "id"))


def callable_models(*, workload: Workload, slices: list[Reservation]) -> tuple[str, ...]:
    """The models the workload may call: every model a pool of its route
    (``slices``) serves, active pools only, within its allowed models (none
    listed: any). Each model's own route has a primary (its lowest rank), so
    forbidding overflow never takes a model away."""
    allowed = set(workload.allowed_models or ())
    return tuple(sorted({model for s in slices if s.pool.is_active
                         for model in (s.pool.served_models or ()) if not allowed or model in allowed}))


def reservation_of_workload(*, workload: Workload) -> Reservation | None:
    """The workload's primary slice (the first of its route), if any."""
    return Reservation.objects.select_related("pool").filter(workload=workload).order_by("rank", "id").first()


def slice_of_workload_on_pool(*, workload: Workload, pool: InferencePool) -> Reservation | None:
    return Reservation.objects.select_related("pool").filter(workload=workload, pool=pool).first()


def reservations_of_pool(*, pool: InferencePool) -> QuerySet[Reservation]:
    """Every tenant's reservations on the pool (platform admins only; views check the role)."""
    return Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant")


@dataclass(frozen=True)
class ReservationAt:
    reserved_tpm: int
    ceiling_tpm: int


def reservation_lines(*, workload_ids: list[int], times: list[datetime],
                      current: dict[int, Reservation | list[Reservation]],
                      pool_id: int | None = None) -> dict[int, list[ReservationAt | None]]:
    """Each workload's reservation as it was at each of ``times`` (sorted):
    the sum of its slices then (only the slice on ``pool_id`` when given),
    each from ``ReservationVersion``, the last version of that slice written
    at or before that time (none before the first version, or after a
    delete; None when no slice was there). A slice with no version at all
    (it predates the history, or was written outside the services) is drawn
    at its current numbers throughout. ``current``: each workload's slices now."""
    versions: dict[tuple[int, int], list[ReservationVersion]] = defaultdict(list)
    if times:
        rows = ReservationVersion.objects.filter(workload_id__in=workload_ids)
        if pool_id is not None:
            rows = rows.filter(pool_id=pool_id)
        for version in rows.order_by("valid_from", "id"):
            versions[(version.workload_id, version.pool_id)].append(version)
    out: dict[int, list[ReservationAt | None]] = {}
    for wid in workload_ids:
        now = current.get(wid) or []
        now = [now] if isinstance(now, Reservation) else now
        lines: list[list[ReservationAt | None]] = []
        pools = {pid for (w, pid) in versions if w == wid}
        for slice_now in now:
            if (pool_id is None or slice_now.pool_id == pool_id) and slice_now.pool_id not in pools:
                lines.append([ReservationAt(slice_now.reserved_tpm, slice_now.ceiling_tpm) for _ in times])
        for pid in sorted(pools):
            history = versions[(wid, pid)]
            froms = [v.valid_from for v in history]
            points: list[ReservationAt | None] = []
            for at in times:
                index = bisect_right(froms, at) - 1
                version = history[index] if index >= 0 else None
                points.append(None if version is None or version.deleted
                              else ReservationAt(version.reserved_tpm, version.ceiling_tpm))
            lines.append(points)
        summed: list[ReservationAt | None] = []
        for i in range(len(times)):
            present = [line[i] for line in lines if line[i] is not None]
            summed.append(ReservationAt(sum(p.reserved_tpm for p in present), sum(p.ceiling_tpm for p in present))
                          if present else None)
        out[wid] = summed
    return out
