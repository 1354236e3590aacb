"""Attempt throttles: how many failed sign-ins a user or a client address
may make, and how many unknown API keys an address may try, per window,
counted in Redis so every web process shares them (an attacker spreading
guesses over processes gains nothing). The /v1 key check
(gateway/web/auth.py) keeps its budget here; the sign-in views keep theirs
with them (llm_platform/login.py).

A sign-in attempt is *taken* before the password is checked and given back
when it was right, so concurrent guesses cannot overrun a limit. An API key
is checked first and only a failure is counted (a valid key behind an
address someone floods must still get in; gateway/web/auth.py). The client
address (request_client_address, the one helper for it) is REMOTE_ADDR
unless that is a trusted proxy (SLUICE_TRUSTED_PROXIES): believing
X-Forwarded-For from anyone would let every guess claim a fresh address,
which is also why uvicorn runs with --no-proxy-headers
(llm_platform/processes.py)."""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from dataclasses import dataclass

from django.conf import settings

from budgets.redis.scripts import LuaScript, ScriptCall
from gateway.core import keys

TAKE = LuaScript(__package__, "attempt_take.lua")
REFUND = LuaScript(__package__, "attempt_refund.lua")


@dataclass(frozen=True)
class AttemptTaken:
    allowed: bool
    retry_after_ms: int  # when refused: until the window ends


def _taken(raw) -> AttemptTaken:
    return AttemptTaken(allowed=bool(int(raw[0])), retry_after_ms=max(0, int(raw[1])))


def address_subject(address: str) -> str:
    """What an address is counted as: itself for IPv4, its /64 for IPv6 (one
    host usually holds a whole /64, and would otherwise get a fresh budget
    for each of its 2^64 addresses)."""
    parsed = _address(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed.ipv4_mapped or parsed) if isinstance(parsed, ipaddress.IPv6Address) else address


@dataclass(frozen=True)
class AttemptBudget:
    """``limit`` failures per ``window_s`` for one kind of subject (0: no
    limit); ``by_address``: subjects are client addresses."""

    kind: str  # 'login-user', 'login-address', 'api-key-address'
    limit: int
    window_s: int
    by_address: bool = False

    def counter_key(self, subject: str) -> str:
        if self.by_address:
            subject = address_subject(subject)
        # Digested: subjects are user input (a username can be anything).
        return keys.attempts(self.kind, hashlib.sha256(subject.encode("utf-8", "replace")).hexdigest()[:32])

    def take_call(self, subject: str) -> ScriptCall[AttemptTaken]:
        return ScriptCall(script=TAKE, keys=[self.counter_key(subject)],
                          args=[max(0, self.limit), max(1, self.window_s) * 1000], parse=_taken)

    def refund_call(self, subject: str) -> ScriptCall[int]:
        return ScriptCall(script=REFUND, keys=[self.counter_key(subject)], args=[], parse=int)


# Read from settings at each use, so a changed setting (or a test's) applies.
# The sign-in budgets sit with the sign-in views (llm_platform/login.py).
def api_key_address_budget() -> AttemptBudget:
    return AttemptBudget("api-key-address", settings.SLUICE_API_KEY_FAILURES_PER_ADDRESS,
                         settings.SLUICE_API_KEY_FAILURE_WINDOW_S, by_address=True)


@functools.lru_cache(maxsize=8)
def _networks(proxies: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(proxy, strict=False) for proxy in proxies)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None


def _trusted(address, networks) -> bool:
    return address is not None and any(address in network for network in networks)


def client_address(*, remote_addr: str, forwarded_for: str = "") -> str:
    """Who is calling. Behind trusted proxies, X-Forwarded-For is read from
    the right (each proxy appends the address it saw) and the first hop that
    is not a trusted proxy is the client; anything left of it was written by
    the client and proves nothing."""
    networks = _networks(tuple(settings.SLUICE_TRUSTED_PROXIES))
    nearest = _address(remote_addr or "")
    if not networks or not _trusted(nearest, networks):
        return remote_addr or "unknown"
    for hop in reversed([h for h in forwarded_for.split(",") if h.strip()]):
        address = _address(hop)
        if address is None:
            break  # garbage from the client: the last trusted hop is all we know
        if not _trusted(address, networks):
            return str(address)
        nearest = address
    return str(nearest)


def request_client_address(meta) -> str:
    """client_address for a Django request's META."""
    return client_address(remote_addr=meta.get("REMOTE_ADDR", ""), forwarded_for=meta.get("HTTP_X_FORWARDED_FOR", ""))
