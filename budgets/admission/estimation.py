"""A request's cost before it runs: exact prompt tokens (tiktoken, chat
overhead included) plus the output tokens it may generate. The prompt is
everything a pool tokenizes: every message part, tool definitions and calls,
the response format's schema, and images at a fixed charge each
(SLUICE_IMAGE_TOKENS); the workload's prompt cap applies to that total."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings

import llm_tokens

from budgets.errors import Rejected


@dataclass(frozen=True)
class Estimate:
    input_tokens: int
    output_tokens: int  # the max_tokens applied: the most the pool may generate
    max_tokens_requested: int | None
    clamped: bool

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def prompt_tokens_estimate(*, messages: list[dict[str, Any]], request_fields: dict[str, Any] | None = None,
                           encoding_name: str, safety_factor: float = 1.0) -> int:
    """``request_fields``: the body's other fields (tools, response_format...)."""
    counted = llm_tokens.count_chat_tokens(messages, encoding_name, request=request_fields,
                                           image_tokens=settings.SLUICE_IMAGE_TOKENS)
    # Models with another tokenizer: over-estimate by the pool's factor;
    # settlement corrects it with the usage the pool reports.
    return counted if safety_factor <= 1.0 else math.ceil(counted * safety_factor)


def request_estimate(
    *,
    messages: list[dict[str, Any]],
    request_fields: dict[str, Any] | None = None,
    max_tokens: int | None,
    prompt_tokens_cap: int,
    max_tokens_cap: int,
    max_tokens_default: int,
    encoding_name: str,
    safety_factor: float = 1.0,
) -> Estimate:
    """Estimate, enforcing the workload's caps: a prompt over its cap is
    refused; max_tokens above its cap is clamped, missing means the default."""
    prompt_tokens = prompt_tokens_estimate(messages=messages, request_fields=request_fields, encoding_name=encoding_name,
                                           safety_factor=safety_factor)
    if prompt_tokens > prompt_tokens_cap:
        raise Rejected(
            reason="context_length_exceeded",
            message=(
                f"This workload accepts prompts of at most {prompt_tokens_cap} tokens; "
                f"your prompt (messages, tools and response format) resulted in {prompt_tokens} tokens."
            ),
            status=400,
            param="messages",
            error_type="invalid_request_error",
            # The sample on the tenant page shows what the caller was told.
            estimated_tokens=prompt_tokens,
        )
    applied, clamped = max_tokens_applied(max_tokens=max_tokens, max_tokens_cap=max_tokens_cap,
                                          max_tokens_default=max_tokens_default)
    return Estimate(input_tokens=prompt_tokens, output_tokens=applied, max_tokens_requested=max_tokens, clamped=clamped)


def max_tokens_applied(*, max_tokens: int | None, max_tokens_cap: int, max_tokens_default: int) -> tuple[int, bool]:
    """The max_tokens a request runs with (missing: the workload's default;
    above its cap: the cap) and whether it was clamped."""
    applied = max_tokens_default if max_tokens is None else max_tokens
    return min(applied, max_tokens_cap), applied > max_tokens_cap


def input_tokens_each(*, inputs: list[str | list[int]], param: str, prompt_tokens_cap: int, encoding_name: str,
                      safety_factor: float = 1.0) -> list[int]:
    """Tokens of each item of a legacy completion's ``prompt`` or an
    embeddings ``input`` (``param``): a string counted exactly (times the
    pool's safety factor for another tokenizer), token ids as given. Each
    item is one sequence on the pool, so the workload's prompt cap applies
    to each, and a refusal names the item."""
    counts = []
    for index, item in enumerate(inputs):
        if isinstance(item, list):
            counted = len(item)
        else:
            counted = llm_tokens.count_text_tokens(item, encoding_name)
            counted = counted if safety_factor <= 1.0 else math.ceil(counted * safety_factor)
        if counted > prompt_tokens_cap:
            where = param if len(inputs) == 1 else f"{param}[{index}]"
            raise Rejected(
                reason="context_length_exceeded",
                message=(f"This workload accepts at most {prompt_tokens_cap} tokens per {param}; "
                         f"'{where}' resulted in {counted} tokens."),
                status=400, param=where, error_type="invalid_request_error", estimated_tokens=counted,
            )
        counts.append(counted)
    return counts
