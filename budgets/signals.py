"""Bucket config follows model edits within moments (admin, API, services):
the only thing these receivers do is schedule a push after commit. A spend
budget's hard cap goes to its tenant's spend keys (the tenant's, not a
pool's: a tenant spends on several pools)."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from tenants.models import Workload

from budgets.admission.pool_config import pool_config_push_on_commit
from budgets.ledger.spend import spend_tenant_sync_on_commit
from budgets.models import InferencePool, Reservation, SpendBudget


@receiver([post_save], sender=InferencePool)
def _pool_changed(sender, instance: InferencePool, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pk)


@receiver([post_save, post_delete], sender=Reservation)
def _reservation_changed(sender, instance: Reservation, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pool_id)


@receiver([post_save, post_delete], sender=SpendBudget)
def _spend_budget_changed(sender, instance: SpendBudget, **kwargs) -> None:
    tenant_id = instance.tenant_id or Workload.objects.filter(pk=instance.workload_id).values_list(
        "tenant_id", flat=True).first()
    if tenant_id:
        spend_tenant_sync_on_commit(tenant_id=tenant_id)
