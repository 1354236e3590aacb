"""The bodies of the other /v1 endpoints, beside chat (gateway/core/request/chat.py):
legacy completions (``prompt``) and embeddings (``input``). Each is an
allow-list like chat's, refused with an OpenAI-shaped 400 before any budget
is touched, and gives the door (gateway/core/request/endpoints.py) its token
count and its pool payload; everything else is the chat path's.

``prompt`` and ``input`` take the same four forms: a string, an array of
strings, an array of token ids, or an array of arrays of token ids. Each
item is one sequence on the pool, so the workload's prompt cap applies to
each (budgets/admission/estimation.py ``input_tokens_each``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from budgets.admission.estimation import Estimate, input_tokens_each, max_tokens_applied
from gateway.core.errors import bad_request
from gateway.core.request.chat import (ABSURD_MAX_TOKENS, PASSTHROUGH, boolean_check, integer_check, is_int,
                                       object_check, pool_payload_finish, sim_check)
from gateway.core.request.context import CallerContext
from gateway.core.request.endpoints import COMPLETIONS, EMBEDDINGS

MAX_INPUTS = 2048  # OpenAI's limit on the items of one prompt or input array
MAX_TOKEN_ID = 2**31 - 1  # larger than any vocabulary; the pool refuses an id its own lacks
MAX_DIMENSIONS = 65_536
ENCODING_FORMATS = ("float", "base64")

TokenInput = str | list[int]


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value)


def token_inputs(value: Any, param: str) -> tuple[TokenInput, ...]:
    """``value`` as its items (a string, or one item's token ids), or a 400."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(item, str) for item in value):
            return tuple(value)
        if _token_ids(value):
            return (list(value),)
        if all(_token_ids(item) for item in value):
            return tuple(list(item) for item in value)
    raise bad_request(f"'{param}' must be a string, an array of strings, an array of token ids or an array of arrays "
                      f"of token ids (at most {MAX_INPUTS} items, ids between 0 and {MAX_TOKEN_ID}).", param=param)


def _only_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0][:100]}.", param=unknown[0][:100],
                          code="unknown_parameter")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("'model' is required and must be a string.", param="model")
    return model


def _passthrough(body: dict[str, Any], checks: dict) -> dict[str, Any]:
    forwarded = {}
    for name, check in checks.items():
        if body.get(name) is not None:
            check(name, body[name])
            forwarded[name] = body[name]
    return forwarded


def _sim(body: dict[str, Any]) -> dict[str, Any] | None:
    if body.get("sim") is not None:
        sim_check("sim", body["sim"])
    return body.get("sim")


def _string(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string.", param=name)


# -- legacy completions --------------------------------------------------------------

COMPLETION_PASSTHROUGH = {
    **{name: PASSTHROUGH[name] for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "stop",
                                            "user", "seed", "logit_bias")},
    "logprobs": integer_check(0, 5),  # the legacy API's: how many alternatives per token
    "echo": boolean_check,
    "suffix": _string,
}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "stream", "stream_options", "n", "best_of", "sim",
                     *COMPLETION_PASSTHROUGH}


@dataclass(frozen=True)
class CompletionRequest:
    """``POST /v1/completions``: one generation per prompt item, each up to
    ``max_tokens``; weighed and billed as chat."""

    model: str
    prompt: Any  # as the caller sent it: forwarded as given
    prompts: tuple[TokenInput, ...]
    max_tokens: int | None
    stream: bool
    stream_usage: bool = False
    passthrough: dict[str, Any] = field(default_factory=dict)
    sim: dict[str, Any] | None = None

    endpoint = COMPLETIONS

    def estimate(self, ctx: CallerContext) -> Estimate:
        counts = input_tokens_each(inputs=list(self.prompts), param="prompt", prompt_tokens_cap=ctx.prompt_tokens_cap,
                                   encoding_name=ctx.tokenizer, safety_factor=ctx.safety_factor)
        applied, clamped = max_tokens_applied(max_tokens=self.max_tokens, max_tokens_cap=ctx.max_tokens_cap,
                                              max_tokens_default=ctx.max_tokens_default)
        return Estimate(input_tokens=sum(counts), output_tokens=applied * len(self.prompts),
                        max_tokens_requested=self.max_tokens, clamped=clamped)

    def pool_payload(self, estimate: Estimate) -> dict[str, Any]:
        payload = {"model": self.model, "prompt": self.prompt, "max_tokens": estimate.output_tokens // len(self.prompts),
                   **self.passthrough}
        return pool_payload_finish(payload, stream=self.stream, sim=self.sim)


def validate_completion_request(body: dict[str, Any]) -> CompletionRequest:
    _only_fields(body, COMPLETION_FIELDS)
    model = _model(body)
    prompts = token_inputs(body.get("prompt"), "prompt")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or not 1 <= max_tokens <= ABSURD_MAX_TOKENS):
        raise bad_request(f"'max_tokens' must be an integer between 1 and {ABSURD_MAX_TOKENS}.", param="max_tokens")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    stream_usage = False
    if body.get("stream_options") is not None:
        options = object_check(body["stream_options"], "stream_options")
        if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
            raise bad_request("'stream_options' may hold only 'include_usage', a boolean.", param="stream_options")
        stream_usage = bool(options.get("include_usage"))
    for name in ("n", "best_of"):
        if body.get(name) is not None and (not is_int(body[name]) or body[name] != 1):
            raise bad_request(f"Only {name}=1 is supported: each choice would be budgeted separately.", param=name)
    return CompletionRequest(model=model, prompt=body["prompt"], prompts=prompts, max_tokens=max_tokens,
                             stream=bool(stream), stream_usage=bool(stream) and stream_usage,
                             passthrough=_passthrough(body, COMPLETION_PASSTHROUGH), sim=_sim(body))


# -- embeddings -----------------------------------------------------------------


def _encoding_format(name: str, value: Any) -> None:
    if value not in ENCODING_FORMATS:
        raise bad_request(f"'{name}' must be one of {list(ENCODING_FORMATS)}.", param=name)


EMBEDDING_PASSTHROUGH = {
    "encoding_format": _encoding_format,
    # Forwarded: the pool says whether its model can shorten its vectors.
    "dimensions": integer_check(1, MAX_DIMENSIONS),
    "user": PASSTHROUGH["user"],
}
EMBEDDING_FIELDS = {"model", "input", "sim", *EMBEDDING_PASSTHROUGH}


@dataclass(frozen=True)
class EmbeddingRequest:
    """``POST /v1/embeddings``: its estimate is the exact input tokens, no
    output; settled on the pool's ``usage.prompt_tokens``."""

    model: str
    input: Any  # as the caller sent it: forwarded as given
    inputs: tuple[TokenInput, ...]
    passthrough: dict[str, Any] = field(default_factory=dict)
    sim: dict[str, Any] | None = None

    endpoint = EMBEDDINGS
    stream = False
    stream_usage = False

    def estimate(self, ctx: CallerContext) -> Estimate:
        counts = input_tokens_each(inputs=list(self.inputs), param="input", prompt_tokens_cap=ctx.prompt_tokens_cap,
                                   encoding_name=ctx.tokenizer, safety_factor=ctx.safety_factor)
        return Estimate(input_tokens=sum(counts), output_tokens=0, max_tokens_requested=None, clamped=False)

    def pool_payload(self, estimate: Estimate) -> dict[str, Any]:
        return pool_payload_finish({"model": self.model, "input": self.input, **self.passthrough}, stream=False,
                                   sim=self.sim)


def validate_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    _only_fields(body, EMBEDDING_FIELDS)
    model = _model(body)
    inputs = token_inputs(body.get("input"), "input")
    if any(item == "" for item in inputs):
        raise bad_request("'input' cannot hold an empty string.", param="input")
    return EmbeddingRequest(model=model, input=body["input"], inputs=inputs,
                            passthrough=_passthrough(body, EMBEDDING_PASSTHROUGH), sim=_sim(body))
