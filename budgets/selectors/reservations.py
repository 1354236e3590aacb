"""Selectors that read budgets."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet

from tenants.models import Workload

from budgets.models import InferencePool, Reservation, ReservationVersion


def reservation_of_workload(*, workload: Workload) -> Reservation | None:
    return Reservation.objects.select_related("pool").filter(workload=workload).first()


def reservations_of_pool(*, pool: InferencePool) -> QuerySet[Reservation]:
    """Every tenant's reservations on the pool (platform admins only; views check the role)."""
    return Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant")


@dataclass(frozen=True)
class ReservationAt:
    reserved_tpm: int
    ceiling_tpm: int


def reservation_lines(*, workload_ids: list[int], times: list[datetime],
                      current: dict[int, Reservation]) -> dict[int, list[ReservationAt | None]]:
    """Each workload's reservation as it was at each of ``times`` (sorted),
    from ``ReservationVersion``: the last version written at or before that
    time (None before the first version, or after a delete). A workload with
    no version at all (its reservation predates the history, or was written
    outside the services) is drawn at its current reservation throughout."""
    versions: dict[int, list[ReservationVersion]] = defaultdict(list)
    if times:
        rows = ReservationVersion.objects.filter(workload_id__in=workload_ids)
        for version in rows.order_by("valid_from", "id"):
            versions[version.workload_id].append(version)
    out: dict[int, list[ReservationAt | None]] = {}
    for wid in workload_ids:
        history = versions.get(wid)
        if not history:
            now = current.get(wid)
            line = ReservationAt(now.reserved_tpm, now.ceiling_tpm) if now is not None else None
            out[wid] = [line for _ in times]
            continue
        froms = [v.valid_from for v in history]
        points: list[ReservationAt | None] = []
        for at in times:
            index = bisect_right(froms, at) - 1
            version = history[index] if index >= 0 else None
            points.append(None if version is None or version.deleted
                          else ReservationAt(version.reserved_tpm, version.ceiling_tpm))
        out[wid] = points
    return out
