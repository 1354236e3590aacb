"""Selectors that read budgets."""

from __future__ import annotations

from tenants.models import Workload

from .models import Reservation


def reservation_of_workload(*, workload: Workload) -> Reservation | None:
    return Reservation.objects.select_related("pool").filter(workload=workload).first()
