"""A spend budget's hard cap is part of its pools' admission config: push the
affected pools after commit, as budgets/signals.py does for reservations."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from .models import Reservation
from .models_spend import SpendBudget
from .services import pool_config_push_on_commit


@receiver([post_save, post_delete], sender=SpendBudget)
def _spend_budget_changed(sender, instance: SpendBudget, **kwargs) -> None:
    if instance.workload_id:
        reservations = Reservation.objects.filter(workload_id=instance.workload_id)
    else:
        reservations = Reservation.objects.filter(workload__tenant_id=instance.tenant_id)
    for pool_id in set(reservations.values_list("pool_id", flat=True)):
        pool_config_push_on_commit(pool_id=pool_id)
