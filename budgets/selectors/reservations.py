"""Selectors that read budgets."""

from __future__ import annotations

from django.db.models import QuerySet

from tenants.models import Workload

from budgets.models import InferencePool, Reservation


def reservation_of_workload(*, workload: Workload) -> Reservation | None:
    return Reservation.objects.select_related("pool").filter(workload=workload).first()


def reservations_of_pool(*, pool: InferencePool) -> QuerySet[Reservation]:
    """Every tenant's reservations on the pool (platform admins only; views check the role)."""
    return Reservation.objects.filter(pool=pool).select_related("workload", "workload__tenant")
