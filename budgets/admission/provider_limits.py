"""Limits from the provider: the ``x-ratelimit-*`` headers every answer of
an OpenAI- or Azure-style pool carries (limit, remaining and reset, for
requests and for tokens), read before the provider has to refuse anything.

``provider_limits_parse`` turns the headers into numbers (anything
malformed is ignored: a header never fails a request), and
``provider_limits_record`` keeps them in the pool's capacity hash
(``provider_limits.lua``). Admission (``admit.lua``) then

* admits nothing the provider said no longer remains, answering its own
  429 ``provider_tpm`` / ``provider_rpm`` with a Retry-After equal to the
  provider's reset; a worker takes its call's share of that room as the
  call goes out, or waits for it (``provider_take.lua``), and
* runs the pool's buckets at the provider's current limit over the
  configured one (``prov_factor``), so a provider that halves its limits
  sheds Sluice's sheddable classes at once (capacity.lua), not after 429s.

A provider's own refusal (429) says more than its headers: its Retry-After
is when the refused call would fit. The headers' reset is when the window
has room for one more token or request, and from there the room is modelled
as refilling at the stated limit; a provider that counts a sliding window
frees room in lumps, as calls of a minute ago slide out, so a call can find
less room than the model gives it. Its refusal then states the small room
left and a reset of 0, and without the Retry-After every waiting call would
go again at once into the same window (``refusal_reset``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from budgets.admission import keys
from budgets.admission.capacity import capacity_signal
from budgets.redis.scripts import LuaScript, ScriptCall
from tenants.text_numbers import ascii_int

logger = logging.getLogger(__name__)

PROVIDER_LIMITS = LuaScript(__package__, "provider_limits.lua")
PROVIDER_TAKE = LuaScript(__package__, "provider_take.lua")

# How long the provider's stated limit steers the pool's rate after its last
# answer with headers: a minute, the window the limits are stated over.
PROVIDER_FACTOR_HOLD_MS = 60_000
# Loans and sheddable classes (batch, scheduled) leave this share of the
# provider's stated limit to protected work: what remains in the provider's
# window is first-come, and without it a batch flood would take the room an
# interactive workload's reservation (I2) needs.
PROVIDER_RESERVE_SHARE = 0.1
# The longest a refusal's Retry-After holds the provider's room
# (``ProviderLimits.refusal_reset``). A window near its limit frees room every
# few to a few hundred milliseconds as its calls slide out; one caller's
# refused call (a large one, say) must not close the room to every other
# caller for longer than this, while its own retry waits the full Retry-After.
REFUSAL_HOLD_MAX_MS = 1_000.0

_UNITS_MS = {"h": 3_600_000.0, "m": 60_000.0, "s": 1000.0, "ms": 1.0, "us": 0.001, "µs": 0.001, "ns": 0.000001}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")
_BARE_SECONDS = re.compile(r"\d+(?:\.\d+)?")
_MAX_MS = 24 * 3_600_000  # a reset further away than a day is not a rate limit's


def duration_ms(text: str | None) -> float | None:
    """Milliseconds of a reset as providers write it: Go durations (``6m0s``,
    ``1.5s``, ``20ms``, ``1h2m3s``) or bare seconds (``0.5``). None when it
    is missing or not one of those."""
    if text is None:
        return None
    text = text.strip()
    if not text or len(text) > 40:
        return None
    if _BARE_SECONDS.fullmatch(text):
        ms = float(text) * 1000
        return ms if ms <= _MAX_MS else None
    total, at = 0.0, 0
    for part in _DURATION_PART.finditer(text):
        if part.start() != at:
            return None
        total += float(part.group(1)) * _UNITS_MS[part.group(2)]
        at = part.end()
    if at != len(text) or at == 0 or total > _MAX_MS:
        return None
    return total


def _count(text: str | None) -> int | None:
    # ASCII digits only: a header read as latin-1 may hold '²', which
    # isdigit() accepts and int() refuses.
    return None if text is None else ascii_int(text.strip(), max_digits=15)


def retry_after_ms(headers: Mapping[str, str]) -> int | None:
    """An answer's ``retry-after-ms`` (Azure's, ours) or ``retry-after`` in
    seconds, as whole milliseconds; None when neither is a number (an
    HTTP date is not read)."""
    for name, scale in (("retry-after-ms", 1), ("retry-after", 1000)):
        value = headers.get(name)
        if isinstance(value, str) and value:
            try:
                ms = float(value) * scale
            except ValueError:
                continue
            if ms == ms and ms != float("inf"):  # not NaN or infinite
                return max(0, int(ms))
    return None


@dataclass(frozen=True)
class ProviderLimits:
    """One answer's headers; None where the answer said nothing usable."""

    limit_requests: int | None = None
    limit_tokens: int | None = None
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_ms: float | None = None
    reset_tokens_ms: float | None = None

    @property
    def empty(self) -> bool:
        return all(value is None for value in (self.limit_requests, self.limit_tokens, self.remaining_requests,
                                                self.remaining_tokens))

    def refusal_reset(self, *, retry_after_ms: int | None, tokens: int) -> ProviderLimits:
        """These limits as a refusal of a call of ``tokens`` states them: the
        dimension that refused it has no more room before the refusal's
        Retry-After, for at most REFUSAL_HOLD_MAX_MS. Requests when none
        remained; else tokens, when fewer remained than the call's and the
        call fits the limit at all (a call larger than the provider's whole
        limit never fits: its Retry-After says nothing of the room). What
        remains stays usable meanwhile by calls it fits."""
        if retry_after_ms is None:
            return self
        hold_ms = min(float(retry_after_ms), REFUSAL_HOLD_MAX_MS)
        if self.remaining_requests is not None and self.remaining_requests < 1:
            return replace(self, reset_requests_ms=max(self.reset_requests_ms or 0.0, hold_ms))
        if (self.remaining_tokens is not None and 0 < tokens and self.remaining_tokens < tokens
                and (self.limit_tokens is None or tokens <= self.limit_tokens)):
            return replace(self, reset_tokens_ms=max(self.reset_tokens_ms or 0.0, hold_ms))
        return self


def provider_limits_parse(headers: Mapping[str, str]) -> ProviderLimits:
    """The x-ratelimit-* headers of one answer (names case-insensitive, as
    httpx's headers are)."""
    def get(name: str) -> str | None:
        value = headers.get(name)
        return value if isinstance(value, str) else None

    return ProviderLimits(
        limit_requests=_count(get("x-ratelimit-limit-requests")),
        limit_tokens=_count(get("x-ratelimit-limit-tokens")),
        remaining_requests=_count(get("x-ratelimit-remaining-requests")),
        remaining_tokens=_count(get("x-ratelimit-remaining-tokens")),
        reset_requests_ms=duration_ms(get("x-ratelimit-reset-requests")),
        reset_tokens_ms=duration_ms(get("x-ratelimit-reset-tokens")),
    )


def _arg(value: float | None) -> str:
    return "" if value is None else str(value)


@dataclass(frozen=True)
class SentMark:
    """Where one call stands among the calls sent to its pool (provider_take.lua):
    calls and tokens sent up to and with it, and when it went (Redis clock, ms);
    ``tokens``: the call's own, as taken (0: not known, a mark read back from
    a held request's release)."""

    sent: int
    sent_tokens: int
    at_ms: float
    tokens: int = 0


@dataclass(frozen=True)
class ProviderTake:
    """A take's answer: how long to wait first (0.0: taken, go) and, when
    taken, the call's mark (for its answer's statement)."""

    wait_ms: float
    mark: SentMark | None = None


def _take_parse(raw: str, tokens: int = 0) -> ProviderTake:
    if raw.startswith("go "):
        _, sent, sent_tokens, at_ms = raw.split(" ")
        return ProviderTake(0.0, SentMark(int(sent), int(sent_tokens), float(at_ms), tokens))
    return ProviderTake(float(raw))


def provider_limits_record_call(*, pool_id: int, limits: ProviderLimits,
                                mark: SentMark | None = None) -> ScriptCall[tuple[bool, float | None]]:
    return ScriptCall(
        script=PROVIDER_LIMITS,
        keys=[keys.pool_capacity(pool_id), keys.pool_config(pool_id)],
        args=[_arg(limits.limit_requests), _arg(limits.limit_tokens), _arg(limits.remaining_requests),
              _arg(limits.remaining_tokens), _arg(limits.reset_requests_ms), _arg(limits.reset_tokens_ms),
              PROVIDER_FACTOR_HOLD_MS, PROVIDER_RESERVE_SHARE,
              *((mark.sent, mark.sent_tokens, mark.at_ms) if mark else ("", "", ""))],
        parse=lambda raw: (int(raw[0]) == 1, float(raw[1]) if raw[1] else None),
    )


def provider_limits_record(*, pool_id: int, headers: Mapping[str, str], mark: SentMark | None = None,
                           status: int = 200) -> ProviderLimits:
    """Keep what one answer's headers say about the provider's limits; when
    its stated limit moved, the shed scales follow at once. ``mark``: the
    call's, from its take (None: it went untaken, and its statement is taken
    as news of now). ``status`` 429: the provider refused the call, and its
    Retry-After holds the refusing dimension's room (``refusal_reset``)."""
    limits = provider_limits_parse(headers)
    if limits.empty:
        return limits
    if status == 429:
        limits = limits.refusal_reset(retry_after_ms=retry_after_ms(headers), tokens=mark.tokens if mark else 0)
    changed, _ = provider_limits_record_call(pool_id=pool_id, limits=limits, mark=mark).run()
    if changed:
        capacity_signal(pool_id=pool_id, event="recompute")
    return limits


def provider_take_call(*, pool_id: int, tokens: int, sheddable: bool = False) -> ScriptCall[ProviderTake]:
    """Take a call's share of the provider's stated room as it goes out, or
    learn how long to wait first. A sheddable call (a loan, batch or
    scheduled work) leaves PROVIDER_RESERVE_SHARE of the limit to protected work."""
    tokens = max(0, int(tokens))
    return ScriptCall(script=PROVIDER_TAKE, keys=[keys.pool_capacity(pool_id)], args=[tokens, 1 if sheddable else 0],
                      parse=lambda raw: _take_parse(raw, tokens))
