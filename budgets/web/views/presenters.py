"""Charts for the pages, from the dashboards' data."""

from __future__ import annotations

from django.utils.safestring import SafeString

from budgets.web.charts import (
    Segment,
    Series,
    Threshold,
    capacity_bar,
    color_for,
    line_chart,
    progress_bar,
    reason_color,
    stacked_bar_chart,
)
from budgets.web.dashboards import PoolOverview, PoolRange, WorkloadPanel
from budgets.web.ranges import bucket_label
from budgets.selectors.pools import ApprovalPreview
from budgets.ledger.spend import SpendStatus


def workload_minute_chart(panel: WorkloadPanel) -> SafeString:
    series = [Series("tokens used / min", panel.tokens_per_minute, "#2563eb")]
    if panel.slices:
        # Reference lines (the sums over its slices) that do not stretch the
        # axis past a few times the usage (charts.DWARF_FACTOR): a quiet hour
        # still shows its usage.
        count = len(panel.minutes)
        series += [Series("reserved", [panel.reserved_tpm] * count, "#16a34a", dashed=True, scales=False),
                   Series("ceiling", [panel.ceiling_tpm] * count, "#dc2626", dashed=True, scales=False)]
    return line_chart(
        labels=[f"{m:%H:%M}" for m in panel.minutes], series=series,
        title=f"{panel.workload.slug}: tokens per minute, last hour (UTC)", height=200,
    )


def workload_range_chart(panel: WorkloadPanel, range_label: str) -> SafeString:
    """Usage over the chosen range as average tokens per minute in each
    bucket, so the reserved and ceiling lines (TPM, as they were at each
    time) are the same numbers at every scale. They do not stretch the axis
    past a few times the usage (usage stays visible; the legend says when a
    line is above the chart)."""
    minutes = BUCKET_MINUTES[panel.bucket]
    lines = panel.reservation_per_bucket
    series = [Series(f"tokens / min (avg per {panel.bucket})", [t / minutes for t in panel.tokens_per_bucket], "#7c3aed")]
    if any(line is not None for line in lines):
        series += [
            Series("reserved", [line.reserved_tpm if line else None for line in lines], "#16a34a", dashed=True,
                   scales=False),
            Series("ceiling", [line.ceiling_tpm if line else None for line in lines], "#dc2626", dashed=True,
                   scales=False),
        ]
    return line_chart(
        labels=[bucket_label(b, panel.bucket) for b in panel.buckets], series=series,
        title=f"{panel.workload.slug}: tokens per minute, {range_label} (UTC)", height=200,
    )


FULL_WIDTH = 1160  # charts that span the page get a wider canvas, so text keeps its size


def rejections_chart(minutes, per_reason: dict[str, list[int]], title: str) -> SafeString:
    return stacked_bar_chart(
        labels=[f"{m:%H:%M}" for m in minutes],
        stacks=[Series(reason, counts, reason_color(reason, i)) for i, (reason, counts) in enumerate(per_reason.items())],
        title=title, width=FULL_WIDTH, height=200, integer=True,
    )


def spend_bar(status: SpendStatus) -> SafeString:
    return progress_bar(value=float(status.month_to_date), maximum=float(status.budget.monthly_amount),
                        soft=status.budget.soft_threshold, projected=float(status.projected),
                        title=f"{status.budget.scope_label} month-to-date spend")


def pool_capacity_chart(overview: PoolOverview) -> SafeString:
    segments = [Segment(f"{w.reservation.workload.slug}", w.reservation.reserved_tpm, color_for(i))
                for i, w in enumerate(overview.workloads)]
    return capacity_bar(
        segments=segments, total=overview.headroom.admission_tpm, unit=" TPM",
        markers=[Threshold("effective capacity now", overview.effective_tpm, "#111827")],
        title=f"{overview.pool.slug}: reservations against the admission budget", width=FULL_WIDTH,
        height=74 + 16 * (len(segments) // 8),
    )


def approval_charts(preview: ApprovalPreview, label: str) -> tuple[SafeString, SafeString]:
    before = capacity_bar(
        segments=[Segment("reserved now", preview.headroom.reserved_tpm, "#6b7280")],
        total=preview.headroom.admission_tpm, unit=" TPM", title="The pool's reservations now",
    )
    after = capacity_bar(
        segments=[Segment("others", preview.after.reserved_tpm - _requested(preview), "#6b7280"),
                  Segment(label, _requested(preview), "#2563eb" if preview.fits else "#dc2626")],
        total=preview.headroom.admission_tpm, unit=" TPM", title="The pool's reservations if approved",
    )
    return before, after


def _requested(preview: ApprovalPreview) -> int:
    return preview.after.reserved_tpm - (preview.headroom.reserved_tpm - preview.current_reserved_tpm)


BUCKET_MINUTES = {"minute": 1, "hour": 60, "day": 1440}


def pool_range_chart(pool_range: PoolRange, admission_tpm: float) -> SafeString:
    """The pool's usage (average tokens per minute in each bucket) against the
    sum of its reservations as they were, and its admission budget now."""
    minutes = BUCKET_MINUTES[pool_range.time_range.bucket]
    return line_chart(
        labels=[bucket_label(b, pool_range.time_range.bucket) for b in pool_range.buckets],
        series=[Series(f"tokens / min (avg per {pool_range.time_range.bucket})",
                       [t / minutes for t in pool_range.tokens_per_bucket], "#2563eb"),
                Series("reserved (sum, as it was)", pool_range.reserved_per_bucket, "#16a34a", dashed=True,
                       scales=False),
                Series("admission budget (now)", [admission_tpm] * len(pool_range.buckets), "#dc2626",
                       dashed=True, scales=False)],
        title=f"Pool usage, {pool_range.time_range.label} (UTC)", width=FULL_WIDTH, height=220,
    )
