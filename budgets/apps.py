from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    name = "budgets"
    verbose_name = "Budgets"

    def ready(self) -> None:
        from budgets import signals  # noqa: F401  (pushes config changes to Redis)
