"""Template helpers of the web UI."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from decimal import ROUND_HALF_UP, Decimal

from django import template

from tenants.roles import user_role_label

from budgets.web.charts import human as human_number

register = template.Library()

_SECTIONS = {
    "tenants": ("tenant-list", "tenant-detail", "budget-request-new", "budget-request-detail"),
    "pools": ("pool-list", "pool-detail"),
    "review": ("review-list", "review-detail"),
    "finance": ("finance",),
    "log": ("request-log", "request-detail", "tenant-request-log", "tenant-request-detail"),
}


@register.simple_tag
def role_of(user) -> str:
    return user_role_label(user)


@register.simple_tag(takes_context=True)
def nav_section(context) -> str:
    match = getattr(context.get("request"), "resolver_match", None)
    name = match.url_name if match else ""
    for section, names in _SECTIONS.items():
        if name in names:
            return section
    return ""


@register.filter
def human(value) -> str:
    if value is None or value == "":
        return "—"
    return human_number(value)


@register.filter
def money(value, places: int = 2) -> str:
    """A Decimal with ``places`` decimals and thousands separators."""
    if value is None:
        return "—"
    quantum = Decimal(1).scaleb(-int(places))
    return f"{Decimal(value).quantize(quantum, rounding=ROUND_HALF_UP):,}"


@register.filter
def pct(value, places: int = 0) -> str:
    if value is None:
        return "—"
    return f"{float(value) * 100:.{int(places)}f}%"


@register.filter
def intcomma(value) -> str:
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


_UNITS = (("d", 86_400), ("h", 3_600), ("min", 60), ("s", 1))


def human_duration(seconds: float) -> str:
    """A wait as people read it: "0.4 s", "12 s", "5 min 3 s", "26 d 16 h":
    tenths only under 10 s, then the two largest whole units."""
    if seconds < 10:
        return f"{seconds:.1f} s".replace(".0 s", " s")
    whole, parts = int(round(seconds)), []
    for unit, size in _UNITS:
        if whole >= size or parts:
            parts.append((whole // size, unit))
            whole %= size
        if len(parts) == 2:
            break
    first, *rest = parts  # "1 h", not "1 h 0 min"
    return " ".join(f"{n} {unit}" for n, unit in [first, *(part for part in rest if part[0])])


@register.filter
def seconds(ms) -> str:
    """Milliseconds (a Retry-After) as a human duration."""
    if ms is None or ms == "":
        return "—"
    return human_duration(max(0, int(ms)) / 1000)


@register.filter
def duration(value) -> str:
    """Seconds (a batch plan's time to run) as a human duration."""
    if value is None or value == "":
        return "—"
    return human_duration(max(0.0, float(value)))


@register.filter
def get_item(mapping, key):
    if not isinstance(mapping, dict):
        return None
    return mapping.get(key)


@register.filter
def clock_ms(ms) -> str:
    """A Redis-clock timestamp (ms since the epoch) as a UTC time of day."""
    if not ms:
        return "—"
    return datetime.fromtimestamp(float(ms) / 1000, tz=dt_timezone.utc).strftime("%H:%M:%S UTC")


@register.filter
def ms(value) -> str:
    """Milliseconds as the pages show them (—: none, e.g. a rejection)."""
    if value is None or value == "":
        return "—"
    return f"{float(value):,.0f} ms"


@register.filter
def since_ms(at, start) -> float | None:
    """Milliseconds from ``start`` to ``at``."""
    if at is None or start is None:
        return None
    return (at - start).total_seconds() * 1000
