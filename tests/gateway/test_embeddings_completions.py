"""Embeddings and legacy completions through the real platform with the
official openai SDK: gateway (uvicorn) -> the one door (validation, exact
estimate, admission, lane) -> worker -> inference_sim's /v1/embeddings or
/v1/completions -> settlement -> a ledger row that names the endpoint."""

from __future__ import annotations

import base64
import struct
from datetime import timedelta
from decimal import Decimal

import httpx
import llm_tokens
import openai
import pytest
from django.utils import timezone

from budgets.models import ModelPrice, UsageRecord
from inference_sim.protocol import embedding_vector
from inference_sim.text import completion_text

from tests.gateway.ledger import ledger_row, ledger_rows
from tests.gateway.sdk_calls import counters, sdk

pytestmark = pytest.mark.django_db(transaction=True)

SERVED = ["sim-small", "sim-large", "sim-embed"]
DOC = "Sluice meters every token a team sends to the pool."
ENC = llm_tokens.get_encoding("cl100k_base")
NATIVE_DIMENSIONS = 256  # inference_sim's default


@pytest.fixture
def embedder(platform, make_caller):
    """A workload whose pool (the platform's simulator) serves sim-embed, with
    sim-embed priced per input token and sim-small per input and output token."""
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=SERVED)
    since = timezone.now() - timedelta(days=1)
    ModelPrice.objects.create(model="sim-embed", pool=pool, input_per_million=Decimal("0.02"),
                              output_per_million=Decimal("0"), effective_from=since)
    ModelPrice.objects.create(model="sim-small", pool=pool, input_per_million=Decimal("1"),
                              output_per_million=Decimal("2"), effective_from=since)
    return make_caller(pool=pool, prompt_tokens_cap=200)


def _cost(input_tokens: int, output_tokens: int, input_price: str, output_price: str) -> Decimal:
    return (Decimal(input_tokens) * Decimal(input_price) + Decimal(output_tokens) * Decimal(output_price)) / 1_000_000


@pytest.mark.parametrize("form", ["string", "strings", "token ids", "lists of token ids"])
def test_each_input_form_is_embedded_admitted_on_its_exact_tokens_and_billed(platform, embedder, form):
    ids = ENC.encode(DOC)
    given = {"string": DOC, "strings": [DOC, "second input"], "token ids": ids,
             "lists of token ids": [ids, ids[:4]]}[form]
    tokens = {"string": len(ids), "strings": len(ids) + len(ENC.encode("second input")), "token ids": len(ids),
              "lists of token ids": len(ids) + 4}[form]
    # when
    raw = sdk(platform, embedder.api_key).embeddings.with_raw_response.create(
        model="sim-embed", input=given, encoding_format="float")
    result = raw.parse()
    # then the vectors are the pool's, the usage exact, the estimate exact
    assert result.usage.prompt_tokens == tokens
    assert result.data[0].embedding == pytest.approx(
        embedding_vector(DOC, native_dimensions=NATIVE_DIMENSIONS, dimensions=NATIVE_DIMENSIONS), abs=1e-12)
    assert len(result.data) == (1 if form in ("string", "token ids") else 2)
    assert raw.headers["x-sluice-estimated-prompt-tokens"] == str(tokens)
    assert raw.headers["x-sluice-max-tokens-applied"] == "0"
    row = ledger_row(raw.headers["x-request-id"])
    assert (row.endpoint, row.model, row.status) == ("/v1/embeddings", "sim-embed", "ok")
    assert (row.estimated_input_tokens, row.estimated_output_tokens) == (tokens, 0)
    assert (row.actual_input_tokens, row.actual_output_tokens) == (tokens, 0)
    assert row.cost == _cost(tokens, 0, "0.02", "0")
    assert UsageRecord.objects.count() == 1


def test_base64_and_dimensions_as_the_sdk_asks_by_default(platform, embedder):
    client = sdk(platform, embedder.api_key)
    # The SDK asks for base64 unless told otherwise, and decodes it itself.
    result = client.embeddings.create(model="sim-embed", input=DOC, dimensions=8)
    expected = embedding_vector(DOC, native_dimensions=NATIVE_DIMENSIONS, dimensions=8)
    assert len(result.data[0].embedding) == 8
    assert result.data[0].embedding == pytest.approx(expected, abs=1e-6)
    # The pool's base64 is relayed as it came: little-endian float32s.
    response = httpx.post(f"{platform.base_url}/v1/embeddings", timeout=30,
                          headers={"Authorization": f"Bearer {embedder.api_key}"},
                          json={"model": "sim-embed", "input": DOC, "encoding_format": "base64", "dimensions": 4})
    assert response.status_code == 200, response.text
    packed = base64.b64decode(response.json()["data"][0]["embedding"])
    assert struct.unpack("<4f", packed) == pytest.approx(
        embedding_vector(DOC, native_dimensions=NATIVE_DIMENSIONS, dimensions=4), abs=1e-6)


def test_an_input_over_the_prompt_cap_is_a_400_naming_it_and_costs_nothing(platform, embedder, redis_client):
    client = sdk(platform, embedder.api_key)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.embeddings.create(model="sim-embed", input=["short", "word " * 300, "short"])
    error = excinfo.value
    assert error.code == "context_length_exceeded"
    assert error.body["param"] == "input[1]"
    assert "'input[1]' resulted in 301 tokens" in error.body["message"]
    assert counters(redis_client, embedder.pool.id) == {}
    assert UsageRecord.objects.count() == 0


def test_a_model_the_workload_may_not_call_is_a_404(platform, make_caller):
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1")  # serves no embedding model
    caller = make_caller(pool=pool)
    with pytest.raises(openai.NotFoundError) as excinfo:
        sdk(platform, caller.api_key).embeddings.create(model="sim-embed", input=DOC)
    assert excinfo.value.code == "model_not_found"
    assert UsageRecord.objects.count() == 0


def test_an_embedding_over_budget_is_a_429_with_every_header(platform, make_caller):
    # given a ceiling bucket of 15 s x 4,000 TPM = 1,000 tokens, and calls of two 200-token inputs
    pool = make_caller.pool(base_url=f"{platform.sim_url}/v1", served_models=SERVED)
    caller = make_caller(pool=pool, reserved_tpm=4_000, ceiling_tpm=4_000, prompt_tokens_cap=200, max_tokens_cap=400)
    client = sdk(platform, caller.api_key)
    two_hundred = ENC.decode(ENC.encode("alpha " * 200)[:200])
    assert len(ENC.encode(two_hundred)) == 200
    client.embeddings.create(model="sim-embed", input=[two_hundred, two_hundred])
    client.embeddings.create(model="sim-embed", input=[two_hundred, two_hundred])
    # when the third would pass the bucket
    with pytest.raises(openai.RateLimitError) as excinfo:
        client.embeddings.create(model="sim-embed", input=[two_hundred, two_hundred])
    # then the SDK has every header it needs to back off
    headers = excinfo.value.response.headers
    assert excinfo.value.code == "workload_tpm"
    assert headers["x-ratelimit-limit-tokens"] == "4000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 400
    assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)
    rows = ledger_rows(2, workload=caller.workload)
    assert [(r.endpoint, r.actual_input_tokens) for r in rows] == [("/v1/embeddings", 400), ("/v1/embeddings", 400)]
    assert UsageRecord.objects.count() == 2


EMBEDDING_MALFORMED = [
    ("no input", {"model": "sim-embed"}, "input"),
    ("empty string", {"model": "sim-embed", "input": ""}, "input"),
    ("empty list", {"model": "sim-embed", "input": []}, "input"),
    ("mixed list", {"model": "sim-embed", "input": ["a", 1]}, "input"),
    ("negative id", {"model": "sim-embed", "input": [1, -2]}, "input"),
    ("bad format", {"model": "sim-embed", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("bad dimensions", {"model": "sim-embed", "input": "a", "dimensions": 0}, "dimensions"),
    ("unknown field", {"model": "sim-embed", "input": "a", "stream": True}, "stream"),
]


@pytest.mark.parametrize("name,body,param", EMBEDDING_MALFORMED, ids=[m[0] for m in EMBEDDING_MALFORMED])
def test_malformed_embedding_bodies_are_openai_shaped_400s(platform, embedder, redis_client, name, body, param):
    response = httpx.post(f"{platform.base_url}/v1/embeddings", json=body, timeout=10,
                          headers={"Authorization": f"Bearer {embedder.api_key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert counters(redis_client, embedder.pool.id) == {}


def test_dimensions_the_model_cannot_give_are_the_pools_400_and_refunded(platform, embedder, redis_client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        sdk(platform, embedder.api_key).embeddings.create(model="sim-embed", input=DOC,
                                                          dimensions=NATIVE_DIMENSIONS + 1)
    assert excinfo.value.body["param"] == "dimensions"
    row = ledger_row(excinfo.value.response.headers["x-request-id"])
    assert (row.endpoint, row.status, row.actual_input_tokens, row.cost) == (
        "/v1/embeddings", "invalid_request", 0, Decimal("0"))


# -- legacy completions ---------------------------------------------------------------


def test_a_legacy_completion_is_weighed_and_billed_as_chat(platform, embedder):
    raw = sdk(platform, embedder.api_key).completions.with_raw_response.create(
        model="sim-small", prompt=DOC, max_tokens=30, extra_body={"sim": {"output_tokens": 12}})
    completion = raw.parse()
    prompt_tokens = len(ENC.encode(DOC))
    assert completion.choices[0].text == completion_text(12)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 12)
    assert raw.headers["x-sluice-estimated-prompt-tokens"] == str(prompt_tokens)
    assert raw.headers["x-sluice-max-tokens-applied"] == "30"
    row = ledger_row(raw.headers["x-request-id"])
    assert (row.endpoint, row.model, row.status, row.lane) == ("/v1/completions", "sim-small", "ok", "interactive")
    assert (row.estimated_input_tokens, row.estimated_output_tokens) == (prompt_tokens, 30)
    assert (row.actual_input_tokens, row.actual_output_tokens) == (prompt_tokens, 12)
    assert row.cost == _cost(prompt_tokens, 12, "1", "2")


def test_several_prompts_are_estimated_each_and_answered_each(platform, embedder):
    raw = sdk(platform, embedder.api_key).completions.with_raw_response.create(
        model="sim-small", prompt=[DOC, "Hi"], max_tokens=5, extra_body={"sim": {"output_tokens": 9}})
    completion = raw.parse()
    assert [c.text for c in completion.choices] == [completion_text(5), completion_text(5)]
    row = ledger_row(raw.headers["x-request-id"])
    prompt_tokens = len(ENC.encode(DOC)) + 1
    assert (row.estimated_input_tokens, row.estimated_output_tokens) == (prompt_tokens, 10)
    assert (row.actual_input_tokens, row.actual_output_tokens) == (prompt_tokens, 10)


def test_a_streamed_legacy_completion_is_relayed_and_settled_on_the_pools_usage(platform, embedder):
    stream = sdk(platform, embedder.api_key).completions.with_raw_response.create(
        model="sim-small", prompt=DOC, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"sim": {"output_tokens": 7}})
    request_id = stream.headers["x-request-id"]
    chunks = list(stream.parse())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == completion_text(7)
    assert chunks[-1].usage.completion_tokens == 7
    prompt_tokens = len(ENC.encode(DOC))
    row = ledger_row(request_id)
    assert (row.endpoint, row.status, row.usage_source) == ("/v1/completions", "ok", "pool")
    assert (row.actual_input_tokens, row.actual_output_tokens) == (prompt_tokens, 7)
    assert row.cost == _cost(prompt_tokens, 7, "1", "2")
    assert row.ttft_ms is not None


def test_a_legacy_prompt_over_the_cap_is_a_400_and_an_unknown_field_too(platform, embedder):
    client = sdk(platform, embedder.api_key)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="sim-small", prompt="word " * 300)
    assert (excinfo.value.code, excinfo.value.body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="sim-small", prompt="x", extra_body={"messages": []})
    assert excinfo.value.code == "unknown_parameter"
    assert UsageRecord.objects.count() == 0


def test_chat_rows_keep_their_endpoint(platform, embedder):
    raw = sdk(platform, embedder.api_key).chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": DOC}], max_tokens=5)
    assert ledger_row(raw.headers["x-request-id"]).endpoint == "/v1/chat/completions"


HOSTILE = [
    ("nul in input", b'{"model": "sim-embed", "input": "a\\u0000b"}', "invalid_string"),
    ("lone surrogate", b'{"model": "sim-embed", "input": ["ok", "\\ud800"]}', "invalid_string"),
    ("deep nesting", b'{"model": "sim-embed", "input": ' + b"[" * 200 + b"]" * 200 + b"}", "invalid_json"),
    ("huge integer", b'{"model": "sim-embed", "input": [1' + b"0" * 40 + b"]}", "invalid_json"),
    ("token id past int32", b'{"model": "sim-embed", "input": [4294967296]}', None),
    ("boolean ids", b'{"model": "sim-embed", "input": [true, false]}', None),
    ("too many inputs", b'{"model": "sim-embed", "input": [' + b",".join([b'"a"'] * 2049) + b"]}", None),
    ("prompt as object", b'{"model": "sim-small", "prompt": {"a": 1}}', None),
    ("n of three", b'{"model": "sim-small", "prompt": "a", "n": 3}', None),
    ("best_of", b'{"model": "sim-small", "prompt": "a", "best_of": 2}', None),
    ("legacy logprobs", b'{"model": "sim-small", "prompt": "a", "logprobs": 9}', None),
]


@pytest.mark.parametrize("name,body,code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_on_the_new_endpoints_are_400s_and_cost_nothing(platform, embedder, redis_client, name,
                                                                       body, code):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/embeddings"
    response = httpx.post(f"{platform.base_url}{path}", content=body, timeout=10,
                          headers={"Authorization": f"Bearer {embedder.api_key}", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code
    assert counters(redis_client, embedder.pool.id) == {}
    assert UsageRecord.objects.count() == 0
