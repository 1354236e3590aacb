"""The /v1 endpoints that take the one door (docs/architecture.md, "One door
for every endpoint"): each adds its body shape (a request type with
``model``, ``stream``, ``stream_usage`` and ``sim``), its token count
(``estimate``) and its pool path; validation of what a caller may ask
(``request_check``), admission, the lane, the worker's call, settlement and
the ledger row are the same code for all. The endpoint travels in the
request's record, so the worker posts to its pool path and the ledger row
names it."""

from __future__ import annotations

from typing import Any, Protocol

from budgets.admission.estimation import Estimate
from budgets.models import UsageRecord

# The ledger's default: every row from before endpoints were recorded was one.
CHAT_COMPLETIONS = UsageRecord.CHAT_COMPLETIONS
COMPLETIONS = UsageRecord.COMPLETIONS
EMBEDDINGS = UsageRecord.EMBEDDINGS

# Each endpoint's path on the pool, relative to its base URL (which ends in /v1).
POOL_PATHS = {
    CHAT_COMPLETIONS: "chat/completions",
    COMPLETIONS: "completions",
    EMBEDDINGS: "embeddings",
}


def pool_path(endpoint: str) -> str:
    """Where the worker posts a request of ``endpoint`` (a record from before
    endpoints were recorded is a chat completion)."""
    return POOL_PATHS.get(endpoint or CHAT_COMPLETIONS, POOL_PATHS[CHAT_COMPLETIONS])


class ApiRequest(Protocol):
    """A validated /v1 body, whatever its endpoint."""

    endpoint: str
    model: str
    stream: bool
    stream_usage: bool
    sim: dict[str, Any] | None

    def estimate(self, ctx) -> Estimate:
        """Its tokens on ``ctx``'s pool, the workload's caps enforced (Rejected)."""

    def pool_payload(self, estimate: Estimate) -> dict[str, Any]:
        """What the pool receives."""
