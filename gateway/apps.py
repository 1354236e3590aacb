from django.apps import AppConfig
from django.conf import settings


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "Gateway"

    def ready(self) -> None:
        # Every Sluice process sets Django up (web, workers, beat, pacer,
        # manage.py): refuse to start without a secret key, with the reason
        # (reading it raises llm_platform/settings.py's SECRET_KEY_MISSING).
        settings.SECRET_KEY
        # The pool overview (budgets' pages) shows the lanes' live numbers,
        # which the gateway measures: hand budgets the function that reads
        # them, so budgets never imports gateway.
        from budgets.web.live_metrics import live_metrics_provider_set
        from gateway.core.metrics import pool_live_metrics

        live_metrics_provider_set(pool_live_metrics)
