"""budgets' models, one module per subject; importing them here registers
them with the app (``budgets.models.X`` is the one name to import)."""

from budgets.models.alerts import AlertDelivery, AlertEvent, AlertSettings
from budgets.models.pools import InferencePool, LedgerImmutable, ModelPrice, Reservation, ReservationVersion, UsageRecord
from budgets.models.requests import AuditImmutable, BudgetRequest, BudgetRequestEvent
from budgets.models.rollups import DailyUsage, RejectionSample, RejectionStat, RollupState
from budgets.models.spend import Notification, SpendBudget

__all__ = [
    "AlertDelivery", "AlertEvent", "AlertSettings", "AuditImmutable", "BudgetRequest", "BudgetRequestEvent", "DailyUsage", "InferencePool", "LedgerImmutable",
    "ModelPrice", "Notification", "RejectionSample", "RejectionStat", "Reservation", "ReservationVersion", "RollupState", "SpendBudget",
    "UsageRecord",
]
