"""A chat request, from body to pool payload: parse and validate an OpenAI
chat-completions body (anything malformed is a 4xx in OpenAI's error shape,
decided before any budget is touched), check it against the caller's pool,
estimate its tokens against the workload's caps, and build what the pool
receives. The web side does this for /v1 calls; the worker side again for a
job the pacer releases.

What a body may hold is an allow-list (``BODY_FIELDS``): the OpenAI
chat-completions parameters Sluice understands, each type-checked, and
nothing else. An unknown field is refused with a 400 (``unknown_parameter``,
as OpenAI answers "Unrecognized request argument supplied"), never forwarded:
a field the gateway does not understand is one it cannot budget for. The
simulated pool's test switches (``sim``) are refused (400
``sim_controls_disabled``) unless the pool is a simulator and
SLUICE_SIM_CONTROLS is on.

Every string anywhere in the body must be encodable as UTF-8 and free of NUL
characters: a lone surrogate (``"\\ud800"``) cannot be sent to any pool, and
PostgreSQL cannot store a NUL in a job's body, so both are refused here, at
the door, rather than failing a worker or a database write later."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from budgets.admission.estimation import Estimate, request_estimate
from budgets.errors import Rejected
from gateway.core.request.context import CallerContext
from gateway.core.request.endpoints import CHAT_COMPLETIONS, ApiRequest
from gateway.core.errors import bad_request, no_reservation
from gateway.core.request.sim_controls import SIM_FIELDS, SIM_OUTAGE_STATUSES
from llm_tokens import PROMPT_FIELDS

MESSAGE_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
# Far above any real context window: a number this large is a mistake.
ABSURD_MAX_TOKENS = 1_000_000
# JSON nesting a body may have. A tool's JSON schema nests a few levels per
# object; 64 is far beyond any real one, and far below the ~1,000 frames at
# which Python's json (parsing, or serializing the body again for the pool,
# Redis or the database) raises RecursionError.
MAX_JSON_DEPTH = 64
# Integers are int64 (OpenAI's seed is); a longer literal is refused before
# Python converts it (a 5,000-digit one raises ValueError in int()).
MAX_INT = 2**63 - 1
MAX_INT_DIGITS = len(str(MAX_INT))
MAX_TOOLS = 128  # OpenAI's own limit on tools per request
STOP_SEQUENCES_MAX = 4


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None
    stream: bool
    passthrough: dict[str, Any] = field(default_factory=dict)  # forwarded to the pool as given
    sim: dict[str, Any] | None = None  # the simulated pool's test switches (request_check decides)
    stream_usage: bool = False  # stream_options.include_usage: the caller wants the usage chunk

    endpoint = CHAT_COMPLETIONS

    @property
    def prompt_fields(self) -> dict[str, Any]:
        """Parameters besides messages that the pool tokenizes into the prompt."""
        return {name: self.passthrough[name] for name in PROMPT_FIELDS if name in self.passthrough}

    def estimate(self, ctx: CallerContext) -> Estimate:
        return chat_estimate(ctx, self)

    def pool_payload(self, estimate: Estimate) -> dict[str, Any]:
        return pool_payload(self, estimate)


# -- parsing: size, depth, numbers and strings before anything else -----------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NESTING = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# Characters no pool request or database row can carry.
_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")


class _NumberRefused(ValueError):
    pass


def _nests_too_deep(raw: bytes) -> bool:
    """Whether ``raw`` nests arrays/objects deeper than MAX_JSON_DEPTH, its
    strings skipped (exact for valid JSON; anything else json.loads refuses).
    Linear and in C: about 0.15 s for 2 MB of nothing but brackets."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= MAX_JSON_DEPTH:
        return False
    return max(accumulate(map(_NESTING.__getitem__, brackets))) > MAX_JSON_DEPTH


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS or abs(value := int(literal)) > MAX_INT:
        raise _NumberRefused(f"the integer {literal[:20]}... is out of range (at most {MAX_INT} in magnitude)")
    return value


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NumberRefused(f"the number {literal[:40]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise _NumberRefused(f"{name} is not a JSON number")


def _unsendable(text: str, where: str, param: str | None) -> Rejected | None:
    found = _UNSENDABLE.search(text)
    if found is None:
        return None
    what = "a NUL character (\\u0000)" if found.group() == "\x00" else "an unpaired UTF-16 surrogate"
    return bad_request(f"{where} holds {what}, which no pool request or database row can carry.", code="invalid_string",
                       param=param)


def _check_strings(body: Any) -> None:
    """Every string (keys included) is sendable: no NUL, no lone surrogate."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if (refused := _unsendable(value, f"'{path}'", path)) is not None:
                raise refused
        elif isinstance(value, dict):
            for key, item in value.items():
                if (refused := _unsendable(key, f"A key in '{path or 'the body'}'", path or None)) is not None:
                    raise refused
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{path}[{index}]"))


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400: nesting past MAX_JSON_DEPTH is
    refused before parsing, numbers must be finite int64/float, strings
    sendable (``_check_strings``)."""
    if _nests_too_deep(raw):
        raise bad_request(f"The request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels.",
                          code="invalid_json")
    try:
        body = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except _NumberRefused as exc:
        raise bad_request(f"The request body is not acceptable JSON: {exc}.", code="invalid_json") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    _check_strings(body)
    return body


# -- small type checks ---------------------------------------------------------


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _only_keys(value: dict, allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized field(s) in '{param}': {unknown[:5]}; allowed: {sorted(allowed)}.",
                          param=param, code="unknown_parameter")


def object_check(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object.", param=param)
    return value


def _string(value: Any, param: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string.", param=param)


def _name(value: Any, param: str) -> None:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string.", param=param)


# -- messages ------------------------------------------------------------------

MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal"}
IMAGE_DETAILS = {"auto", "low", "high"}


def _validate_part(param: str, part: Any) -> None:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad_request(f"{param} must be a content part object with a 'type'.", param=param)
    kind = part["type"]
    if kind in ("text", "refusal"):
        _only_keys(part, {"type", kind}, param)
        _string(part.get(kind), f"{param}.{kind}")
    elif kind == "image_url":
        _only_keys(part, {"type", "image_url"}, param)
        image = object_check(part.get("image_url"), f"{param}.image_url")
        _only_keys(image, {"url", "detail"}, f"{param}.image_url")
        _name(image.get("url"), f"{param}.image_url.url")
        if image.get("detail") is not None and image["detail"] not in IMAGE_DETAILS:
            raise bad_request(f"'{param}.image_url.detail' must be one of {sorted(IMAGE_DETAILS)}.",
                              param=f"{param}.image_url.detail")
    else:
        raise bad_request(f"{param}: content parts of type {kind[:40]!r} are not supported "
                          "(text, image_url and refusal are).", param=param, code="unsupported_content_part")


def _validate_function_call(value: Any, param: str) -> None:
    call = object_check(value, param)
    _only_keys(call, {"name", "arguments"}, param)
    _name(call.get("name"), f"{param}.name")
    _string(call.get("arguments"), f"{param}.arguments")


def _validate_tool_calls(value: Any, param: str) -> None:
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be an array.", param=param)
    for i, call in enumerate(value):
        item = object_check(call, f"{param}[{i}]")
        _only_keys(item, {"id", "type", "function"}, f"{param}[{i}]")
        _string(item.get("id"), f"{param}[{i}].id")
        if item.get("type", "function") != "function":
            raise bad_request(f"'{param}[{i}].type' must be 'function'.", param=f"{param}[{i}].type")
        _validate_function_call(item.get("function"), f"{param}[{i}].function")


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object.", param=param)
    _only_keys(message, MESSAGE_FIELDS, param)
    role = message.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise bad_request(f"{param}.role must be one of {sorted(MESSAGE_ROLES)}.", param=f"{param}.role")
    content = message.get("content")
    if content is None:
        if role != "assistant" or not (message.get("tool_calls") or message.get("function_call")
                                       or message.get("refusal")):
            raise bad_request(f"{param}.content is required.", param=f"{param}.content")
    elif isinstance(content, list):
        for j, part in enumerate(content):
            _validate_part(f"{param}.content[{j}]", part)
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of content parts.", param=f"{param}.content")
    for key in ("name", "tool_call_id", "refusal"):
        _string(message.get(key), f"{param}.{key}", optional=True)
    if message.get("tool_calls") is not None:
        _validate_tool_calls(message["tool_calls"], f"{param}.tool_calls")
    if message.get("function_call") is not None:
        _validate_function_call(message["function_call"], f"{param}.function_call")
    return message


# -- the other parameters: one checker each, the allow-list --------------------


def _ranged(low: float, high: float) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not _is_number(value) or not low <= value <= high:
            raise bad_request(f"'{name}' must be a number between {low:g} and {high:g}.", param=name)
    return check


def boolean_check(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", param=name)


def integer_check(low: int, high: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not is_int(value) or not low <= value <= high:
            raise bad_request(f"'{name}' must be an integer between {low} and {high}.", param=name)
    return check


def _one_of(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise bad_request(f"'{name}' must be one of {list(choices)}.", param=name)
    return check


def _check_stop(name: str, value: Any) -> None:
    if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)
                                       and len(value) <= STOP_SEQUENCES_MAX)):
        raise bad_request(f"'{name}' must be a string or an array of at most {STOP_SEQUENCES_MAX} strings.", param=name)


def _check_user(name: str, value: Any) -> None:
    _string(value, name)


def _check_function_definition(value: Any, param: str) -> None:
    function = object_check(value, param)
    _only_keys(function, {"name", "description", "parameters", "strict"}, param)
    _name(function.get("name"), f"{param}.name")
    _string(function.get("description"), f"{param}.description", optional=True)
    if function.get("parameters") is not None:
        object_check(function["parameters"], f"{param}.parameters")
    if function.get("strict") is not None:
        boolean_check(f"{param}.strict", function["strict"])


def _check_tools(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'{name}' must be an array of at most {MAX_TOOLS} tools.", param=name)
    for i, tool in enumerate(value):
        item = object_check(tool, f"{name}[{i}]")
        _only_keys(item, {"type", "function"}, f"{name}[{i}]")
        if item.get("type") != "function":
            raise bad_request(f"'{name}[{i}].type' must be 'function'.", param=f"{name}[{i}].type")
        _check_function_definition(item.get("function"), f"{name}[{i}].function")


def _check_functions(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'{name}' must be an array of at most {MAX_TOOLS} functions.", param=name)
    for i, function in enumerate(value):
        _check_function_definition(function, f"{name}[{i}]")


def _check_tool_choice(name: str, value: Any) -> None:
    if value in ("none", "auto", "required"):
        return
    choice = object_check(value, name) if not isinstance(value, str) else None
    if choice is None:
        raise bad_request(f"'{name}' must be 'none', 'auto', 'required' or a function choice.", param=name)
    _only_keys(choice, {"type", "function"}, name)
    if choice.get("type") != "function":
        raise bad_request(f"'{name}.type' must be 'function'.", param=f"{name}.type")
    function = object_check(choice.get("function"), f"{name}.function")
    _only_keys(function, {"name"}, f"{name}.function")
    _name(function.get("name"), f"{name}.function.name")


def _check_function_call(name: str, value: Any) -> None:
    if value in ("none", "auto"):
        return
    choice = object_check(value, name)
    _only_keys(choice, {"name"}, name)
    _name(choice.get("name"), f"{name}.name")


def _check_response_format(name: str, value: Any) -> None:
    response_format = object_check(value, name)
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        _only_keys(response_format, {"type"}, name)
    elif kind == "json_schema":
        _only_keys(response_format, {"type", "json_schema"}, name)
        schema = object_check(response_format.get("json_schema"), f"{name}.json_schema")
        _only_keys(schema, {"name", "description", "schema", "strict"}, f"{name}.json_schema")
        _name(schema.get("name"), f"{name}.json_schema.name")
        _string(schema.get("description"), f"{name}.json_schema.description", optional=True)
        if schema.get("schema") is not None:
            object_check(schema["schema"], f"{name}.json_schema.schema")
        if schema.get("strict") is not None:
            boolean_check(f"{name}.json_schema.strict", schema["strict"])
    else:
        raise bad_request(f"'{name}.type' must be one of ['text', 'json_object', 'json_schema'].", param=f"{name}.type")


def _check_logit_bias(name: str, value: Any) -> None:
    bias = object_check(value, name)
    if len(bias) > 300 or not all(key.isdigit() and _is_number(v) and -100 <= v <= 100 for key, v in bias.items()):
        raise bad_request(f"'{name}' must map at most 300 token ids to numbers between -100 and 100.", param=name)


def sim_check(name: str, value: Any) -> None:
    """The simulator's own rules (gateway/core/request/sim_controls.py), checked here
    too so a bad switch is refused before it costs a pool call."""
    sim = object_check(value, name)
    _only_keys(sim, set(SIM_FIELDS), name)
    for key, low in (("output_tokens", 0), ("latency_ms", 0), ("fail_retry_after", 0), ("fail_after_tokens", 0)):
        item = sim.get(key)
        if item is not None and (not _is_number(item) or item < low
                                 or (key in ("output_tokens", "fail_after_tokens") and not is_int(item))):
            raise bad_request(f"'{name}.{key}' must be a number >= {low}.", param=f"{name}.{key}")
    if sim.get("fail_status") is not None and sim["fail_status"] not in SIM_OUTAGE_STATUSES:
        raise bad_request(f"'{name}.fail_status' must be one of {list(SIM_OUTAGE_STATUSES)}.",
                          param=f"{name}.fail_status")


# Parameters forwarded to the pool as given, once their checker accepts them.
PASSTHROUGH: dict[str, Callable[[str, Any], None]] = {
    "temperature": _ranged(0.0, 2.0),
    "top_p": _ranged(0.0, 1.0),
    "presence_penalty": _ranged(-2.0, 2.0),
    "frequency_penalty": _ranged(-2.0, 2.0),
    "stop": _check_stop,
    "user": _check_user,
    "seed": integer_check(-MAX_INT - 1, MAX_INT),
    "response_format": _check_response_format,
    "tools": _check_tools,
    "tool_choice": _check_tool_choice,
    "parallel_tool_calls": boolean_check,
    "functions": _check_functions,
    "function_call": _check_function_call,
    "logit_bias": _check_logit_bias,
    "logprobs": boolean_check,
    "top_logprobs": integer_check(0, 20),
    "reasoning_effort": _one_of("minimal", "low", "medium", "high"),
}
# Everything a body may hold: the above, those read here, and sim.
BODY_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "sim",
               *PASSTHROUGH}


def validate_chat_request(body: dict[str, Any]) -> ChatRequest:
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0][:100]}.", param=unknown[0][:100],
                          code="unknown_parameter")
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
        if not is_int(value):
            raise bad_request(f"'{name}' must be an integer.", param=name)
        if value < 1:
            raise bad_request(f"'{name}' must be at least 1.", param=name)
        if value > ABSURD_MAX_TOKENS:
            raise bad_request(f"'{name}' must be at most {ABSURD_MAX_TOKENS}.", param=name)
        max_tokens = value if max_tokens is None else min(max_tokens, value)

    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    stream_usage = False
    if body.get("stream_options") is not None:
        stream_options = object_check(body["stream_options"], "stream_options")
        _only_keys(stream_options, {"include_usage"}, "stream_options")
        include_usage = stream_options.get("include_usage", False)
        if include_usage is not None and not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean.", param="stream_options.include_usage")
        stream_usage = bool(include_usage)

    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise bad_request("Only n=1 is supported: each choice would be budgeted separately.", param="n")

    passthrough: dict[str, Any] = {}
    for name, check in PASSTHROUGH.items():
        if body.get(name) is not None:
            check(name, body[name])
            passthrough[name] = body[name]
    sim = body.get("sim")
    if sim is not None:
        sim_check("sim", sim)
    return ChatRequest(model=model, messages=checked, max_tokens=max_tokens, stream=bool(stream),
                       passthrough=passthrough, sim=sim, stream_usage=bool(stream) and stream_usage)


def request_check(ctx: CallerContext, api_request: ApiRequest, *, streaming: bool = False) -> None:
    """What a valid body of any endpoint may still not ask of this caller's
    pools. Only the synchronous API streams (``streaming``); an async job's
    answer is read later, so a job that asks to stream is refused."""
    if api_request.stream and not streaming:
        raise Rejected(reason="stream_unsupported", message="Jobs do not stream: send stream=false and read the "
                       "job's result (or give a callback_url).", status=400, param="stream",
                       error_type="invalid_request_error")
    if ctx.pool_id is None:
        raise no_reservation(on_any_pool=True)
    if api_request.model not in ctx.served_models:
        raise Rejected(reason="model_not_found", message=f"The model '{api_request.model}' does not exist on this workload's pool.",
                       status=404, param="model", error_type="invalid_request_error")
    if api_request.sim is not None and not all(c.sim_controls for c in ctx.route(api_request.model)):
        # Test switches on a real pool (or with SLUICE_SIM_CONTROLS off) would
        # let one caller inject failures that cut every tenant's capacity;
        # every pool the request may be routed to must take them.
        raise bad_request("'sim' (the simulated pool's test switches) is not accepted for this workload's pool.",
                          param="sim", code="sim_controls_disabled")


def body_digest(body: dict[str, Any]) -> str:
    """The identity of a request body for Idempotency-Key checks (chat calls
    and jobs alike): canonical JSON, so key order and spacing do not matter."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def chat_estimate(ctx: CallerContext, chat: ChatRequest) -> Estimate:
    """Tokens the request may use, enforcing the workload's caps (a prompt
    over its cap raises Rejected; max_tokens above its cap is clamped). The
    prompt is every part the pool tokenizes: messages, tools, response format."""
    return request_estimate(
        messages=chat.messages, request_fields=chat.prompt_fields, max_tokens=chat.max_tokens,
        prompt_tokens_cap=ctx.prompt_tokens_cap, max_tokens_cap=ctx.max_tokens_cap,
        max_tokens_default=ctx.max_tokens_default, encoding_name=ctx.tokenizer, safety_factor=ctx.safety_factor,
    )


def pool_payload(chat: ChatRequest, estimate: Estimate) -> dict[str, Any]:
    """What the pool receives: the caller's body with the applied max_tokens."""
    payload = {"model": chat.model, "messages": chat.messages, "max_tokens": estimate.output_tokens, **chat.passthrough}
    return pool_payload_finish(payload, stream=chat.stream, sim=chat.sim)


def pool_payload_finish(payload: dict[str, Any], *, stream: bool, sim: dict[str, Any] | None) -> dict[str, Any]:
    """Every endpoint's pool body, finished: a stream always asks the pool
    for its usage (settlement needs it, whether or not the caller wants the
    usage chunk: gateway/core/request/streams.py), and the test switches go
    along where request_check allowed them."""
    if stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    if sim is not None:
        payload["sim"] = sim
    return payload
