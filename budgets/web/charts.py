"""Charts as inline SVG, built on the server: no JavaScript, no assets.

Each function returns a SafeString holding one ``<svg>``; every piece of
text in it is escaped. Axes start at zero (a budget chart that does not is
lying), values get a ``<title>`` so hovering shows the exact number."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Sequence

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#65a30d", "#db2777", "#4b5563", "#7c3aed"]
REASON_COLORS = {
    "workload_tpm": "#d97706", "workload_rpm": "#f59e0b", "pool_tpm": "#dc2626", "pool_rpm": "#ef4444",
    "pool_saturated": "#9333ea", "queue_timeout": "#2563eb", "spend_budget": "#db2777",
    "workload_concurrency": "#0891b2", "request_too_large": "#4b5563",
}

FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def color_for(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def reason_color(reason: str, index: int = 0) -> str:
    return REASON_COLORS.get(reason, color_for(index + 3))


def human(value: float | int | Decimal) -> str:
    """1234 -> 1.2k, 2_500_000 -> 2.5M, 0.000512 -> 0.000512 (four significant digits below 1)."""
    v = float(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= limit:
            return f"{v / limit:.1f}".rstrip("0").rstrip(".") + suffix
    if v == int(v):
        return str(int(v))
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.4g}"


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at least ``raw``."""
    if raw <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= raw * (1 - 1e-9):
            return step * magnitude
    return 10 * magnitude


def _nice_axis(value: float, *, integer: bool = False) -> tuple[float, int]:
    """An axis top at or above ``value`` with 4 or 5 round ticks, whichever
    wastes less of the plot."""
    best: tuple[float, int] | None = None
    for ticks in (4, 5):
        step = _nice_step(value / ticks) if value > 0 else 1.0
        if integer:
            step = max(1.0, math.ceil(step))
        top = step * ticks
        if best is None or top < best[0]:
            best = (top, ticks)
    return best


def _svg(width: int, height: int, label: str, body: list[str]) -> SafeString:
    return mark_safe(
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="{escape(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" preserveAspectRatio="xMinYMin meet">'
        f"<title>{escape(label)}</title>{''.join(body)}</svg>"
    )


def _y_axis(body: list[str], *, left: int, top: int, plot_w: int, plot_h: int, y_max: float, unit: str = "",
            ticks: int = 4) -> None:
    for i in range(ticks + 1):
        value = y_max * i / ticks
        y = top + plot_h - plot_h * i / ticks
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        body.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#6b7280" {FONT}>'
                    f"{escape(human(value))}{escape(unit)}</text>")


# Width of one character of FONT, generous: text placed by it stays inside
# the drawing (an SVG clips what passes its viewBox).
CHAR_W = 7
LEGEND_LINE = 16


def _legend(body: list[str], items: Sequence[tuple[str, str]], *, x: int, y: int, width: int) -> int:
    """Lays the legend out in lines of ``width``; returns the baseline of its
    last line, so the chart grows to hold every line (none clipped)."""
    cx = x
    for name, color in items:
        text_w = CHAR_W * len(name) + 22
        if cx + text_w > x + width and cx > x:
            cx = x
            y += LEGEND_LINE
        body.append(f'<rect x="{cx}" y="{y - 9}" width="10" height="10" rx="2" fill="{color}"/>'
                    f'<text x="{cx + 14}" y="{y}" fill="#374151" {FONT}>{escape(name)}</text>')
        cx += text_w
    return y


def _x_labels(body: list[str], *, labels: Sequence[str], x_of, y: float, width: int) -> None:
    """About six labels along the x axis, the last one always among them; a
    label that would pass the drawing's edge is anchored inside it, and one
    that would touch the last label gives way to it."""
    n = len(labels)
    indexes = list(range(0, n, max(1, n // 6)))
    if n and indexes[-1] != n - 1:
        indexes.append(n - 1)
    placed = []  # (text start, text end, x, anchor, label)
    for i in indexes:
        x, text_w = x_of(i), CHAR_W * len(labels[i])
        if x + text_w / 2 > width:
            x, anchor, start = min(x, width - 1), "end", min(x, width - 1) - text_w
        elif x - text_w / 2 < 0:
            anchor, start = "start", x
        else:
            anchor, start = "middle", x - text_w / 2
        placed.append((start, start + text_w, x, anchor, labels[i]))
    if len(placed) > 1 and placed[-2][1] + CHAR_W > placed[-1][0]:
        del placed[-2]
    for _start, _end, x, anchor, label in placed:
        body.append(f'<text x="{x:.1f}" y="{y}" text-anchor="{anchor}" fill="#6b7280" {FONT}>{escape(label)}</text>')


@dataclass(frozen=True)
class Series:
    """``values`` may hold None (no value then: the line breaks). ``dashed``
    draws a reference line (a reservation as it was at each time).
    ``scales=False``: the axis does not grow to fit it when it would dwarf
    the scaling series (more than ``DWARF_FACTOR`` x their peak), so usage
    stays visible; it is then clipped at the top and its legend says so."""

    name: str
    values: Sequence[float | None]
    color: str = ""
    dashed: bool = False
    scales: bool = True


DWARF_FACTOR = 4


@dataclass(frozen=True)
class Threshold:
    name: str
    value: float
    color: str = "#dc2626"


def line_chart(*, labels: Sequence[str], series: Sequence[Series], thresholds: Sequence[Threshold] = (),
               title: str, width: int = 640, height: int = 220, unit: str = "") -> SafeString:
    """Lines over a shared x axis, with horizontal dashed thresholds
    (a reservation, a ceiling) and dashed reference series."""
    left, right, top, bottom = 52, 12, 12, 44
    plot_w, plot_h = width - left - right, height - top - bottom

    def peak_of(s: Series) -> float:
        return max((v for v in s.values if v is not None), default=0)

    peak = max([peak_of(s) for s in series if s.scales] + [t.value for t in thresholds] + [0])
    usage_peak = peak
    for s in series:
        if not s.scales and (usage_peak == 0 or peak_of(s) <= DWARF_FACTOR * usage_peak):
            peak = max(peak, peak_of(s))
    y_max, ticks = _nice_axis(peak * 1.02)
    body: list[str] = []
    _y_axis(body, left=left, top=top, plot_w=plot_w, plot_h=plot_h, y_max=y_max, unit=unit, ticks=ticks)
    n = max(len(labels), 1)

    def x_at(i: int) -> float:
        return left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y_at(v: float) -> float:
        return top + plot_h - plot_h * (min(v, y_max) / y_max)

    _x_labels(body, labels=labels, x_of=x_at, y=top + plot_h + 14, width=width)
    for t in thresholds:
        y = y_at(t.value)
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="{t.color}" '
                    f'stroke-dasharray="5 4" stroke-width="1.5"><title>{escape(t.name)}: {escape(human(t.value))}</title></line>')
    legend = [(t.name, t.color) for t in thresholds]
    for index, s in enumerate(series):
        color = s.color or color_for(index)
        name = s.name
        if peak_of(s) > y_max:
            name = f"{s.name} (above the chart: up to {human(peak_of(s))}{unit})"
        legend.insert(index, (name, color))
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        run: list[str] = []
        # A value above the axis (only a non-scaling series has one) is not
        # drawn: a line pinned to the top edge would read as a real number.
        for i, v in enumerate([*s.values, None]):
            if v is not None and v <= y_max:
                run.append(f"{x_at(i):.1f},{y_at(v):.1f}")
                continue
            if len(run) == 1:  # a lone point still shows
                x, y = run[0].split(",")
                body.append(f'<line x1="{float(x) - 2:.1f}" y1="{y}" x2="{float(x) + 2:.1f}" y2="{y}" stroke="{color}" stroke-width="2"/>')
            elif run:
                body.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
            run = []
        if s.dashed:
            continue
        for i, v in enumerate(s.values):
            if v:
                body.append(f'<circle cx="{x_at(i):.1f}" cy="{y_at(v):.1f}" r="2.5" fill="{color}">'
                            f"<title>{escape(s.name)} {escape(labels[i] if i < len(labels) else '')}: {escape(human(v))}</title></circle>")
    last = _legend(body, legend, x=left, y=height - 8, width=plot_w)
    return _svg(width, max(height, last + 8), title, body)


def stacked_bar_chart(*, labels: Sequence[str], stacks: Sequence[Series], title: str, width: int = 640,
                      height: int = 200, unit: str = "", integer: bool = False) -> SafeString:
    """One bar per label, stacked by series (rejections per minute by reason)."""
    left, right, top, bottom = 44, 12, 12, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(len(labels), 1)
    totals = [sum(s.values[i] for s in stacks if i < len(s.values)) for i in range(len(labels))]
    y_max, ticks = _nice_axis(max(totals, default=0), integer=integer)
    body: list[str] = []
    _y_axis(body, left=left, top=top, plot_w=plot_w, plot_h=plot_h, y_max=y_max, unit=unit, ticks=ticks)
    slot = plot_w / n
    bar_w = min(max(1.0, slot * 0.8), 56.0)
    for i in range(len(labels)):
        y = top + plot_h
        for index, s in enumerate(stacks):
            value = s.values[i] if i < len(s.values) else 0
            if not value:
                continue
            h = plot_h * value / y_max
            y -= h
            body.append(f'<rect x="{left + slot * i + (slot - bar_w) / 2:.1f}" y="{y:.1f}" width="{bar_w:.1f}" '
                        f'height="{h:.1f}" fill="{s.color or color_for(index)}"><title>{escape(labels[i])} '
                        f"{escape(s.name)}: {escape(human(value))}</title></rect>")
    _x_labels(body, labels=labels, x_of=lambda i: left + slot * i + slot / 2, y=top + plot_h + 14, width=width)
    if not any(totals):
        body.append(f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
                    f'fill="#9ca3af" {FONT}>none</text>')
    last = _legend(body, [(s.name, s.color or color_for(i)) for i, s in enumerate(stacks)], x=left, y=height - 8,
                   width=plot_w)
    return _svg(width, max(height, last + 8), title, body)


def bar_chart(*, labels: Sequence[str], values: Sequence[float], title: str, width: int = 640, height: int = 200,
              color: str = "#2563eb", unit: str = "", integer: bool = False) -> SafeString:
    return stacked_bar_chart(labels=labels, stacks=[Series(title, values, color)], title=title, width=width,
                             height=height, unit=unit, integer=integer)


@dataclass(frozen=True)
class Segment:
    name: str
    value: float
    color: str = ""


def capacity_bar(*, segments: Sequence[Segment], total: float, title: str, markers: Sequence[Threshold] = (),
                 width: int = 640, height: int = 74, unit: str = "") -> SafeString:
    """One horizontal bar of ``total``: segments stacked from the left (each
    workload's reservation), the rest shown as unreserved; markers are
    vertical lines (effective capacity now)."""
    left, right, top = 8, 8, 8
    bar_h = 26
    plot_w = width - left - right
    scale_max = max(total, sum(s.value for s in segments), *[m.value for m in markers], 1)
    body: list[str] = [f'<rect x="{left}" y="{top}" width="{plot_w * total / scale_max:.1f}" height="{bar_h}" '
                       f'fill="#f3f4f6" stroke="#d1d5db"><title>unreserved: {escape(human(max(0, total - sum(s.value for s in segments))))}'
                       f"{escape(unit)}</title></rect>"]
    x = float(left)
    legend = []
    for index, s in enumerate(segments):
        w = plot_w * s.value / scale_max
        color = s.color or color_for(index)
        body.append(f'<rect x="{x:.1f}" y="{top}" width="{w:.1f}" height="{bar_h}" fill="{color}" stroke="#fff">'
                    f"<title>{escape(s.name)}: {escape(human(s.value))}{escape(unit)}</title></rect>")
        if w > 46:
            body.append(f'<text x="{x + 4:.1f}" y="{top + 17}" fill="#fff" {FONT}>{escape(human(s.value))}</text>')
        legend.append((s.name, color))
        x += w
    for m in markers:
        mx = left + plot_w * m.value / scale_max
        body.append(f'<line x1="{mx:.1f}" y1="{top - 4}" x2="{mx:.1f}" y2="{top + bar_h + 4}" stroke="{m.color}" '
                    f'stroke-width="2"><title>{escape(m.name)}: {escape(human(m.value))}{escape(unit)}</title></line>')
        legend.append((m.name, m.color))
    legend.append(("unreserved", "#e5e7eb"))
    last = _legend(body, legend, x=left, y=top + bar_h + 24, width=plot_w)
    return _svg(width, max(height, last + 8), title, body)


def progress_bar(*, value: float, maximum: float, soft: float | None = None, projected: float | None = None,
                 title: str, width: int = 320, height: int = 22) -> SafeString:
    """Month-to-date against a budget: green, amber past the soft threshold,
    red past the budget; a tick for the threshold, a hollow marker for the
    projected month end."""
    maximum = max(float(maximum), 1e-9)
    scale_max = max(maximum, float(projected or 0), float(value)) * 1.02
    fraction = float(value) / maximum
    color = "#dc2626" if fraction >= 1 else ("#d97706" if soft is not None and fraction >= soft else "#16a34a")
    w = width - 2
    body = [
        f'<rect x="1" y="4" width="{w * maximum / scale_max:.1f}" height="14" rx="3" fill="#f3f4f6" stroke="#d1d5db"/>',
        f'<rect x="1" y="4" width="{w * float(value) / scale_max:.1f}" height="14" rx="3" fill="{color}">'
        f"<title>{escape(title)}: {fraction:.0%} of budget</title></rect>",
    ]
    if soft is not None:
        sx = 1 + w * maximum * soft / scale_max
        body.append(f'<line x1="{sx:.1f}" y1="1" x2="{sx:.1f}" y2="21" stroke="#6b7280" stroke-dasharray="2 2">'
                    f"<title>soft threshold {soft:.0%}</title></line>")
    if projected is not None:
        px = 1 + w * float(projected) / scale_max
        body.append(f'<circle cx="{min(px, width - 5):.1f}" cy="11" r="4" fill="none" stroke="#111827" stroke-width="1.5">'
                    f"<title>projected month end: {escape(human(projected))}</title></circle>")
    return _svg(width, height, title, body)
