"""The OpenAI wire formats the simulator serves: chat completions, legacy
(text) completions and embeddings; request validation and response bodies."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import random
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

import llm_tokens

from inference_sim.config import OUTAGE_STATUSES
from inference_sim.errors import invalid_request, model_not_found

SIM_FIELDS = ("output_tokens", "fail_status", "fail_retry_after", "latency_ms", "fail_after_tokens")


@dataclass(frozen=True)
class SimOverrides:
    """The per-request ``"sim"`` body field (the gateway sends it as extra_body)."""

    output_tokens: int | None = None
    fail_status: int | None = None
    fail_retry_after: float | None = None
    latency_ms: float = 0.0
    # A stream breaks off (no finish, no [DONE]) after this many tokens.
    fail_after_tokens: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    stream: bool
    include_usage: bool
    sim: SimOverrides
    # Tools, response format...: prompt tokens too (llm_tokens.PROMPT_FIELDS).
    prompt_fields: dict[str, Any] = dataclasses.field(default_factory=dict)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid_request("'messages' must be a non-empty array.", param="messages")
    for index, message in enumerate(raw):
        param = f"messages.[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_request(f"{param} must be an object with a string 'role'.", param=param)
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            raise invalid_request(f"{param}.content must be a string or an array of content parts.", param=param)
    return raw


def _parse_sim(raw: Any) -> SimOverrides:
    if raw is None:
        return SimOverrides()
    if not isinstance(raw, dict):
        raise invalid_request("'sim' must be an object.", param="sim")
    unknown = sorted(set(raw) - set(SIM_FIELDS))
    if unknown:
        # Typos in test scenarios should fail loudly, not run with defaults.
        raise invalid_request(f"Unknown sim field(s) {unknown}; allowed: {list(SIM_FIELDS)}.", param="sim")
    output_tokens = raw.get("output_tokens")
    if output_tokens is not None and (not _is_int(output_tokens) or output_tokens < 0):
        raise invalid_request("sim.output_tokens must be an integer >= 0.", param="sim.output_tokens")
    fail_status = raw.get("fail_status")
    if fail_status is not None and fail_status not in OUTAGE_STATUSES:
        raise invalid_request(f"sim.fail_status must be one of {list(OUTAGE_STATUSES)}.", param="sim.fail_status")
    retry_after = raw.get("fail_retry_after")
    if retry_after is not None and (not _is_number(retry_after) or retry_after < 0):
        raise invalid_request("sim.fail_retry_after must be a number >= 0.", param="sim.fail_retry_after")
    latency_ms = raw.get("latency_ms", 0.0)
    if latency_ms is None:
        latency_ms = 0.0
    if not _is_number(latency_ms) or latency_ms < 0:
        raise invalid_request("sim.latency_ms must be a number >= 0.", param="sim.latency_ms")
    fail_after = raw.get("fail_after_tokens")
    if fail_after is not None and (not _is_int(fail_after) or fail_after < 0):
        raise invalid_request("sim.fail_after_tokens must be an integer >= 0.", param="sim.fail_after_tokens")
    return SimOverrides(output_tokens, fail_status, retry_after, float(latency_ms), fail_after)


def _json_body(raw_body: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw_body)
    except (ValueError, UnicodeDecodeError):
        raise invalid_request("We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is a required string.", param="model")
    return body


def _max_tokens(body: dict[str, Any], default_max_tokens: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        value = body.get(name)
        if value is not None:
            if not _is_int(value) or value < 1:
                raise invalid_request(f"'{name}' must be an integer >= 1.", param=name)
            return value
    return default_max_tokens


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean.", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid_request("'stream_options' must be an object.", param="stream_options")
    n = body.get("n", 1)
    if n not in (1, None):
        raise invalid_request("The simulator only supports n=1.", param="n")
    return stream, bool(stream_options.get("include_usage", False))


def parse_chat_request(raw_body: bytes, models: list[str], default_max_tokens: int) -> ChatRequest:
    body = _json_body(raw_body)
    model = body["model"]
    messages = _parse_messages(body.get("messages"))
    max_tokens = _max_tokens(body, default_max_tokens)
    stream, include_usage = _stream_options(body)
    sim = _parse_sim(body.get("sim"))

    # Checked last so a malformed body is a 400 whatever model it names.
    if model not in models:
        raise model_not_found(model)
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        sim=sim,
        prompt_fields={name: body[name] for name in llm_tokens.PROMPT_FIELDS if body.get(name) is not None},
    )


# A string, or token ids: what the legacy completions' ``prompt`` and the
# embeddings' ``input`` hold, one item per prompt or input.
TokenInput = str | list[int]
MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


def parse_token_inputs(value: Any, param: str) -> list[TokenInput]:
    """A string, an array of strings, an array of token ids or an array of
    arrays of token ids, as a list of items (a string, or one item's ids)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(_is_int(item) and item >= 0 for item in value):
            return [list(value)]
        if all(isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item) for item in value):
            return [list(item) for item in value]
    raise invalid_request(f"'{param}' must be a string, an array of strings, an array of token ids or an array of "
                          f"arrays of token ids (at most {MAX_INPUTS} items).", param=param)


@dataclass(frozen=True)
class CompletionRequest:
    """A legacy ``/v1/completions`` request: one generation per prompt."""

    model: str
    prompts: list[TokenInput]
    max_tokens: int
    stream: bool
    include_usage: bool
    sim: SimOverrides


def parse_completion_request(raw_body: bytes, models: list[str], default_max_tokens: int) -> CompletionRequest:
    body = _json_body(raw_body)
    prompts = parse_token_inputs(body.get("prompt"), "prompt")
    max_tokens = _max_tokens(body, default_max_tokens)
    stream, include_usage = _stream_options(body)
    if stream and len(prompts) > 1:
        raise invalid_request("The simulator streams one prompt at a time.", param="prompt")
    sim = _parse_sim(body.get("sim"))
    if body["model"] not in models:
        raise model_not_found(body["model"])
    return CompletionRequest(model=body["model"], prompts=prompts, max_tokens=max_tokens, stream=stream,
                             include_usage=include_usage, sim=sim)


ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[TokenInput]
    encoding_format: str
    dimensions: int  # the vector's length: the model's own unless the request asks for fewer
    sim: SimOverrides


def parse_embedding_request(raw_body: bytes, models: list[str], native_dimensions: int) -> EmbeddingRequest:
    body = _json_body(raw_body)
    inputs = parse_token_inputs(body.get("input"), "input")
    if any(item == "" for item in inputs):
        raise invalid_request("'input' cannot hold an empty string.", param="input")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise invalid_request(f"'encoding_format' must be one of {list(ENCODING_FORMATS)}.", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = native_dimensions
    elif not _is_int(dimensions) or not 1 <= dimensions <= native_dimensions:
        raise invalid_request(f"'dimensions' must be an integer between 1 and {native_dimensions} for this model.",
                              param="dimensions")
    sim = _parse_sim(body.get("sim"))
    if body["model"] not in models:
        raise model_not_found(body["model"])
    return EmbeddingRequest(model=body["model"], inputs=inputs, encoding_format=encoding_format,
                            dimensions=dimensions, sim=sim)


def embedding_vector(text: str, *, native_dimensions: int, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text``: gaussian draws seeded by the
    text's hash, cut to ``dimensions`` and normalised again, as models
    trained for shortened embeddings (text-embedding-3) are cut."""
    rng = random.Random(hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest())
    full = [rng.gauss(0.0, 1.0) for _ in range(native_dimensions)]
    vector = full[:dimensions]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def embedding_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32s, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(model: str, vectors: list[list[float]], encoding_format: str, prompt_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": index,
             "embedding": embedding_base64(vector) if encoding_format == "base64" else vector}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def text_completion_body(completion_id: str, model: str, choices: list[tuple[str, str]], prompt_tokens: int,
                         completion_tokens: int) -> dict[str, Any]:
    """A legacy completion: ``choices`` is (text, finish_reason) per prompt."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}
                    for index, (text, finish_reason) in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": "inference_sim",
    }


def new_completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    completion_id: str, model: str, content: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": "inference_sim",
    }


class ChunkWriter:
    """Server-sent events for one streamed completion: ``chat.completion.chunk``
    events, or with ``text`` a legacy completion's ``text_completion`` ones
    (each choice carries ``text``, and there is no opening role chunk)."""

    def __init__(self, completion_id: str, model: str, include_usage: bool, *, text: bool = False) -> None:
        self._base = {
            "id": completion_id,
            "object": "text_completion" if text else "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "inference_sim",
        }
        self._include_usage = include_usage
        self._text = text

    def _event(self, payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _choice_chunk(self, delta: dict[str, Any], finish_reason: str | None) -> str:
        if self._text:
            choice = {"text": delta.get("content", ""), "index": 0, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        payload = {**self._base, "choices": [choice]}
        if self._include_usage:
            payload["usage"] = None  # as OpenAI: null on every chunk but the last
        return self._event(payload)

    def role(self) -> str:
        """The opening chunk ("" for a legacy completion, which has none)."""
        return "" if self._text else self._choice_chunk({"role": "assistant", "content": ""}, None)

    def content(self, piece: str) -> str:
        return self._choice_chunk({"content": piece}, None)

    def finish(self, finish_reason: str) -> str:
        return self._choice_chunk({}, finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return self._event({**self._base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
