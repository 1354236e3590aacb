"""The one domain error of the request path. The gateway turns it into an
OpenAI-shaped HTTP error; the management API into a DRF error."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RateLimitSnapshot:
    """What the workload's buckets held when admission answered: the
    ``x-ratelimit-remaining-*`` / ``x-ratelimit-reset-*`` headers."""

    remaining_tokens: int
    remaining_requests: int
    tokens_reset_ms: int
    requests_reset_ms: int


@dataclass
class Rejected(Exception):
    """A request refused before it reached the pool.

    ``reason`` is machine-readable (``workload_tpm``, ``pool_rpm``,
    ``queue_timeout``, ...); ``retry_after_ms`` is when a retry would succeed
    if nothing else consumed the budget meanwhile (None: retrying will not
    help)."""

    reason: str
    message: str
    status: int = 429
    retry_after_ms: int | None = None
    param: str | None = None
    error_type: str = "rate_limit_error"
    headers: dict[str, str] = field(default_factory=dict)
    # Set by admission when the buckets refused (None for other refusals).
    rate_limits: RateLimitSnapshot | None = None
    # The request's estimate (prompt + max_tokens), for rejection statistics.
    estimated_tokens: int = 0
    # The limits ``rate_limits`` is a snapshot against (the x-ratelimit-limit-*
    # numbers of the slice that refused), where the caller's own may differ:
    # a refusal chosen among several pools of a route.
    limits: dict[str, int] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def retry_after_s(self) -> int | None:
        if self.retry_after_ms is None:
            return None
        return max(1, math.ceil(self.retry_after_ms / 1000))


class BudgetUnavailable(Exception):
    """Redis, which holds the buckets, did not answer in time."""
