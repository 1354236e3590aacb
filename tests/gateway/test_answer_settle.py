"""A delivery's own pool answer is stored, settled and published in one round
trip (gateway/worker/execution.py ``_answer_keep_settled``): the buckets' and
the spend's settlement and the publish to the waiting caller run only when
this answer is the one stored, so a request another taker answered first is
settled and published on that answer, never on both. A stream's outcome is
published there too, its end marker just after.
Marked ``redis_cluster``: on a cluster the same calls run one by one, with
the same guards."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from budgets.admission import keys as budget_keys
from budgets.models import SpendBudget
from gateway.core import keys
from gateway.core.request.context import context_for_workload
from gateway.core.request.enqueue import record_build
from gateway.core.request.finish import finish_steps
from gateway.core.request.records import Outcome
from gateway.core.request.streams import END_FIELD
from gateway.core.request.settlement import request_settle
from gateway.worker.execution import _answer_keep_settled
from tests.budgets.test_spend_admission import MODEL, estimate, holds, price, try_admit  # noqa: F401 - price: the fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_cluster]


def _admitted(make_caller, request_id: str):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("100"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    admission = try_admit(ctx, request_id, input_tokens=1_000, output_tokens=1_000)
    record = record_build(ctx, request_id=request_id, model=MODEL, payload={},
                          estimate=estimate(1_000, 1_000), admission=admission,
                          deadline_ms=admission.admitted_ms + 10_000, retry_deadline_ms=admission.admitted_ms + 10_000)
    assert record.spend_month, "the tenant's spend is held: the settlement has its second step"
    return caller, record


def _hold(redis_client, caller, request_id: str) -> tuple[str, str]:
    """A spend hold's amount (micro-units) and state: 'e' estimate, 's' settled."""
    fields = holds(redis_client, caller.tenant)[request_id].split("|")
    return fields[1], fields[-1]


def _used_tokens(redis_client, caller) -> int:
    counters = redis_client.hgetall(budget_keys.pool_counters(caller.pool.id))
    return int(counters.get(f"{caller.workload.id}.used_tok", 0))


def _published(redis_client, request_id: str) -> list[Outcome]:
    return [Outcome.from_json(raw) for raw in redis_client.lrange(keys.request_result(request_id), 0, -1)]


def test_this_answer_stored_is_settled_in_the_same_round_trip(make_caller, redis_client):
    # given an admitted request holding a lease and a spend hold
    caller, record = _admitted(make_caller, "ours")
    answer = Outcome(status="ok", body={"id": "ours"}, input_tokens=400, output_tokens=100, usage_source="pool")
    # when the worker stores its answer
    outcome, settled, published = _answer_keep_settled(redis_client, record, answer, signals=[])
    # then it is the answer, settled on its tokens: lease gone, the hold at the
    # actual cost, usage counted
    assert (outcome, settled, published) == (answer, True, True)
    assert Outcome.from_json(redis_client.get(keys.request_response("ours"))) == answer
    assert not redis_client.exists(budget_keys.lease(caller.pool.id, "ours"))
    assert _hold(redis_client, caller, "ours") == ("1600", "s")  # 400 x $2 + 100 x $8 per million
    assert _used_tokens(redis_client, caller) == 500
    # and published to the waiting caller, once
    assert _published(redis_client, "ours") == [answer]
    assert redis_client.exists(keys.request_result_published("ours"))
    # and a second settlement (the finish's, were it run) finds nothing left
    assert request_settle(record=record, input_tokens=400, output_tokens=100, pool_called=True).settled is False
    assert _used_tokens(redis_client, caller) == 500


def test_an_answer_stored_first_by_another_is_returned_and_nothing_is_settled(make_caller, redis_client):
    # given a request another taker answered first
    caller, record = _admitted(make_caller, "theirs")
    first = Outcome(status="ok", body={"id": "first"}, input_tokens=700, output_tokens=300, usage_source="pool")
    redis_client.set(keys.request_response("theirs"), first.to_json(), px=60_000)
    late = Outcome(status="ok", body={"id": "late"}, input_tokens=10, output_tokens=10, usage_source="pool")
    # when this delivery's own answer comes
    outcome, settled, published = _answer_keep_settled(redis_client, record, late, signals=[])
    # then the first answer is the one to finish on, and nothing was settled
    # on the late one, nor published
    assert (outcome, settled, published) == (first, False, False)
    assert _published(redis_client, "theirs") == []
    assert not redis_client.exists(keys.request_result_published("theirs"))
    assert redis_client.exists(budget_keys.lease(caller.pool.id, "theirs"))
    assert _hold(redis_client, caller, "theirs") == ("10000", "e")  # still the estimate
    assert _used_tokens(redis_client, caller) == 0
    # and the finish settles on the first answer's tokens
    assert request_settle(record=record, input_tokens=700, output_tokens=300, pool_called=True).settled is True
    assert _used_tokens(redis_client, caller) == 1_000


def _stream_ends(redis_client, request_id: str) -> int:
    entries = redis_client.xrange(keys.request_stream(request_id))
    return sum(END_FIELD in fields for _, fields in entries)


def test_a_streams_answer_is_settled_published_and_its_stream_ended_in_its_own_round_trips(make_caller,
                                                                                           redis_client):
    # given a streamed request
    caller, record = _admitted(make_caller, "streamed")
    record = replace(record, stream=True)
    answer = Outcome(status="ok", body={"id": "streamed"}, input_tokens=400, output_tokens=100,
                     usage_source="pool", streamed=True)
    # when the worker stores the stream's answer
    outcome, settled, published = _answer_keep_settled(redis_client, record, answer, signals=[])
    # then it is settled and published, and the stream's end marker follows:
    # the caller's stream ends before (and without) the ledger row
    assert (outcome, settled, published) == (answer, True, True)
    assert _used_tokens(redis_client, caller) == 500
    assert _published(redis_client, "streamed") == [answer]
    assert _stream_ends(redis_client, "streamed") == 1
    # and the finish that follows adds no second marker
    steps = [name for name, _ in finish_steps(record=record, outcome=outcome, pool_called=True, together=True,
                                              settled=settled, published=published)]
    assert steps == ["ledger", "departure"]


def test_a_stream_answered_first_by_another_is_ended_by_the_finish_not_by_the_late_answer(make_caller,
                                                                                         redis_client):
    # given a stream another taker answered first, and this delivery's own
    # answer one that relayed no chunk (an error before the first): it is
    # stored only if none is
    caller, record = _admitted(make_caller, "stream-theirs")
    record = replace(record, stream=True)
    first = Outcome(status="ok", body={"id": "first"}, input_tokens=700, output_tokens=300, usage_source="pool",
                    streamed=True)
    redis_client.set(keys.request_response("stream-theirs"), first.to_json(), px=60_000)
    late = Outcome(status="upstream_error", http_status=502, body={"id": "late"}, usage_source="")
    # when it comes
    outcome, settled, published = _answer_keep_settled(redis_client, record, late, signals=[])
    # then the first answer is the one to finish on: nothing published, the
    # stream not ended by the late answer
    assert (outcome, settled, published) == (first, False, False)
    assert _published(redis_client, "stream-theirs") == []
    assert _stream_ends(redis_client, "stream-theirs") == 0
    # and the finish publishes it and then ends the stream
    steps = [name for name, _ in finish_steps(record=record, outcome=outcome, pool_called=True, together=True,
                                              settled=settled, published=published)]
    assert steps == ["settle", "ledger", "departure+publish", "stream_end"]
