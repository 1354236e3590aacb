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
from budgets.web.dashboards import PoolOverview, WorkloadPanel
from budgets.selectors.pools import ApprovalPreview
from budgets.ledger.spend import SpendStatus


def workload_minute_chart(panel: WorkloadPanel) -> SafeString:
    thresholds = []
    if panel.reservation is not None:
        thresholds = [Threshold("reserved", panel.reservation.reserved_tpm, "#16a34a"),
                      Threshold("ceiling", panel.reservation.ceiling_tpm, "#dc2626")]
    return line_chart(
        labels=[f"{m:%H:%M}" for m in panel.minutes],
        series=[Series("tokens used / min", panel.tokens_per_minute, "#2563eb")],
        thresholds=thresholds, title=f"{panel.workload.slug}: tokens per minute, last hour", height=200,
    )


def workload_daily_chart(panel: WorkloadPanel) -> SafeString:
    thresholds = []
    if panel.reservation is not None:
        # A day at the reserved rate and at the ceiling, for scale.
        thresholds = [Threshold("reserved x 1440 min", panel.reservation.reserved_tpm * 1440, "#16a34a"),
                      Threshold("ceiling x 1440 min", panel.reservation.ceiling_tpm * 1440, "#dc2626")]
    return line_chart(
        labels=[f"{d:%m-%d}" for d in panel.days],
        series=[Series("tokens used / day", panel.tokens_per_day, "#7c3aed")],
        thresholds=thresholds, title=f"{panel.workload.slug}: tokens per day, last 30 days", height=200,
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
