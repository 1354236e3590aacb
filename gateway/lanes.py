"""Which lane a request takes. Short interactive calls must never queue
behind long generations or batch floods: each lane is its own queue with its
own workers (DESIGN.md, Lanes)."""

from __future__ import annotations

from django.conf import settings

INTERACTIVE = "interactive"
INTERACTIVE_LONG = "interactive-long"
BATCH = "batch"
SCHEDULED = "scheduled"
LANES = (INTERACTIVE, INTERACTIVE_LONG, BATCH, SCHEDULED)


def lane_for(*, workload_class: str, estimated_tokens: int, borrowed: bool) -> str:
    if workload_class == "scheduled":
        return SCHEDULED
    # Borrowed admissions run on idle capacity: they take the batch lane and
    # are the first to wait when the pool is busy.
    if workload_class == "batch" or borrowed:
        return BATCH
    if estimated_tokens >= settings.SLUICE_LONG_REQUEST_TOKENS:
        return INTERACTIVE_LONG
    return INTERACTIVE
