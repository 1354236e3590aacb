"""A failed request's ledger row says what the pool said: the error code,
and for a pool's error answer its HTTP status and (truncated) message, not
a bare ``upstream_error``."""

from __future__ import annotations

import httpx
import pytest
from django.utils import timezone

from gateway.core.request.records import Outcome
from gateway.core.errors import error_body
from gateway.worker.pool_errors import POOL_MESSAGE_CHARS, pool_error_message, pool_status_error
from tests.people import login, world  # noqa: F401 (fixtures)

REQUEST = httpx.Request("POST", "http://pool.test/v1/chat/completions")


def _error(status: int, **kwargs) -> object:
    return pool_status_error(httpx.Response(status, request=REQUEST, **kwargs))


def test_the_pools_message_is_read_from_its_json_or_its_text():
    assert pool_error_message(_error(503, json={"error": {"message": "model  is\nloading", "code": "x"}})) == \
        "model is loading"
    assert pool_error_message(_error(502, text="<html>Bad gateway</html>")) == "<html>Bad gateway</html>"
    long = pool_error_message(_error(500, json={"error": {"message": "x" * 1000}}))
    assert len(long) == POOL_MESSAGE_CHARS and long.endswith("…")


def test_the_ledger_error_names_the_pools_status_and_message():
    failed = Outcome(status="upstream_error", http_status=502, upstream_status=503, upstream_message="model is loading",
                     body=error_body(message="The inference pool answered 503.", error_type="upstream_error",
                                     code="upstream_error"))
    assert failed.ledger_error == "upstream_error (pool answered 503: model is loading)"
    silent = Outcome(status="upstream_error", http_status=502, upstream_status=500,
                     body=error_body(message="x", error_type="upstream_error", code="upstream_error"))
    assert silent.ledger_error == "upstream_error (pool answered 500)"
    timed_out = Outcome(status="upstream_error", http_status=504,
                        body=error_body(message="x", error_type="upstream_error", code="upstream_timeout"))
    assert timed_out.ledger_error == "upstream_timeout"
    assert Outcome(status="ok", upstream_status=200).ledger_error == ""
    # what the ledger column holds at most
    huge = Outcome(status="upstream_error", upstream_status=503, upstream_message="y" * 900,
                   body=error_body(message="x", error_type="upstream_error", code="upstream_error"))
    assert len(huge.ledger_error) == 500
    # carried through the record's JSON like every other field
    assert Outcome.from_json(failed.to_json()).ledger_error == failed.ledger_error


@pytest.mark.django_db
def test_the_request_page_shows_what_the_pool_said(login, world):
    from budgets.ledger.writer import LedgerEntry, usage_record_write

    usage_record_write(entry=LedgerEntry(
        request_id="req_pool_said", created_at=timezone.now(), tenant_id=world.tenant_a.id, workload_id=world.wl_a.id,
        pool_id=world.pool.id, model="sim-small", lane="interactive", status="upstream_error", borrowed=False,
        estimated_input_tokens=20, estimated_output_tokens=40, actual_input_tokens=0, actual_output_tokens=0,
        error="upstream_error (pool answered 503: model is loading)"))
    body = login(world.member_a).get(f"/t/{world.tenant_a.slug}/log/req_pool_said/").content.decode()
    assert '<p class="flash error" id="request-error">What went wrong: <code>upstream_error (pool answered 503: ' \
           'model is loading)</code></p>' in body
