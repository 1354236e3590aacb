"""Setting a tenant's or a workload's monthly spend budget (platform admins;
views check the role)."""

from __future__ import annotations

from decimal import Decimal

from tenants.models import Tenant, Workload

from budgets.models import SpendBudget


def spend_budget_set(*, monthly_amount: Decimal, soft_threshold: float, hard_cap: bool,
                     tenant: Tenant | None = None, workload: Workload | None = None) -> SpendBudget:
    """Create or replace the budget of exactly one of ``tenant`` or
    ``workload``; returns it with its tenant and workload loaded."""
    if (tenant is None) == (workload is None):
        raise ValueError("Give exactly one of tenant or workload.")
    owner = {"tenant": tenant} if tenant is not None else {"workload": workload}
    budget, _ = SpendBudget.objects.update_or_create(
        **owner, defaults={"monthly_amount": monthly_amount, "soft_threshold": soft_threshold, "hard_cap": hard_cap},
    )
    return SpendBudget.objects.select_related("tenant", "workload", "workload__tenant").get(pk=budget.pk)
