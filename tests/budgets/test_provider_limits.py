"""Limits from the provider (budgets/admission/provider_limits.py): the
x-ratelimit-* headers parsed in every format providers write them (garbage
ignored, never an error), and admission honouring what they say, against a
real Redis and, end to end, the simulated provider behind the real gateway."""

from __future__ import annotations

import random
import time
import uuid

import httpx
import pytest

from budgets.admission import keys
from budgets.admission.buckets import admit
from budgets.admission.capacity import capacity_state
from budgets.admission.provider_limits import (ProviderLimits, duration_ms, provider_limits_parse,
                                               provider_limits_record, provider_take_call, retry_after_ms)
from budgets.errors import Rejected
from tests.hammer import _hammer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(("text", "ms"), [
    ("6m0s", 360_000.0), ("20ms", 20.0), ("1s", 1000.0), ("1.5s", 1500.0), ("0s", 0.0), ("1h2m3s", 3_723_000.0),
    ("59.25s", 59_250.0), ("2m30.5s", 150_500.0), ("500us", 0.5), ("0.5", 500.0), ("12", 12_000.0), (" 7s ", 7000.0),
])
def test_reset_durations_in_every_format_providers_write(text, ms):
    assert duration_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", [
    None, "", "soon", "5x", "s", "ms", "-1s", "1s2", "1.2.3s", "nan", "inf", "-3", "1e3", "25h", "9" * 50, "1 s",
])
def test_garbage_durations_are_ignored(text):
    assert duration_ms(text) is None


def test_headers_parse_and_garbage_counts_are_dropped():
    headers = httpx.Headers({
        "X-RateLimit-Limit-Requests": "3000", "x-ratelimit-limit-tokens": "lots",
        "x-ratelimit-remaining-requests": "-4", "x-ratelimit-remaining-tokens": "48000",
        "x-ratelimit-reset-requests": "tomorrow", "x-ratelimit-reset-tokens": "6m0s",
    })
    assert provider_limits_parse(headers) == ProviderLimits(
        limit_requests=3000, limit_tokens=None, remaining_requests=None, remaining_tokens=48000,
        reset_requests_ms=None, reset_tokens_ms=360_000.0)
    assert provider_limits_parse({}).empty
    assert provider_limits_parse({"x-ratelimit-remaining-tokens": "n/a"}).empty
    # digits of other scripts (a header read as latin-1 may hold '\xb2', '²'), signs, separators
    for junk in ("\u00b2", "\u0661\u0662", "+5", "1_000", "\uff15"):
        assert provider_limits_parse({"x-ratelimit-remaining-tokens": junk}).empty, junk


def _admit(caller, tokens: int):
    try:
        return admit(pool_id=caller.pool.id, workload_id=caller.workload.id, request_id=uuid.uuid4().hex,
                     input_tokens=0, output_tokens=tokens, lease_ttl_ms=60_000)
    except Rejected as rejected:
        return rejected


def test_admission_refuses_what_the_provider_says_no_longer_remains_until_its_reset(make_caller):
    # given a pool whose own buckets have plenty, and a provider that says 500 tokens remain until 7 s from now
    caller = make_caller(reserved_tpm=600_000)
    provider_limits_record(pool_id=caller.pool.id, headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "7s"})

    # when
    too_big = _admit(caller, 600)
    fits = _admit(caller, 400)

    # then the larger is Sluice's own 429, waiting for the provider's reset; the smaller fits
    assert isinstance(too_big, Rejected)
    assert (too_big.status, too_big.reason) == (429, "provider_tpm")
    assert 6_000 < too_big.retry_after_ms <= 7_000
    assert not isinstance(fits, Rejected)


def test_a_worker_takes_its_share_of_the_room_as_it_sends_or_waits_for_the_reset(make_caller, redis_client):
    # given the provider said 500 tokens remain until 7 s from now
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "7s", "x-ratelimit-remaining-requests": "10"})

    # when two calls go out, 400 tokens then 200
    first = provider_take_call(pool_id=pool_id, tokens=400).run().wait_ms
    second = provider_take_call(pool_id=pool_id, tokens=200).run().wait_ms

    # then the first takes its share; the second waits for the reset and takes nothing
    assert first == 0.0
    assert 6_000 < second <= 7_000
    capacity = redis_client.hgetall(keys.pool_capacity(pool_id))
    assert (float(capacity["prov_rem_tok"]), float(capacity["prov_rem_req"])) == (100.0, 9.0)


def test_a_provider_that_states_nothing_never_holds_a_call(make_caller):
    caller = make_caller()
    assert provider_take_call(pool_id=caller.pool.id, tokens=10**9).run().wait_ms == 0.0


def test_hundred_threads_share_the_stated_room_exactly(make_caller):
    # given room for 5 requests until a reset an hour away
    caller = make_caller()
    provider_limits_record(pool_id=caller.pool.id, headers={
        "x-ratelimit-limit-requests": "10000", "x-ratelimit-remaining-requests": "5",
        "x-ratelimit-reset-requests": "1h0m0s"})

    # when 100 workers try to send at once
    results = _hammer(threads=100, attempts=1, barrier_at=time.time() + 0.2,
                      attempt=lambda n: (n, provider_take_call(pool_id=caller.pool.id, tokens=1).run().wait_ms))

    # then exactly 5 go
    assert sum(1 for _, wait in results if wait == 0.0) == 5


def test_no_requests_remaining_is_a_provider_rpm_refusal_until_the_reset(make_caller):
    caller = make_caller()
    provider_limits_record(pool_id=caller.pool.id, headers={
        "x-ratelimit-limit-requests": "10000", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "2s"})
    rejected = _admit(caller, 10)
    assert isinstance(rejected, Rejected)
    assert rejected.reason == "provider_rpm"
    assert 1_000 < rejected.retry_after_ms <= 2_000


def test_headers_without_usable_numbers_change_nothing(make_caller, redis_client):
    caller = make_caller()
    provider_limits_record(pool_id=caller.pool.id, headers={"x-ratelimit-remaining-tokens": "none",
                                                            "x-ratelimit-reset-tokens": "never"})
    assert redis_client.hgetall(keys.pool_capacity(caller.pool.id)).get("prov_rem_tok") is None
    assert not isinstance(_admit(caller, 10), Rejected)


def test_a_provider_that_halves_its_limit_sheds_batch_before_chat_at_once(make_caller):
    # given 1,000,000 TPM configured (800,000 after headroom), chat and batch 300,000 reserved each
    pool = make_caller.pool(provider_tpm=1_000_000)
    chat = make_caller(pool=pool, reserved_tpm=300_000)
    batch = make_caller(pool=pool, workload_class="batch", reserved_tpm=300_000)
    assert capacity_state(pool_id=pool.id).shed == {chat.workload.id: 1.0, batch.workload.id: 1.0}

    # when one answer says the provider's limit is now 500,000 (no 429 yet)
    provider_limits_record(pool_id=pool.id, headers={"x-ratelimit-limit-tokens": "500000",
                                                      "x-ratelimit-remaining-tokens": "400000"})

    # then the pool runs at 400,000: chat keeps all of its reservation, batch the 100,000 left
    shed = capacity_state(pool_id=pool.id).shed
    assert shed[chat.workload.id] == 1.0
    assert shed[batch.workload.id] == pytest.approx(1 / 3)


def test_through_the_gateway_the_provider_never_sees_a_call_it_would_refuse(platform, make_caller):
    # given the simulated provider allows 2 requests per simulated minute (10 per
    # real minute at time scale 5), and a pool whose own buckets hold more
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", provider_rpm=40, headroom=0.5, burst_seconds=60.0)
    caller = make_caller(pool=pool, rpm=20)
    platform.sim_reset()
    platform.sim_capacity(rpm=2)
    try:
        # when three requests go through Sluice
        responses = [httpx.post(f"{platform.base_url}/v1/chat/completions", timeout=30,
                                headers={"Authorization": f"Bearer {caller.api_key}"},
                                json={"model": "sim-small", "max_tokens": 5,
                                      "messages": [{"role": "user", "content": "hi"}]}) for _ in range(3)]
        stats = platform.sim_stats()
    finally:
        platform.sim_reset()
    # then the third is Sluice's own 429, after the provider's reset, and the provider refused nothing
    assert [r.status_code for r in responses] == [200, 200, 429]
    third = responses[2]
    assert third.json()["error"]["code"] == "provider_rpm"
    # the simulator's window is 60 simulated s = 12 real s at time scale 5
    assert 1_000 < int(third.headers["retry-after-ms"]) <= 12_000
    assert stats["rejected_429"] == 0
    assert stats["completed"] == 2


def test_loans_and_sheddable_work_leave_the_last_tenth_of_the_providers_limit_to_protected_work(make_caller):
    # given the provider says 900 of its 10,000 tokens remain for an hour (reserve: 1,000)
    pool = make_caller.pool()
    chat = make_caller(pool=pool, reserved_tpm=100_000)
    batch = make_caller(pool=pool, workload_class="batch", reserved_tpm=100_000)
    provider_limits_record(pool_id=pool.id, headers={
        "x-ratelimit-limit-tokens": "10000", "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "1h0m0s"})

    # then batch is refused at the door and held at the send, chat is not
    refused = _admit(batch, 100)
    assert isinstance(refused, Rejected) and refused.reason == "provider_tpm"
    assert not isinstance(_admit(chat, 100), Rejected)
    assert provider_take_call(pool_id=pool.id, tokens=100, sheddable=True).run().wait_ms > 3_000_000
    assert provider_take_call(pool_id=pool.id, tokens=100).run().wait_ms == 0.0


def _sent(pool_id: int, tokens: int):
    taken = provider_take_call(pool_id=pool_id, tokens=tokens).run()
    assert taken.wait_ms == 0.0 and taken.mark is not None
    return taken.mark


def test_a_late_answer_to_an_earlier_call_does_not_bring_its_old_limits_back(make_caller):
    # given a long call sent before the provider halved its limit, and a later call
    # whose answer (limit halved, nothing left for 10 s) came back first
    caller = make_caller(pool=make_caller.pool(provider_tpm=1_000_000), reserved_tpm=300_000)
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, headers={"x-ratelimit-limit-tokens": "1000000",
                                                      "x-ratelimit-remaining-tokens": "900000"})
    early, late = _sent(pool_id, 100), _sent(pool_id, 100)
    provider_limits_record(pool_id=pool_id, mark=late, headers={
        "x-ratelimit-limit-tokens": "500000", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "10s"})

    # when the long call's answer arrives, stating the window as it was when that call went
    provider_limits_record(pool_id=pool_id, mark=early, headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "800000"})

    # then the newer statement stands: admission still refuses until the reset, the pool runs at half
    refused = _admit(caller, 10)
    assert isinstance(refused, Rejected) and refused.reason == "provider_tpm"
    assert 8_000 < refused.retry_after_ms <= 10_000
    assert capacity_state(pool_id=pool_id).provider_factor == pytest.approx(0.5)


def test_a_statement_counts_what_was_sent_after_its_call_and_its_reset_from_when_the_call_went(
        make_caller, redis_client):
    # given a call that went, then two more (300 and 200 tokens) while it ran
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, headers={"x-ratelimit-limit-tokens": "1000000",
                                                      "x-ratelimit-remaining-tokens": "900000",
                                                      "x-ratelimit-limit-requests": "1000",
                                                      "x-ratelimit-remaining-requests": "900"})
    first = _sent(pool_id, 100)
    _sent(pool_id, 300)
    _sent(pool_id, 200)
    time.sleep(0.3)

    # when the first call's answer says 1,000 tokens and 50 requests remained, resetting 1 s after it arrived
    provider_limits_record(pool_id=pool_id, mark=first, headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "1s", "x-ratelimit-limit-requests": "1000",
        "x-ratelimit-remaining-requests": "50", "x-ratelimit-reset-requests": "1s"})

    # then the two later calls are taken off, and the resets count from when the first call went
    capacity = redis_client.hgetall(keys.pool_capacity(pool_id))
    assert float(capacity["prov_rem_tok"]) == 500.0
    assert float(capacity["prov_rem_req"]) == 48.0
    assert float(capacity["prov_reset_tok_ms"]) == pytest.approx(first.at_ms + 1000, abs=1)
    assert float(capacity["prov_reset_req_ms"]) == pytest.approx(first.at_ms + 1000, abs=1)


def test_a_statement_without_a_mark_is_news_of_now(make_caller, redis_client):
    # given calls sent and a statement kept from one of them
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, headers={"x-ratelimit-limit-tokens": "1000000",
                                                      "x-ratelimit-remaining-tokens": "900000"})
    provider_limits_record(pool_id=pool_id, mark=_sent(pool_id, 100), headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "5000"})

    # when a call that went untaken (past its deadline) brings a statement
    provider_limits_record(pool_id=pool_id, headers={
        "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": "7000"})

    # then it is kept as it says
    assert float(redis_client.hget(keys.pool_capacity(pool_id), "prov_rem_tok")) == 7000.0


def test_answers_recorded_at_once_in_any_order_keep_the_statement_of_the_last_call_sent(make_caller, redis_client):
    # given 60 calls sent one after another, each answer stating 10,000 tokens
    # less than the one before it
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, headers={"x-ratelimit-limit-tokens": "1000000",
                                                      "x-ratelimit-remaining-tokens": "900000"})
    marks = [_sent(pool_id, 10) for _ in range(60)]
    order = list(range(60))
    random.Random(7).shuffle(order)

    # when 60 threads record the answers at once, in a shuffled order
    def record(n: int):
        k = order[n]
        provider_limits_record(pool_id=pool_id, mark=marks[k], headers={
            "x-ratelimit-limit-tokens": "1000000", "x-ratelimit-remaining-tokens": str(800_000 - 10_000 * k)})
        return (k,)

    _hammer(threads=60, attempts=1, barrier_at=time.time() + 0.2, attempt=record)

    # then the last call's statement is the one kept, nothing taken off (none went after it)
    capacity = redis_client.hgetall(keys.pool_capacity(pool_id))
    assert int(capacity["prov_obs"]) == marks[-1].sent
    assert float(capacity["prov_rem_tok"]) == 800_000 - 10_000 * 59


@pytest.mark.parametrize(("headers", "ms"), [
    ({"retry-after-ms": "250"}, 250), ({"retry-after-ms": "12.7"}, 12), ({"retry-after": "2"}, 2000),
    ({"retry-after": "0.5"}, 500), ({"retry-after-ms": "soon", "retry-after": "3"}, 3000), ({"retry-after": "-4"}, 0),
    ({"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, None), ({"retry-after": "nan"}, None),
    ({"retry-after-ms": "inf"}, None), ({}, None),
])
def test_a_retry_after_reads_as_milliseconds_and_anything_else_as_nothing(headers, ms):
    assert retry_after_ms(httpx.Headers(headers)) == ms


# What a provider counting a sliding window says when a call finds less room
# than the refill model gave it: a little room left, a reset of 0 (there is
# room for one more token), and when this call would fit.
REFUSAL = {"x-ratelimit-limit-tokens": "200000", "x-ratelimit-remaining-tokens": "78",
           "x-ratelimit-reset-tokens": "0s", "x-ratelimit-limit-requests": "6000",
           "x-ratelimit-remaining-requests": "900", "retry-after-ms": "400"}


def test_a_refusal_holds_the_room_for_calls_its_size_until_its_retry_after(make_caller):
    # given a call of 80 tokens the provider refused, saying 78 remain, reset 0, retry after 400 ms
    caller = make_caller()
    pool_id = caller.pool.id
    refused = _sent(pool_id, 80)
    provider_limits_record(pool_id=pool_id, mark=refused, headers=REFUSAL, status=429)

    # when the next call of that size is about to go
    wait_ms = provider_take_call(pool_id=pool_id, tokens=80).run().wait_ms

    # then it waits for the refusal's retry-after (from when the refused call went), not for 78 tokens to
    # refill at 200,000 a minute (under a millisecond), which sent every waiting call into the same window
    assert 250 < wait_ms <= 400
    assert provider_take_call(pool_id=pool_id, tokens=70).run().wait_ms == 0.0  # what still fits, goes


def test_the_same_statement_on_an_answer_that_is_not_a_refusal_holds_nothing_past_its_refill(make_caller):
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, mark=_sent(pool_id, 80), headers=REFUSAL, status=200)
    assert provider_take_call(pool_id=pool_id, tokens=80).run().wait_ms < 50


@pytest.mark.parametrize(("tokens", "headers"), [
    (300, {**REFUSAL, "x-ratelimit-limit-tokens": "200"}),  # larger than the whole limit: it never fits
    (50, REFUSAL),  # the room was there: something else refused it
])
def test_a_refusal_that_says_nothing_of_the_token_room_holds_no_other_call(make_caller, tokens, headers):
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, mark=_sent(pool_id, tokens), headers=headers, status=429)
    assert provider_take_call(pool_id=pool_id, tokens=10).run().wait_ms == 0.0


def test_a_refusal_holds_the_room_a_second_at_most_whatever_its_retry_after(make_caller):
    # given a refused call whose provider says it fits in a minute
    caller = make_caller()
    pool_id = caller.pool.id
    provider_limits_record(pool_id=pool_id, mark=_sent(pool_id, 80), status=429,
                           headers={**REFUSAL, "retry-after-ms": "60000"})

    # then the others wait a second at most (its own retry waits the minute: the retry policy's business)
    assert 800 < provider_take_call(pool_id=pool_id, tokens=80).run().wait_ms <= 1_000


def test_a_refusal_with_no_request_left_holds_every_call_until_its_retry_after(make_caller):
    caller = make_caller()
    pool_id = caller.pool.id
    headers = {name: value for name, value in REFUSAL.items() if name != "retry-after-ms"}
    provider_limits_record(pool_id=pool_id, mark=_sent(pool_id, 10), status=429, headers={
        **headers, "x-ratelimit-remaining-tokens": "150000", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "0s", "retry-after": "0.6"})
    assert 450 < provider_take_call(pool_id=pool_id, tokens=10).run().wait_ms <= 600


def test_a_refusal_read_back_without_its_calls_size_holds_nothing_more(make_caller):
    # given the mark of a held request's release (its call's size is not kept with it)
    from gateway.core.protection.held import mark_parse, mark_text

    caller = make_caller()
    pool_id = caller.pool.id
    mark = mark_parse(mark_text(_sent(pool_id, 80)))
    assert mark.tokens == 0

    # when its call is refused, then the statement is kept as the headers say it
    provider_limits_record(pool_id=pool_id, mark=mark, headers=REFUSAL, status=429)
    assert provider_take_call(pool_id=pool_id, tokens=80).run().wait_ms < 50
