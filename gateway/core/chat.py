"""A chat request, from body to pool payload: validate an OpenAI
chat-completions body (anything malformed is a 4xx in OpenAI's error shape,
decided before any budget is touched), estimate its tokens against the
workload's caps, and build what the pool receives. The web side does this
for /v1 calls; the worker side again for a job the pacer releases."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from budgets.admission.estimation import Estimate, request_estimate
from gateway.core.context import CallerContext
from gateway.core.errors import bad_request

MESSAGE_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
# Far above any real context window: a number this large is a mistake.
ABSURD_MAX_TOKENS = 1_000_000
# Parameters the pool receives as the caller sent them (after type checks).
PASSTHROUGH_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                       "frequency_penalty": (-2.0, 2.0)}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None
    stream: bool
    passthrough: dict[str, Any] = field(default_factory=dict)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object.", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise bad_request(f"{param}.role must be one of {sorted(MESSAGE_ROLES)}.", param=f"{param}.role")
    content = message.get("content")
    if content is None:
        if role != "assistant" or not message.get("tool_calls"):
            raise bad_request(f"{param}.content is required.", param=f"{param}.content")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{param}.content[{j}] must be a content part object.", param=f"{param}.content")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise bad_request(f"{param}.content[{j}].text must be a string.", param=f"{param}.content")
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of content parts.", param=f"{param}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{param}.name must be a string.", param=f"{param}.name")
    return message


def validate_chat_request(body: dict[str, Any]) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("'model' is required and must be a string.", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    checked = [_validate_message(i, m) for i, m in enumerate(messages)]

    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise bad_request(f"'{name}' must be an integer.", param=name)
        if value < 1:
            raise bad_request(f"'{name}' must be at least 1.", param=name)
        if value > ABSURD_MAX_TOKENS:
            raise bad_request(f"'{name}' must be at most {ABSURD_MAX_TOKENS}.", param=name)
        max_tokens = value if max_tokens is None else min(max_tokens, value)

    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")

    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("Only n=1 is supported: each choice would be budgeted separately.", param="n")

    passthrough: dict[str, Any] = {}
    for name, (low, high) in PASSTHROUGH_NUMBERS.items():
        if name in body and body[name] is not None:
            value = body[name]
            if not _is_number(value) or not low <= value <= high:
                raise bad_request(f"'{name}' must be a number between {low:g} and {high:g}.", param=name)
            passthrough[name] = value
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4)):
            raise bad_request("'stop' must be a string or an array of at most 4 strings.", param="stop")
        passthrough["stop"] = stop
    for name in ("user", "seed", "response_format", "tools", "tool_choice", "logit_bias", "sim"):
        if body.get(name) is not None:
            passthrough[name] = body[name]
    if "seed" in passthrough and not _is_int(passthrough["seed"]):
        raise bad_request("'seed' must be an integer.", param="seed")
    if "user" in passthrough and not isinstance(passthrough["user"], str):
        raise bad_request("'user' must be a string.", param="user")
    return ChatRequest(model=model, messages=checked, max_tokens=max_tokens, stream=bool(stream), passthrough=passthrough)


def body_digest(body: dict[str, Any]) -> str:
    """The identity of a request body for Idempotency-Key checks (chat calls
    and jobs alike): canonical JSON, so key order and spacing do not matter."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def chat_estimate(ctx: CallerContext, chat: ChatRequest) -> Estimate:
    """Tokens the request may use, enforcing the workload's caps (a prompt
    over its cap raises Rejected; max_tokens above its cap is clamped)."""
    return request_estimate(
        messages=chat.messages, max_tokens=chat.max_tokens, prompt_tokens_cap=ctx.prompt_tokens_cap,
        max_tokens_cap=ctx.max_tokens_cap, max_tokens_default=ctx.max_tokens_default,
        encoding_name=ctx.tokenizer, safety_factor=ctx.safety_factor,
    )


def pool_payload(chat: ChatRequest, estimate: Estimate) -> dict[str, Any]:
    """What the pool receives: the caller's body with the applied max_tokens."""
    return {"model": chat.model, "messages": chat.messages, "max_tokens": estimate.output_tokens, **chat.passthrough}
