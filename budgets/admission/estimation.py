"""A request's cost before it runs: exact prompt tokens (tiktoken, chat
overhead included) plus the output tokens it may generate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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


def prompt_tokens_estimate(*, messages: list[dict[str, Any]], encoding_name: str, safety_factor: float = 1.0) -> int:
    counted = llm_tokens.count_chat_tokens(messages, encoding_name)
    # Models with another tokenizer: over-estimate by the pool's factor;
    # settlement corrects it with the usage the pool reports.
    return counted if safety_factor <= 1.0 else math.ceil(counted * safety_factor)


def request_estimate(
    *,
    messages: list[dict[str, Any]],
    max_tokens: int | None,
    prompt_tokens_cap: int,
    max_tokens_cap: int,
    max_tokens_default: int,
    encoding_name: str,
    safety_factor: float = 1.0,
) -> Estimate:
    """Estimate, enforcing the workload's caps: a prompt over its cap is
    refused; max_tokens above its cap is clamped, missing means the default."""
    prompt_tokens = prompt_tokens_estimate(messages=messages, encoding_name=encoding_name, safety_factor=safety_factor)
    if prompt_tokens > prompt_tokens_cap:
        raise Rejected(
            reason="context_length_exceeded",
            message=(
                f"This workload accepts prompts of at most {prompt_tokens_cap} tokens; "
                f"your messages resulted in {prompt_tokens} tokens."
            ),
            status=400,
            param="messages",
            error_type="invalid_request_error",
        )
    applied = max_tokens_default if max_tokens is None else max_tokens
    clamped = applied > max_tokens_cap
    applied = min(applied, max_tokens_cap)
    return Estimate(input_tokens=prompt_tokens, output_tokens=applied, max_tokens_requested=max_tokens, clamped=clamped)
