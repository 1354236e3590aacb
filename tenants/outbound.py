"""Outbound webhooks of a tenant (job callbacks, alert webhooks): which URLs
Sluice will POST to, how a POST is signed with the tenant's secret, and the
POST itself, made to the address that was checked. Both senders use this one
guard and one signature (gateway/core/jobs/callbacks.py, budgets/alerts).

A webhook URL is chosen by a tenant, and the POST leaves from inside our
network: without checks it is a server-side request forgery tool (the
metadata service at 169.254.169.254, Redis on 127.0.0.1, anything on 10/8). So:

* only ``https`` (``http`` where SLUICE_CALLBACK_ALLOW_HTTP says so), no
  user:password@, no numeric host spellings other than a plain IP literal
  (``2130706433``, ``0x7f.1`` and ``127.1`` all mean 127.0.0.1 to the
  resolver);
* every address the host resolves to must be public (no private, loopback,
  link-local, multicast, reserved, unspecified or cloud-metadata address;
  IPv6 forms that embed an IPv4 address are judged by that address too);
  private and loopback receivers only where SLUICE_CALLBACK_ALLOW_PRIVATE
  says so, metadata never;
* checked when the URL is given (a 400 or a form error the tenant sees) and
  again when each attempt is sent: the host is resolved once, every address
  checked and the connection made to the checked address, with Host and TLS
  SNI still naming the host, so a DNS answer that changes in between
  (rebinding) cannot steer the POST anywhere unchecked.

Each attempt is signed with the tenant's callback secret:
``X-Sluice-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import random
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx
from django.conf import settings

SIGNATURE_HEADER = "X-Sluice-Signature"
MAX_URL_LENGTH = 1000

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance metadata services: refused even where private receivers are allowed.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
    "169.254.170.2",  # AWS ECS task metadata
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure WireServer (a public address)
))
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal"})
# Names that only mean something inside a network (RFC 6761, 6762, 8375 and
# cloud-internal zones); allowed only with private receivers.
INTERNAL_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa", ".lan", ".intranet",
                     ".corp")
NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")
HOST_PATTERN = re.compile(r"^[a-z0-9_-]{1,63}(\.[a-z0-9_-]{1,63})*$")
# A last label like these makes the resolver read the whole name as an IPv4
# address in a legacy spelling (inet_aton): decimal, octal or hex parts.
NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


class CallbackRefused(Exception):
    """A callback URL Sluice will not POST to. ``retryable``: it may work
    later (the host did not resolve), as opposed to a refused form or address."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True)
class CallbackTarget:
    """A checked callback URL: where to connect (``address``, one that passed
    the checks) and what to tell the server (``host_header``, ``sni_hostname``)."""

    url: str
    scheme: str
    host: str  # IDNA-encoded, lower case, no trailing dot; an IP literal as written
    port: int
    path_and_query: str
    address: str | None = None  # set once resolved and checked

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def pinned_url(self) -> str:
        """The URL with the checked address in place of the host."""
        address = f"[{self.address}]" if self.address and ":" in self.address else self.address
        return urlunsplit((self.scheme, f"{address}:{self.port}", self.path_and_query or "/", "", ""))

    @property
    def sni_hostname(self) -> str | None:
        """TLS server name (and certificate name): the host, unless it is an IP literal."""
        return None if _ip_literal(self.host) is not None else self.host


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4): routed to
    that IPv4 address, so judged as it."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def address_refusal(address: IPAddress, *, allow_private: bool) -> str | None:
    """Why ``address`` may not receive a callback, or None if it may."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        refusal = address_refusal(embedded, allow_private=allow_private)
        if refusal is not None:
            return refusal
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_loopback:
        return None if allow_private else "a loopback address"
    if address.is_reserved:
        return "a reserved address"
    if address.is_private or not address.is_global:
        return None if allow_private else "a private address"
    return None


def _host_refusal(host: str, *, allow_private: bool) -> str | None:
    if host in METADATA_NAMES:
        return "a cloud metadata host"
    if not HOST_PATTERN.match(host) or len(host) > 253:
        return "not a valid host name"
    if NUMERIC_LABEL.match(host.rsplit(".", 1)[-1]):
        # '2130706433', '127.1', '0x7f.0.0.1': an IP address in disguise.
        return "an IP address not written as a plain IP literal"
    if allow_private:
        return None
    if host == "localhost" or host.endswith(INTERNAL_SUFFIXES):
        return "an internal host name"
    if "." not in host:
        return "not a fully qualified domain name"
    return None


# Said with each refusal an operator's setting would lift, so whoever reads
# it knows the refusal is a deployment's choice and which switch it is.
ALLOW_PRIVATE_HINT = (" A platform operator can allow private, loopback and internal receivers with "
                      "SLUICE_CALLBACK_ALLOW_PRIVATE=true (for trusted networks only).")
ALLOW_HTTP_HINT = " A platform operator can allow plain http with SLUICE_CALLBACK_ALLOW_HTTP=true."


def callback_url_parse(*, url: object, field: str = "callback_url") -> CallbackTarget:
    """Check what can be checked without DNS: scheme, credentials, host
    spelling, an IP literal's address. Raises CallbackRefused."""
    allow_private = settings.SLUICE_CALLBACK_ALLOW_PRIVATE
    if not isinstance(url, str) or not url:
        raise CallbackRefused(f"'{field}' must be a URL string.")
    if len(url) > MAX_URL_LENGTH:
        raise CallbackRefused(f"'{field}' must be at most {MAX_URL_LENGTH} characters.")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F or ch == "\\" for ch in url):
        raise CallbackRefused(f"'{field}' must not contain spaces, control characters or backslashes.")
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError:
        raise CallbackRefused(f"'{field}' is not a valid URL.") from None
    scheme = parts.scheme.lower()
    allowed = {"https", "http"} if settings.SLUICE_CALLBACK_ALLOW_HTTP else {"https"}
    if scheme not in allowed:
        hint = ALLOW_HTTP_HINT if scheme == "http" else ""
        raise CallbackRefused(f"'{field}' must be an {' or '.join(sorted(allowed, reverse=True))} URL.{hint}")
    if "@" in parts.netloc:
        raise CallbackRefused(f"'{field}' must not carry a user name or password.")
    if not parts.hostname:
        raise CallbackRefused(f"'{field}' has no host.")
    if port == 0:
        raise CallbackRefused(f"'{field}' has no valid port.")
    literal = _ip_literal(parts.hostname)
    if literal is not None:
        host = str(literal)
        refusal = address_refusal(literal, allow_private=allow_private)
        lifted = refusal is not None and address_refusal(literal, allow_private=True) is None
    else:
        try:
            host = parts.hostname.rstrip(".").encode("idna").decode("ascii").lower()
        except UnicodeError:
            raise CallbackRefused(f"'{field}' has a host name that is not valid.") from None
        refusal = _host_refusal(host, allow_private=allow_private)
        lifted = refusal is not None and _host_refusal(host, allow_private=True) is None
    if refusal is not None:
        raise CallbackRefused(f"'{field}' must point to a public host; its host is {refusal}."
                              + (ALLOW_PRIVATE_HINT if lifted else ""))
    path_and_query = parts.path + (f"?{parts.query}" if parts.query else "")
    return CallbackTarget(url=url, scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80),
                          path_and_query=path_and_query)


def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver; tests patch
    this function to play a DNS server). Raises OSError when it does not."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0].split("%", 1)[0] for info in infos))


def callback_target_resolve(*, url: object, field: str = "callback_url") -> CallbackTarget:
    """The URL checked in full: parsed, its host resolved once and every
    address checked; the first is where to connect. Raises CallbackRefused."""
    target = callback_url_parse(url=url, field=field)
    literal = _ip_literal(target.host)
    if literal is not None:
        return CallbackTarget(**{**target.__dict__, "address": str(literal)})
    try:
        addresses = resolve_host(target.host, target.port)
    except (OSError, UnicodeError) as exc:
        raise CallbackRefused(f"'{field}' host {target.host} does not resolve ({exc}).", retryable=True) from exc
    if not addresses:
        raise CallbackRefused(f"'{field}' host {target.host} does not resolve.", retryable=True)
    allow_private = settings.SLUICE_CALLBACK_ALLOW_PRIVATE
    for text in addresses:
        address = ipaddress.ip_address(text)
        refusal = address_refusal(address, allow_private=allow_private)
        if refusal is not None:
            lifted = address_refusal(address, allow_private=True) is None
            raise CallbackRefused(f"'{field}' must point to a public host; {target.host} resolves to "
                                  f"{address}, {refusal}." + (ALLOW_PRIVATE_HINT if lifted else ""))
    return CallbackTarget(**{**target.__dict__, "address": addresses[0]})


def callback_url_check(*, url: object, field: str = "callback_url") -> str:
    """The submission-time check (raises CallbackRefused): everything that
    can be decided now, DNS included. Sending checks again."""
    return callback_target_resolve(url=url, field=field).url


# --- signing ------------------------------------------------------------------------------


def callback_signature(*, secret: str, timestamp: int, body: bytes) -> str:
    """The X-Sluice-Signature value for ``body`` sent at ``timestamp``."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def callback_signature_verify(*, secret: str, header: str, body: bytes, now: float, tolerance_s: float = 300) -> bool:
    """What a receiver does: the signature matches and is recent (a replayed
    old delivery is refused)."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        fields.setdefault(name, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = callback_signature(secret=secret, timestamp=timestamp, body=body).rpartition("v1=")[2]
    return any(hmac.compare_digest(expected, candidate) for candidate in fields.get("v1", []))


def webhook_backoff_s(*, failed_attempt: int) -> float:
    """The wait after attempt ``failed_attempt`` (1-based) failed: base x
    2^(n-1), capped, then jittered over its upper half so receivers coming
    back from an outage are not hit by every retry at once."""
    ceiling = min(settings.SLUICE_CALLBACK_BACKOFF_CAP_S,
                  settings.SLUICE_CALLBACK_BACKOFF_BASE_S * 2 ** (failed_attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


# --- sending ------------------------------------------------------------------------------

OUTBOUND_USER_AGENT = "Sluice-Webhooks/1"


def outbound_post(target: CallbackTarget, *, body: bytes, headers: dict[str, str]) -> int:
    """POST to the checked address, naming the host in Host and TLS SNI (the
    certificate is verified against the host, not the address). No proxies
    from the environment and no redirects: either would send the request
    somewhere that was never checked. Returns the status code."""
    extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
    with httpx.Client(timeout=settings.SLUICE_CALLBACK_TIMEOUT_S, trust_env=False, follow_redirects=False) as client:
        request = client.build_request("POST", target.pinned_url, content=body, extensions=extensions,
                                       headers={**headers, "Host": target.host_header})
        # The body is not read: only the status matters, and a receiver
        # could answer with anything, of any size.
        response = client.send(request, stream=True)
        response.close()
        return response.status_code
