"""Bucket config follows model edits within moments (admin, API, services):
the only thing these receivers do is schedule a push after commit. A spend
budget's hard cap is part of its pools' admission config too."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from budgets.admission.pool_config import pool_config_push_on_commit
from budgets.models import InferencePool, Reservation, SpendBudget


@receiver([post_save], sender=InferencePool)
def _pool_changed(sender, instance: InferencePool, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pk)


@receiver([post_save, post_delete], sender=Reservation)
def _reservation_changed(sender, instance: Reservation, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pool_id)


@receiver([post_save, post_delete], sender=SpendBudget)
def _spend_budget_changed(sender, instance: SpendBudget, **kwargs) -> None:
    if instance.workload_id:
        reservations = Reservation.objects.filter(workload_id=instance.workload_id)
    else:
        reservations = Reservation.objects.filter(workload__tenant_id=instance.tenant_id)
    for pool_id in set(reservations.values_list("pool_id", flat=True)):
        pool_config_push_on_commit(pool_id=pool_id)
