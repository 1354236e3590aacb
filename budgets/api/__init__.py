"""Management API (DRF) for workloads, pools, budget requests, spend budgets,
usage summaries and the ledger export."""
