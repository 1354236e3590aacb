"""Whole numbers read from what a caller typed (query parameters, form
fields, paging cursors): ASCII digits and nothing else. Python's int() also
takes other scripts' digits ('١٢', full-width '１２'), '_' separators, a sign
and surrounding spaces, and str.isdigit() is true for '²' and '①', which
int() then refuses: a ValueError past the check, a 500. Here, the lowest of
the apps, so that every app parses them the same way."""

from __future__ import annotations

import re

# 18 digits always fit a signed 64-bit column (PostgreSQL's bigint).
MAX_DIGITS = 18
_ASCII_DIGITS = re.compile(r"[0-9]+")


def ascii_int(text: str | None, *, max_digits: int = MAX_DIGITS) -> int | None:
    """``text`` as a non-negative integer, or None unless it is 1 to
    ``max_digits`` ASCII digits."""
    if not text or len(text) > max_digits or not _ASCII_DIGITS.fullmatch(text):
        return None
    return int(text)
