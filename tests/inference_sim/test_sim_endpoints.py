"""The simulator's embeddings and legacy completions, over HTTP and with the
official openai SDK: exact token counts, deterministic vectors, the engine's
step model for their time, OpenAI-shaped errors."""

from __future__ import annotations

import base64
import json
import math
import struct

import llm_tokens
import openai
import pytest

from inference_sim.protocol import embedding_base64, embedding_vector
from inference_sim.text import completion_text, token_pieces

ENC = llm_tokens.get_encoding("cl100k_base")
DOC = "Sluice meters every token a team sends to the pool."


def step_ms(prefill_tokens: int = 0, batch: int = 1) -> float:
    """One engine step with the default latency parameters (engine.py)."""
    return 0.1 * prefill_tokens + 20.0 + 0.5 * batch


def embeddings(server, **body):
    body.setdefault("model", "sim-embed")
    return server.http.post("/v1/embeddings", json=body)


def completions(server, **body):
    body.setdefault("model", "sim-small")
    return server.http.post("/v1/completions", json=body)


# -- pure units ---------------------------------------------------------------


def test_embedding_vectors_are_deterministic_unit_vectors_cut_to_dimensions():
    full = embedding_vector(DOC, native_dimensions=256, dimensions=256)
    assert len(full) == 256
    assert math.fsum(x * x for x in full) == pytest.approx(1.0, abs=1e-12)
    assert embedding_vector(DOC, native_dimensions=256, dimensions=256) == full
    assert embedding_vector(DOC + ".", native_dimensions=256, dimensions=256) != full
    cut = embedding_vector(DOC, native_dimensions=256, dimensions=8)
    norm = math.sqrt(math.fsum(x * x for x in full[:8]))
    assert cut == pytest.approx([x / norm for x in full[:8]], abs=1e-15)


def test_base64_is_little_endian_float32():
    vector = [0.5, -0.25, 1.0]
    assert struct.unpack("<3f", base64.b64decode(embedding_base64(vector))) == (0.5, -0.25, 1.0)


# -- embeddings over HTTP -------------------------------------------------------


def test_embeddings_of_each_input_form_with_exact_usage(sim):
    ids = ENC.encode(DOC)
    # a string
    body = embeddings(sim, input=DOC).json()
    assert body["object"] == "list" and body["model"] == "sim-embed"
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert item["embedding"] == pytest.approx(embedding_vector(DOC, native_dimensions=256, dimensions=256), abs=1e-12)
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    # a list of strings
    body = embeddings(sim, input=[DOC, "two"]).json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == len(ids) + 1
    # token ids embed as their text does
    by_ids = embeddings(sim, input=ids).json()
    assert by_ids["data"][0]["embedding"] == item["embedding"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    # a list of lists of token ids
    lists = embeddings(sim, input=[ids, ids[:3]]).json()
    assert lists["usage"]["prompt_tokens"] == len(ids) + 3
    assert lists["data"][0]["embedding"] == item["embedding"]


def test_embeddings_base64_and_dimensions_with_the_sdk(sim):
    # The SDK asks for base64 by default and decodes it.
    result = sim.openai.embeddings.create(model="sim-embed", input=DOC, dimensions=16)
    expected = embedding_vector(DOC, native_dimensions=256, dimensions=16)
    assert len(result.data[0].embedding) == 16
    assert result.data[0].embedding == pytest.approx(expected, abs=1e-6)  # float32 on the wire
    assert result.usage.prompt_tokens == len(ENC.encode(DOC))
    raw = embeddings(sim, input=DOC, encoding_format="base64", dimensions=4).json()
    assert struct.unpack("<4f", base64.b64decode(raw["data"][0]["embedding"])) == pytest.approx(
        embedding_vector(DOC, native_dimensions=256, dimensions=4), abs=1e-6)


def test_an_embedding_takes_one_prefill_step_and_counts_as_completed(sim):
    tokens = len(ENC.encode(DOC))
    response = embeddings(sim, input=DOC)
    assert float(response.headers["x-sim-prefill-ms"]) == pytest.approx(step_ms(tokens), abs=1e-3)
    stats = sim.stats()
    assert (stats["completed"], stats["prompt_tokens"], stats["completion_tokens"], stats["in_flight"]) == (
        1, tokens, 0, 0)


@pytest.mark.parametrize("body,status,param,code", [
    ({"input": ""}, 400, "input", None),
    ({"input": []}, 400, "input", None),
    ({"input": [1, "a"]}, 400, "input", None),
    ({"input": [[1], []]}, 400, "input", None),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", None),
    ({"input": "x", "dimensions": 257}, 400, "dimensions", None),
    ({"input": [10**9]}, 400, "input", None),
    ({"input": "x", "model": "sim-small"}, 404, "model", "model_not_found"),
    ({"input": "word " * 9000}, 400, "input", "context_length_exceeded"),
], ids=["empty string", "empty list", "mixed", "empty ids", "format", "dims 0", "dims too many", "bad id",
        "chat model", "too long"])
def test_embedding_errors_are_openai_shaped(sim, body, status, param, code):
    response = embeddings(sim, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["code"] == code
    assert sim.stats()["completed"] == 0


def test_a_chat_call_to_the_embedding_model_is_a_404(sim):
    response = sim.chat(model="sim-embed")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


# -- legacy completions -----------------------------------------------------------


def test_a_legacy_completion_with_exact_usage(sim):
    body = completions(sim, prompt=DOC, max_tokens=30, sim={"output_tokens": 12}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {"text": completion_text(12), "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert body["usage"] == {"prompt_tokens": len(ENC.encode(DOC)), "completion_tokens": 12,
                             "total_tokens": len(ENC.encode(DOC)) + 12}


def test_several_prompts_get_a_choice_each(sim):
    ids = ENC.encode(DOC)
    body = completions(sim, prompt=[DOC, "Hi"], max_tokens=5, sim={"output_tokens": 9}).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, completion_text(5), "length"), (1, completion_text(5), "length")]
    assert body["usage"]["prompt_tokens"] == len(ids) + 1
    assert body["usage"]["completion_tokens"] == 10
    by_ids = completions(sim, prompt=[ids, ids], max_tokens=3, sim={"output_tokens": 3}).json()
    assert by_ids["usage"]["prompt_tokens"] == 2 * len(ids)


def test_a_legacy_completion_streams_text_chunks_with_usage(sim):
    stream = sim.openai.completions.create(model="sim-small", prompt=DOC, max_tokens=20, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"sim": {"output_tokens": 6}})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == completion_text(6)
    assert texts[:6] == list(token_pieces(6))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == len(ENC.encode(DOC))
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.object == "text_completion" for c in chunks)


def test_legacy_completion_errors(sim):
    assert completions(sim, prompt=[DOC, DOC], stream=True).status_code == 400
    assert completions(sim, prompt=7).json()["error"]["param"] == "prompt"
    assert completions(sim, prompt="x", model="sim-embed").status_code == 404
    with pytest.raises(openai.NotFoundError):
        sim.openai.completions.create(model="nope", prompt="x")
    assert json.loads(completions(sim, prompt="x", max_tokens=0).text)["error"]["param"] == "max_tokens"
