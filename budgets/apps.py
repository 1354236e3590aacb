from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    name = "budgets"
    verbose_name = "Budgets"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (pushes config changes to Redis)
        from . import spend_signals  # noqa: F401  (spend caps are part of the pool config)
