"""Property-based: whatever a caller sends to /v1/chat/completions or
/v1/jobs (bodies built from valid ones with parts swapped for junk, lone
surrogates, NULs, huge numbers, deep nesting, raw bytes), the real web
process never answers >= 500, every error is OpenAI-shaped, and a refused
request leaves no ledger row, no job and no bucket debit.

Sized for CI (a bounded, derandomized set of examples: same inputs each run);
HYPOTHESIS_EXAMPLES raises it for a deeper local run."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgets.admission import keys
from budgets.models import UsageRecord
from gateway.models import Job

from tests.gateway.ledger import ledger_rows

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "0")) or None
PROPERTY = settings(max_examples=EXAMPLES or 120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])

# -- strategies: near-valid bodies with junk swapped in ---------------------------

nasty_text = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
    st.sampled_from(["", "\u0000", "a\u0000b", "\ud800", "x\udfffy", "<|endoftext|>", "\u202e", "💥" * 5]),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 5, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), nasty_text)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3),
                    max_leaves=8)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": nasty_text})
image_part = st.fixed_dictionaries({"type": st.just("image_url"),
                                    "image_url": st.fixed_dictionaries({"url": st.just("https://x.test/i.png")})})
content = st.one_of(nasty_text, st.lists(st.one_of(text_part, image_part, junk), max_size=2), junk)
tool_call = st.fixed_dictionaries({"id": st.just("c1"), "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.just("weather"), "arguments": nasty_text})})
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "wizard"]), "content": content},
        optional={"name": nasty_text | junk, "tool_calls": st.lists(tool_call, max_size=1) | junk,
                  "tool_call_id": nasty_text, "extra": junk}),
    junk,
)
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["weather", ""]) | junk},
    optional={"description": nasty_text, "parameters": st.just({"type": "object"}) | junk, "strict": junk})})
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": nasty_text}, optional={"schema": st.just({"type": "object"}) | junk, "description": nasty_text})}),
    junk,
)
# Valid switches stay harmless here (no injected failures: they would cut the
# shared pool's capacity for the other tests); junk ones must be refused.
sim = st.one_of(st.fixed_dictionaries({}, optional={"output_tokens": st.integers(0, 6)}), junk)
small_tokens = st.integers(min_value=1, max_value=12)
random_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["sim-small", "sim-large", "nope"]) | junk,
     "messages": st.lists(message, min_size=1, max_size=3) | junk,
     "max_tokens": small_tokens | junk},
    optional={
        "max_completion_tokens": small_tokens | junk, "temperature": st.floats(-1, 3) | junk,
        "top_p": st.floats(0, 1) | junk, "stop": st.lists(nasty_text, max_size=5) | junk, "seed": st.integers() | junk,
        "user": nasty_text | junk, "tools": st.lists(tool, max_size=2) | junk, "response_format": response_format,
        "tool_choice": st.sampled_from(["auto", "none", "required", "maybe"]) | junk,
        "logit_bias": st.dictionaries(st.sampled_from(["50256", "x"]), st.integers(-200, 200), max_size=2) | junk,
        "n": st.integers(0, 2) | junk, "stream": st.booleans() | junk, "sim": sim, "unexpected": junk,
        "parallel_tool_calls": junk, "logprobs": junk, "top_logprobs": st.integers(-1, 30) | junk,
    },
)
# Bodies the door should accept, so the properties cover both of its sides.
safe_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
valid_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]), "content": safe_text},
                          optional={"name": st.sampled_from(["ann", "bob"])}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": safe_text}), image_part), min_size=1, max_size=2)}),
)
valid_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["weather", "search"])},
    optional={"description": safe_text, "parameters": st.just({"type": "object", "properties": {}})})})
valid_body = st.fixed_dictionaries(
    {"model": st.just("sim-small"), "messages": st.lists(valid_message, min_size=1, max_size=2),
     "max_tokens": small_tokens},
    optional={
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "stop": st.lists(safe_text, max_size=4),
        "seed": st.integers(-2**63, 2**63 - 1), "user": safe_text, "tools": st.lists(valid_tool, min_size=1, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none"]), "response_format": st.sampled_from(
            [{"type": "text"}, {"type": "json_object"},
             {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}]),
        "sim": st.fixed_dictionaries({"output_tokens": st.integers(0, 6)}), "n": st.just(1), "stream": st.just(False),
        "logit_bias": st.just({"50256": -100}), "parallel_tool_calls": st.booleans(),
    },
)
# One part of a valid body swapped for junk: the door's every branch.
SWAPPABLE = ["model", "messages", "max_tokens", "temperature", "tools", "response_format", "sim", "seed", "stop", "user",
             "tool_choice", "n", "stream", "logit_bias", "top_logprobs", "unexpected"]
swapped_body = st.tuples(valid_body, st.sampled_from(SWAPPABLE), junk).map(lambda t: {**t[0], t[1]: t[2]})
chat_body = st.one_of(valid_body, swapped_body, random_body)


def deep(depth: int) -> bytes:
    return b'{"model": "sim-small", "messages": ' + b"[" * depth + b"]" * depth + b"}"


raw_junk = st.one_of(
    st.binary(max_size=64),
    st.integers(min_value=60, max_value=5_000).map(deep),
    st.integers(min_value=20, max_value=5_000).map(lambda n: b'{"model": "sim-small", "max_tokens": ' + b"7" * n + b"}"),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b'{"model": NaN}', b'{"a": 1e999}', b"\xff\xfe{}"]),
)


def encoded(body) -> bytes:
    # ensure_ascii keeps lone surrogates as \ud800 escapes: valid JSON text.
    return json.dumps(body, allow_nan=True).encode()


chat_request = st.one_of(chat_body.map(encoded), raw_junk)
job_fields = st.one_of(
    st.fixed_dictionaries({}, optional={"callback_url": st.just("http://127.0.0.1:9/hook"),
                                        "deadline_seconds": st.integers(60, 3600)}),
    st.fixed_dictionaries({}, optional={
        "callback_url": st.sampled_from(["ftp://x", "http://x/\u0000", "http://" + "x" * 2000]) | junk,
        "deadline_seconds": st.sampled_from([0, -1, 10**9, float("inf")]) | junk}),
)
job_body = st.tuples(chat_body, job_fields).map(lambda t: {**t[0], **t[1]})
job_request = st.one_of(job_body.map(encoded), raw_junk)


# -- the properties -------------------------------------------------------------------


def counters(redis_client, pool_id: int, workload_id: int) -> tuple[int, int]:
    raw = redis_client.hgetall(keys.pool_counters(pool_id))
    return int(raw.get(f"{workload_id}.admitted_req", 0)), int(raw.get(f"{workload_id}.debited_tok", 0))


def assert_well_formed(response: httpx.Response, raw: bytes) -> None:
    assert response.status_code < 500, (raw[:300], response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (raw[:300], error)


@pytest.fixture
def sim_caller(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")
    return make_caller(pool=pool, reserved_tpm=200_000, rpm=5_000, prompt_tokens_cap=4_000, max_tokens_cap=16,
                       max_tokens_default=8)


def test_chat_completions_never_500_and_refusals_cost_nothing(platform, sim_caller, redis_client):
    caller = sim_caller
    url = f"{platform.base_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {caller.api_key}", "Content-Type": "application/json"}
    seen: dict[int, int] = {}

    @PROPERTY
    @given(raw=chat_request)
    def check(raw: bytes) -> None:
        rows_before = UsageRecord.objects.filter(workload=caller.workload).count()
        spent_before = counters(redis_client, caller.pool.id, caller.workload.id)
        response = httpx.post(url, content=raw, headers=headers, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert_well_formed(response, raw)
        if response.status_code == 200:
            # its row, written just after the answer was published
            assert len(ledger_rows(rows_before + 1, workload=caller.workload)) == rows_before + 1
        else:
            rows_after = UsageRecord.objects.filter(workload=caller.workload).count()
            assert rows_after == rows_before, (raw[:300], response.text[:300])
            assert counters(redis_client, caller.pool.id, caller.workload.id) == spent_before, raw[:300]

    check()
    print("statuses seen:", dict(sorted(seen.items())))
    # the suite exercised both sides of the door
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 20, seen
    assert redis_client.zcard(keys.pool_leases(caller.pool.id)) == 0


def test_jobs_never_500_and_refusals_create_nothing(platform, sim_caller, redis_client):
    caller = sim_caller
    url = f"{platform.base_url}/v1/jobs"
    headers = {"Authorization": f"Bearer {caller.api_key}", "Content-Type": "application/json"}
    seen: dict[int, int] = {}

    @settings(PROPERTY, max_examples=EXAMPLES or 80)
    @given(raw=job_request)
    def check(raw: bytes) -> None:
        jobs_before = Job.objects.filter(workload=caller.workload).count()
        admitted_before = counters(redis_client, caller.pool.id, caller.workload.id)[0]
        response = httpx.post(url, content=raw, headers=headers, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert_well_formed(response, raw)
        jobs_after = Job.objects.filter(workload=caller.workload).count()
        if response.status_code == 202:
            assert jobs_after == jobs_before + 1
        else:
            # no job row, no admission (ledger rows come only from admissions)
            assert response.status_code in (400, 404, 413), (raw[:300], response.text[:300])
            assert jobs_after == jobs_before, (raw[:300], response.text[:300])
            assert counters(redis_client, caller.pool.id, caller.workload.id)[0] == admitted_before, raw[:300]

    check()
    print("statuses seen:", dict(sorted(seen.items())))
    assert seen.get(202, 0) >= 3 and seen.get(400, 0) >= 20, seen
    # and every accepted job ran once, into exactly one ledger row
    accepted = Job.objects.filter(workload=caller.workload)
    deadline = time.monotonic() + 60
    while accepted.exclude(status__in=Job.FINAL).exists():
        assert time.monotonic() < deadline, list(accepted.values_list("status", flat=True))
        time.sleep(0.2)
    assert set(accepted.values_list("status", flat=True)) == {"succeeded"}
    assert UsageRecord.objects.filter(workload=caller.workload).count() == accepted.count()
    assert set(UsageRecord.objects.filter(workload=caller.workload).values_list("status", flat=True)) == {"ok"}
