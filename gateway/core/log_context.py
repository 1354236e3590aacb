"""What a log line is about: the request id, workload and lane of the request
being served, carried in a context variable so every line written while
serving it (by the view, a thread it hands work to, the worker's task) says
which request it belongs to without passing ids through every call.

The logging configuration (llm_platform/log_format.py) copies these fields
into each record. Pure Python: the logging setup imports it before Django's
apps are loaded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# One dict per request. asgiref's sync_to_async copies the context into its
# thread, and the copy refers to the same dict: what a thread annotates, the
# access log line written at the end of the request sees.
_fields: ContextVar[dict[str, Any] | None] = ContextVar("sluice_log_fields", default=None)


@contextmanager
def log_context(**fields: Any) -> Iterator[dict[str, Any]]:
    """Tag every log line written inside the block (nested blocks add to the
    outer one's fields without changing them)."""
    token = _fields.set({**(_fields.get() or {}), **fields})
    try:
        yield _fields.get()
    finally:
        _fields.reset(token)


def log_annotate(**fields: Any) -> None:
    """Add fields to the current block (no-op outside one)."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


def log_fields() -> dict[str, Any]:
    return _fields.get() or {}
