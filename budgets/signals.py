"""Bucket config follows model edits within moments (admin, API, services):
the only thing these receivers do is schedule a push after commit."""

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from .models import InferencePool, Reservation
from .services import pool_config_push_on_commit


@receiver([post_save], sender=InferencePool)
def _pool_changed(sender, instance: InferencePool, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pk)


@receiver([post_save, post_delete], sender=Reservation)
def _reservation_changed(sender, instance: Reservation, **kwargs) -> None:
    pool_config_push_on_commit(pool_id=instance.pool_id)

