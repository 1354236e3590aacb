"""API key material: generation and hashing. Keys are high-entropy random
strings, so one unsalted SHA-256 is enough to make a stolen table useless and
keeps lookup a single indexed equality."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "sk-sluice-"
CALLBACK_SECRET_PREFIX = "whsec_"
DISPLAY_PREFIX_LEN = len(KEY_PREFIX) + 4
# What the key form offers: days until a new key expires (0: never).
KEY_EXPIRY_DAYS = (0, 1, 7, 30, 90, 365)


def api_key_generate() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def api_key_hash(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def api_key_display_prefix(raw_key: str) -> str:
    return raw_key[:DISPLAY_PREFIX_LEN]


def callback_secret_generate() -> str:
    """A tenant's job-callback signing secret. Kept readable (unlike API
    keys): Sluice signs with it, and the tenant's members read it to verify."""
    return CALLBACK_SECRET_PREFIX + secrets.token_urlsafe(32)
