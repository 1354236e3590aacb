"""Reading the ledger behind an answer. A delivery publishes its caller's
answer in the round trip that settles it and writes the ledger row just after
(gateway/worker/execution.py ``_answer_keep_settled``); a stream's row is
written just after its end marker. So a test that holds an answer (or a
stream's end) polls for its rows, with a deadline, instead of reading them
at once."""

from __future__ import annotations

import time

from budgets.models import UsageRecord


def ledger_row(request_id: str, timeout_s: float = 10.0) -> UsageRecord:
    """The request's one row, once it is written."""
    return ledger_rows(1, timeout_s=timeout_s, request_id=request_id)[0]


def sole_ledger_row(timeout_s: float = 10.0) -> UsageRecord:
    """The ledger's one row, once it is written (and no second)."""
    rows = ledger_rows(1, timeout_s=timeout_s)
    assert len(rows) == 1, f"{len(rows)} ledger rows, one expected"
    return rows[0]


def ledger_rows(count: int, *, timeout_s: float = 10.0, **filters) -> list[UsageRecord]:
    """The rows matching ``filters`` once there are at least ``count`` of
    them (all of them: more than ``count`` is for the caller to judge)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = list(UsageRecord.objects.filter(**filters).order_by("created_at", "request_id"))
        if len(rows) >= count or time.monotonic() > deadline:
            assert len(rows) >= count, f"{len(rows)} ledger rows matching {filters}, {count} expected"
            return rows
        time.sleep(0.02)
