"""The time range a page shows (last hour, 24 h, 7 d, 30 d, or a custom
from/to), and the chart resolution that fits it.

Every time is UTC, shown as such ("UTC" next to every time a page prints):
one convention, whatever the browser's zone. A range is half-open,
[start, end); buckets are whole UTC minutes, hours or days."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

from budgets.selectors.usage import FIRST_DAY, LAST_DAY

PRESETS = {"1h": ("last hour", timedelta(hours=1)), "24h": ("last 24 h", timedelta(hours=24)),
           "7d": ("last 7 days", timedelta(days=7)), "30d": ("last 30 days", timedelta(days=30))}
DEFAULT_PRESET = "24h"
MAX_SPAN = timedelta(days=400)
BUCKETS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
# At most this many buckets on a chart: a range picks the finest unit that fits.
MAX_BUCKETS = 200
INPUT_FORMATS = ("%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S")
OUT_OF_BOUNDS = f"Choose times between {FIRST_DAY.year} and {LAST_DAY.year}."


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime
    preset: str  # a PRESETS key, or "custom"
    label: str

    @property
    def span(self) -> timedelta:
        return self.end - self.start

    @property
    def bucket(self) -> str:
        for name in ("minute", "hour"):
            if self.span / BUCKETS[name] <= MAX_BUCKETS:
                return name
        return "day"

    @property
    def bucket_minutes(self) -> int:
        return int(BUCKETS[self.bucket].total_seconds() // 60)

    def buckets(self) -> list[datetime]:
        """Every bucket start in the range, oldest first."""
        step = BUCKETS[self.bucket]
        first = bucket_floor(self.start, self.bucket)
        out = []
        at = first
        while at < self.end:
            out.append(at)
            at += step
        return out

    def query(self) -> str:
        """The range as query parameters (links keep it)."""
        if self.preset != "custom":
            return f"range={self.preset}"
        return f"range=custom&from={self.start:%Y-%m-%dT%H:%M}&to={self.end:%Y-%m-%dT%H:%M}"


def bucket_floor(at: datetime, bucket: str) -> datetime:
    at = at.astimezone(dt_timezone.utc)
    if bucket == "minute":
        return at.replace(second=0, microsecond=0)
    if bucket == "hour":
        return at.replace(minute=0, second=0, microsecond=0)
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


def bucket_label(at: datetime, bucket: str) -> str:
    return f"{at:%H:%M}" if bucket == "minute" else (f"{at:%m-%d %H:00}" if bucket == "hour" else f"{at:%m-%d}")


class RangeError(ValueError):
    """A range the caller typed that cannot be shown (the page says why, 400)."""


def _parse(raw: str, name: str) -> datetime:
    for fmt in INPUT_FORMATS:
        try:
            return datetime.strptime(raw.strip(), fmt).replace(tzinfo=dt_timezone.utc)
        except ValueError:
            continue
    raise RangeError(f"'{name}' must be a UTC date or date and time (YYYY-MM-DD or YYYY-MM-DDTHH:MM).")


def time_range_from(params, *, now: datetime, default: str = DEFAULT_PRESET) -> TimeRange:
    """The range a request's GET parameters name (``range``, ``from``, ``to``)."""
    preset = params.get("range") or default
    if preset in PRESETS:
        label, span = PRESETS[preset]
        return TimeRange(start=now - span, end=now, preset=preset, label=label)
    if preset != "custom":
        raise RangeError(f"Unknown range '{preset}': choose one of {', '.join(PRESETS)} or custom.")
    start = _parse(params.get("from") or "", "from")
    end = _parse(params.get("to") or "", "to") if params.get("to") else now
    # Bounded before any arithmetic: a day added to 9999-12-31 overflows.
    if not FIRST_DAY <= start.date() <= LAST_DAY or not FIRST_DAY <= end.date() <= LAST_DAY:
        raise RangeError(OUT_OF_BOUNDS)
    if len(params.get("to") or "") == 10:
        end += timedelta(days=1)  # a day given as "to" includes that day
    if end.year > LAST_DAY.year:
        raise RangeError(OUT_OF_BOUNDS)
    if end <= start:
        raise RangeError("'to' must be after 'from'.")
    if end - start > MAX_SPAN:
        raise RangeError(f"A range may span at most {MAX_SPAN.days} days.")
    return TimeRange(start=start, end=end, preset="custom",
                     label=f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC")
