"""Selectors that read rejections: flushed rows from the database with the
minutes still pending in Redis laid over them, so a rejection shows on the
pages at once and the database is written only in batches."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone

from tenants.models import Workload

from budgets.models import InferencePool
from budgets.models import RejectionSample, RejectionStat
from budgets.ledger.rejections import NO_POOL, rejections_pending


def _pool_ids() -> list[int]:
    return [NO_POOL, *InferencePool.objects.values_list("id", flat=True)]


def _minute(dt: datetime) -> datetime:
    return dt.astimezone(dt_timezone.utc).replace(second=0, microsecond=0)


def rejections_by_minute(*, since: datetime, pool: InferencePool | None = None,
                         workload_ids: set[int] | None = None) -> dict[datetime, dict[str, int]]:
    """Rejections per minute and reason from ``since`` on, for one pool or for
    some workloads."""
    stats = RejectionStat.objects.filter(minute__gte=_minute(since))
    if pool is not None:
        stats = stats.filter(pool=pool)
    if workload_ids is not None:
        stats = stats.filter(workload_id__in=workload_ids)
    per_key: dict[tuple[datetime, int, str], int] = {}
    for minute, wid, reason, count in stats.values_list("minute", "workload_id", "reason", "count"):
        per_key[(minute, wid, reason)] = count
    pending = rejections_pending(pool_ids=[pool.id] if pool is not None else _pool_ids(), since=since,
                                 workload_ids=workload_ids)
    per_key.update(pending.counts)  # Redis holds the full, newest count of a pending minute
    out: dict[datetime, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (minute, _wid, reason), count in per_key.items():
        out[minute][reason] += count
    return out


def rejection_totals(*, workload_ids: set[int], since: datetime) -> dict[tuple[int, str], int]:
    """Rejections per (workload, reason) from ``since`` on."""
    per_key: dict[tuple[datetime, int, str], int] = {}
    rows = RejectionStat.objects.filter(minute__gte=_minute(since), workload_id__in=workload_ids)
    for minute, wid, reason, count in rows.values_list("minute", "workload_id", "reason", "count"):
        per_key[(minute, wid, reason)] = count
    per_key.update(rejections_pending(pool_ids=_pool_ids(), since=since, workload_ids=workload_ids).counts)
    totals: dict[tuple[int, str], int] = defaultdict(int)
    for (_minute_at, wid, reason), count in per_key.items():
        totals[(wid, reason)] += count
    return dict(totals)


@dataclass(frozen=True)
class RejectionExample:
    at: datetime
    workload_id: int
    workload_slug: str
    reason: str
    estimated_tokens: int
    retry_after_ms: int | None
    message: str = ""

    @property
    def retry_after_s(self) -> float | None:
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000


def rejection_examples(*, workload_ids: set[int], since: datetime, limit: int = 20) -> list[RejectionExample]:
    """The most recent sampled rejections of the workloads."""
    slugs = dict(Workload.objects.filter(pk__in=workload_ids).values_list("id", "slug"))
    seen: set[str] = set()
    examples: list[RejectionExample] = []
    pending = rejections_pending(pool_ids=_pool_ids(), since=since, workload_ids=workload_ids)
    for data in pending.samples:
        seen.add(data["id"])
        examples.append(RejectionExample(
            at=datetime.fromtimestamp(float(data["at"]), tz=dt_timezone.utc), workload_id=data["wid"],
            workload_slug=slugs.get(data["wid"], str(data["wid"])), reason=data["reason"],
            estimated_tokens=int(data.get("tokens") or 0), retry_after_ms=data.get("retry_after_ms"),
            message=str(data.get("message") or ""),
        ))
    rows = RejectionSample.objects.filter(workload_id__in=workload_ids, at__gte=since).order_by("-at")[: limit * 2]
    for row in rows:
        if row.sample_id in seen:
            continue
        examples.append(RejectionExample(
            at=row.at, workload_id=row.workload_id, workload_slug=slugs.get(row.workload_id, str(row.workload_id)),
            reason=row.reason, estimated_tokens=row.estimated_tokens, retry_after_ms=row.retry_after_ms,
            message=row.message,
        ))
    examples.sort(key=lambda e: e.at, reverse=True)
    return examples[:limit]

