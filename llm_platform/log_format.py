"""How every Sluice process writes its log lines (settings.LOGGING uses these;
SLUICE_LOG_FORMAT picks one): JSON, one object per line, for log pipelines;
or plain text for a person at a terminal. Both carry the fields of the
request being served (gateway/core/log_context.py) and the ``extra`` fields
of the call, and both scrub secrets.

Secrets are kept out at the source (no header, body or key is ever logged);
the scrubbing here is the second line, for a library that logs more than it
should: bearer credentials, OpenAI-style keys (``sk-...``, Sluice's own keys
among them), passwords in URLs and the values handed in as ``secrets``
(DJANGO_SECRET_KEY, the metrics token) never reach a log file. Imports nothing of Django: logging is configured before the
apps are loaded."""

from __future__ import annotations

import json
import logging
import logging.config
import re
from datetime import datetime, timezone

from gateway.core.log_context import log_fields

# Attributes every LogRecord has: anything else on a record came from
# ``extra=`` or from the request's log context.
# uvicorn's color_message repeats the message with terminal colour codes.
_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName",
                                                                            "color_message"}
REDACTED = "[redacted]"
# (literal, pattern, replacement): a bearer credential, an OpenAI-style key,
# a URL's password. Every match of a pattern contains its literal (in the
# lowercased line for a case-blind pattern), so a line without it skips the
# pattern: most lines hold none of the three, and the patterns' scans were
# most of a line's formatting (the URL one backtracks at every word).
_CREDENTIALS = (
    ("bearer", re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{12,}"), rf"\1{REDACTED}"),
    ("sk-", re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
    ("://", re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):[^@\s/]+@"), rf"\1:{REDACTED}@"),
)
# Plain values only: str() of an arbitrary object (a request, a client) can
# carry more than its author meant to log.
_PLAIN_TYPES = (str, int, float, bool, type(None))


class ContextFilter(logging.Filter):
    """Copy the current request's fields (request id, workload, lane) onto the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in log_fields().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


def _extras(record: logging.LogRecord) -> dict:
    return {name: value for name, value in vars(record).items()
            if name not in _RECORD_ATTRS and not name.startswith("_") and isinstance(value, _PLAIN_TYPES)}


class _Scrubbing(logging.Formatter):
    def __init__(self, *args, secrets: list[str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # Only values long enough to be secrets: scrubbing "" or "x" would mangle every line.
        self._secrets = sorted({s for s in (secrets or []) if s and len(s) >= 8}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        lowered = text.lower()
        for literal, pattern, replacement in _CREDENTIALS:
            if literal in lowered:
                text = pattern.sub(replacement, text)
        return text


class JsonFormatter(_Scrubbing):
    """``{"ts", "level", "logger", "msg", "pid", ...fields, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        for name, value in _extras(record).items():
            entry.setdefault(name, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return self.scrub(json.dumps(entry, ensure_ascii=False, default=str))


class PlainFormatter(_Scrubbing):
    """``<time> <LEVEL> <logger> <message> key=value ...``"""

    def __init__(self, *args, secrets: list[str] | None = None, **kwargs):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s", secrets=secrets)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            pairs = " ".join(f"{name}={_plain_value(value)}" for name, value in extras.items())
            head, newline, rest = line.partition("\n")  # a traceback stays below the line
            line = f"{head} {pairs}{newline}{rest}"
        return self.scrub(line)


def _plain_value(value) -> str:
    text = "" if value is None else str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text, ensure_ascii=False)


def logging_configure(config: dict) -> None:
    """Django's LOGGING_CONFIG: the LOGGING dict, and Python's warnings sent
    through it, so a library's warning is a line in the process's format
    like any other (every line of a process's log parses as JSON)."""
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
