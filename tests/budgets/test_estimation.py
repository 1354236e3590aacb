"""Every part of a request that a pool tokenizes is in its estimate, and the
workload's prompt cap applies to the total: text in a tool definition, a tool
call, a response format or an image costs what it costs wherever it hides."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

import llm_tokens
from budgets.admission.estimation import request_estimate
from budgets.errors import Rejected

USER = [{"role": "user", "content": "What is the weather in Lyon?"}]
BASE = llm_tokens.count_chat_tokens(USER)
LONG = "a fairly long sentence about the weather " * 50


def tokens(text: str) -> int:
    return llm_tokens.count_text_tokens(text)


def as_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def estimate(messages=USER, request_fields=None, prompt_tokens_cap=1_000_000):
    return request_estimate(messages=messages, request_fields=request_fields, max_tokens=10,
                            prompt_tokens_cap=prompt_tokens_cap, max_tokens_cap=100, max_tokens_default=10,
                            encoding_name="cl100k_base")


def test_plain_messages_count_as_before():
    # <|start|>user<|message|>...<|end|> plus the reply's priming
    assert BASE == 3 + 3 + tokens("user") + tokens(USER[0]["content"])
    assert estimate().input_tokens == BASE


def test_tool_definitions_count_as_their_json():
    tools = [{"type": "function", "function": {"name": "weather", "description": LONG,
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert estimate(request_fields={"tools": tools}).input_tokens == BASE + tokens(as_json(tools))
    assert tokens(as_json(tools)) > tokens(LONG)


def test_legacy_functions_and_choices_count():
    functions = [{"name": "weather", "description": LONG}]
    fields = {"functions": functions, "function_call": {"name": "weather"}, "tool_choice": "required"}
    assert estimate(request_fields=fields).input_tokens == (
        BASE + tokens(as_json(functions)) + tokens(as_json({"name": "weather"})) + tokens("required"))


def test_tool_calls_and_their_results_count():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": json.dumps({"q": LONG})}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    expected = (BASE + 3 + tokens("assistant") + tokens(as_json([call]))
                + 3 + tokens("tool") + tokens("call_1") + tokens("sunny"))
    assert estimate(messages=messages).input_tokens == expected


def test_a_legacy_function_call_message_counts():
    call = {"name": "weather", "arguments": LONG}
    messages = USER + [{"role": "assistant", "content": None, "function_call": call}]
    assert estimate(messages=messages).input_tokens == BASE + 3 + tokens("assistant") + tokens(as_json(call))


def test_a_json_schema_response_format_counts():
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "description": LONG, "schema": {
        "type": "object", "properties": {"summary": {"type": "string", "description": LONG}}}}}
    assert estimate(request_fields={"response_format": response_format}).input_tokens == (
        BASE + tokens(as_json(response_format)))


def test_text_and_refusal_parts_count_exactly():
    messages = [{"role": "user", "content": [{"type": "text", "text": LONG}, {"type": "text", "text": "and more"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": LONG}]}]
    expected = (3 + 3 + tokens("user") + tokens(LONG) + tokens("and more")
                + 3 + tokens("assistant") + tokens(LONG))
    assert estimate(messages=messages).input_tokens == expected


@override_settings(SLUICE_IMAGE_TOKENS=700)
def test_each_image_costs_the_configured_charge_whatever_its_url():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image, image]}]
    assert estimate(messages=messages).input_tokens == 3 + 3 + tokens("user") + tokens("What is this?") + 2 * 700


def test_the_default_image_charge_is_the_documented_one():
    from django.conf import settings

    assert settings.SLUICE_IMAGE_TOKENS == llm_tokens.DEFAULT_IMAGE_TOKENS == 1105


def test_an_unknown_part_still_counts_as_its_json():
    part = {"type": "input_audio", "input_audio": {"data": LONG, "format": "wav"}}
    messages = [{"role": "user", "content": [part]}]
    assert estimate(messages=messages).input_tokens == 3 + 3 + tokens("user") + tokens(as_json(part))


@pytest.mark.parametrize("where", ["tools", "tool_calls", "response_format", "images"])
def test_the_prompt_cap_applies_to_the_total(where):
    hidden = "lorem " * 5_000  # 5,000 tokens
    messages, fields = USER, {}
    if where == "tools":
        fields = {"tools": [{"type": "function", "function": {"name": "f", "description": hidden}}]}
    elif where == "tool_calls":
        messages = USER + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": hidden}}]}]
    elif where == "response_format":
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": hidden}}}
    else:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/i.png"}}] * 5}]
    with pytest.raises(Rejected) as refused:
        estimate(messages=messages, request_fields=fields, prompt_tokens_cap=4_000)
    assert (refused.value.reason, refused.value.status, refused.value.param) == ("context_length_exceeded", 400,
                                                                                 "messages")
    assert "at most 4000 tokens" in refused.value.message
