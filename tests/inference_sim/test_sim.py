"""The simulated pool, end to end over HTTP (httpx and the official openai SDK).

Assertions are on exact counts and on simulated-time headers, never on wall
time: the only sleeps wait *at least* as long as the server asked.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import llm_tokens
import openai
import pytest

from inference_sim.limits import SlidingWindowLimiter, WindowEntry
from inference_sim.sampling import OutputLengthSampler
from inference_sim.text import completion_text, token_pieces

ENC = llm_tokens.get_encoding("cl100k_base")
USER = [{"role": "user", "content": "Say something."}]


def n_tokens(text: str) -> int:
    return len(ENC.encode(text, disallowed_special=()))


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    events: list[dict | str] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def step_ms(batch: int = 1, prefill_tokens: int = 0, capacity_factor: float = 1.0) -> float:
    """One engine step with the default latency parameters."""
    return (0.1 * prefill_tokens + 20.0 + 0.5 * batch) / capacity_factor


# -- pure units (no server) ---------------------------------------------------


def test_generated_text_has_exactly_n_tokens():
    for n in [*range(0, 40), 255, 256, 1000]:
        pieces = list(token_pieces(n))
        assert len(pieces) == n
        assert n_tokens(completion_text(n)) == n
        assert all(n_tokens(piece) == 1 for piece in pieces)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def to_real(self, sim_seconds: float) -> float:
        return sim_seconds


def test_sliding_window_counts_settles_and_expires():
    clock = FakeClock()
    limiter = SlidingWindowLimiter(clock)  # type: ignore[arg-type]
    first = limiter.try_admit(rpm=2, tpm=1000, tokens=600)
    assert isinstance(first, WindowEntry)
    too_big = limiter.try_admit(rpm=2, tpm=1000, tokens=500)
    assert too_big.kind == "tokens" and too_big.retry_after_sim_s == 60.0
    limiter.settle(first, 100)  # the answer was short: the allowance comes back
    clock.t = 10.0
    second = limiter.try_admit(rpm=2, tpm=1000, tokens=500)
    assert isinstance(second, WindowEntry)
    over_rpm = limiter.try_admit(rpm=2, tpm=1000, tokens=1)
    assert over_rpm.kind == "requests" and over_rpm.retry_after_sim_s == 50.0  # until `first` leaves
    assert limiter.usage() == (2, 600)
    clock.t = 60.0
    assert limiter.usage() == (1, 500)
    limiter.release(second)
    assert limiter.usage() == (0, 0)
    assert limiter.try_admit(rpm=2, tpm=1000, tokens=1001).retry_after_sim_s == 60.0  # never fits


def test_sampler_is_seeded_and_heavy_tailed():
    draws = [OutputLengthSampler(7, 128, 1.0).sample() for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same first draw
    sampler = OutputLengthSampler(7, 128, 1.0)
    many = sorted(sampler.sample() for _ in range(2000))
    assert 100 <= many[1000] <= 160  # median near 128
    assert many[-1] > 10 * many[1000]  # a long tail


# -- endpoints and wire format -------------------------------------------------


def test_health_and_models(sim):
    assert sim.http.get("/healthz").json() == {"status": "ok"}
    listing = sim.http.get("/v1/models").json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["sim-small", "sim-large", "sim-embed"]
    assert [m.id for m in sim.openai.models.list()] == ["sim-small", "sim-large", "sim-embed"]


PROMPTS = [
    [{"role": "user", "content": "Hello there, how are you today?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarise: " + "the quick brown fox " * 50, "name": "alice"},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " part two"}]},
    ],
    [{"role": "user", "content": "Unicode: naïve café 日本語 🚀 <|endoftext|>"}],
]


@pytest.mark.parametrize("messages", PROMPTS)
def test_prompt_tokens_equal_llm_tokens_count(sim, messages):
    expected = llm_tokens.count_chat_tokens(messages, encoding_name="cl100k_base")
    body = sim.chat(messages=messages, sim={"output_tokens": 3}).json()
    assert body["usage"]["prompt_tokens"] == expected
    completion = sim.openai.chat.completions.create(
        model="sim-large", messages=messages, extra_body={"sim": {"output_tokens": 3}}
    )
    assert completion.usage.prompt_tokens == expected
    assert completion.usage.total_tokens == expected + 3


def test_completion_shape_and_exact_output_override(sim):
    response = sim.chat(messages=USER, sim={"output_tokens": 17})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "sim-small"
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 17
    assert n_tokens(choice["message"]["content"]) == 17
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 17


def test_sampled_content_tokenizes_to_completion_tokens(sim):
    for _ in range(5):
        body = sim.chat(messages=USER, max_tokens=300).json()
        completion_tokens = body["usage"]["completion_tokens"]
        assert 1 <= completion_tokens <= 300
        assert n_tokens(body["choices"][0]["message"]["content"]) == completion_tokens


def test_truncation_at_max_tokens(sim):
    body = sim.chat(sim={"output_tokens": 50}, max_tokens=10).json()
    assert body["usage"]["completion_tokens"] == 10
    assert body["choices"][0]["finish_reason"] == "length"
    assert n_tokens(body["choices"][0]["message"]["content"]) == 10

    body = sim.chat(sim={"output_tokens": 50}, max_completion_tokens=12).json()
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (12, "length")

    body = sim.chat(sim={"output_tokens": 10}, max_tokens=10).json()
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (10, "stop")

    body = sim.chat(sim={"output_tokens": 300}).json()  # default max_tokens is 256
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (256, "length")

    completion = sim.openai.chat.completions.create(
        model="sim-small", messages=USER, max_tokens=5, extra_body={"sim": {"output_tokens": 9}}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5


def test_errors_are_openai_shaped(sim):
    cases = [
        (sim.http.post("/v1/chat/completions", content=b"{not json"), 400, None),
        (sim.chat(messages=[]), 400, "messages"),
        (sim.chat(max_tokens=0), 400, "max_tokens"),
        (sim.chat(sim={"output_tokenz": 3}), 400, "sim"),
        (sim.chat(model="gpt-nope"), 404, "model"),
    ]
    for response, status, param in cases:
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
    assert cases[-1][0].json()["error"]["code"] == "model_not_found"

    with pytest.raises(openai.NotFoundError):
        sim.openai.chat.completions.create(model="gpt-nope", messages=USER)
    with pytest.raises(openai.BadRequestError):
        sim.openai.chat.completions.create(model="sim-small", messages=USER, extra_body={"sim": {"fail_status": 418}})


def test_request_larger_than_kv_cache_is_rejected(sim):
    sim.capacity(kv_cache_tokens=100).raise_for_status()
    response = sim.chat(sim={"output_tokens": 200}, max_tokens=200)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


# -- streaming -------------------------------------------------------------------


def test_streaming_chunks_and_usage_over_httpx(sim):
    response = sim.chat(messages=USER, stream=True, stream_options={"include_usage": True}, sim={"output_tokens": 6})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    role, *content, finish, usage_chunk, _ = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in content] == list(token_pieces(6))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == role["id"] for c in content)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    prompt_tokens = llm_tokens.count_chat_tokens(USER)
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6}

    # Without include_usage: no usage chunk, and truncation still says "length".
    events = sse_events(sim.chat(stream=True, max_tokens=4, sim={"output_tokens": 9}))
    assert len(events) == 1 + 4 + 1 + 1
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


def test_streaming_with_sdk(sim):
    stream = sim.openai.chat.completions.create(
        model="sim-small",
        messages=PROMPTS[1],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=64,
        extra_body={"sim": {"output_tokens": 40}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert n_tokens(text) == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == llm_tokens.count_chat_tokens(PROMPTS[1])
    stats = sim.stats()
    assert (stats["completed"], stats["completion_tokens"], stats["in_flight"]) == (1, 40, 0)


def test_a_stream_can_be_made_to_break_off_after_some_tokens(sim):
    events = sse_events(sim.chat(messages=USER, stream=True, stream_options={"include_usage": True},
                                 sim={"output_tokens": 20, "fail_after_tokens": 7}))
    # the role chunk, 7 tokens, then nothing: no finish, no usage, no [DONE]
    role, *content = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["delta"]["content"] for c in content] == list(token_pieces(7))
    stats = sim.stats()
    assert (stats["failed"], stats["completed"], stats["completion_tokens"], stats["in_flight"]) == (1, 0, 0, 0)


# -- simulated latency -----------------------------------------------------------


def test_latency_headers_follow_the_step_model_and_capacity_factor(sim):
    prompt_tokens = llm_tokens.count_chat_tokens(USER)
    response = sim.chat(sim={"output_tokens": 10})
    assert float(response.headers["x-sim-prefill-ms"]) == pytest.approx(step_ms(1, prompt_tokens), abs=1e-3)
    assert float(response.headers["x-sim-decode-ms"]) == pytest.approx(9 * step_ms(1), abs=1e-3)
    assert float(response.headers["x-sim-queue-ms"]) >= 0

    changed = sim.capacity(capacity_factor=0.5)
    assert changed.status_code == 200
    assert changed.json()["capacity_factor"] == 0.5
    response = sim.chat(sim={"output_tokens": 10})
    assert float(response.headers["x-sim-prefill-ms"]) == pytest.approx(step_ms(1, prompt_tokens, 0.5), abs=1e-3)
    assert float(response.headers["x-sim-decode-ms"]) == pytest.approx(9 * step_ms(1, 0, 0.5), abs=1e-3)

    # latency_ms adds simulated time but does not change the engine's numbers.
    response = sim.chat(sim={"output_tokens": 1, "latency_ms": 100})
    assert float(response.headers["x-sim-decode-ms"]) == 0.0


def test_capacity_updates_validate_and_reset_restores(sim):
    config = sim.capacity(slots=3, tpm=1000, rpm=7, kv_cache_tokens=5000).json()
    assert (config["slots"], config["tpm"], config["rpm"], config["kv_cache_tokens"]) == (3, 1000, 7, 5000)
    assert sim.stats()["config"]["slots"] == 3
    for bad in ({"capacity_factor": 0}, {"slots": 0}, {"tpm": -1}, {"slots": 1.5}, {"gpus": 2}, {"rpm": "10"}):
        response = sim.capacity(**bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert sim.stats()["config"]["slots"] == 3  # a refused update changes nothing
    sim.reset()
    config = sim.stats()["config"]
    assert (config["slots"], config["tpm"], config["rpm"], config["capacity_factor"]) == (16, 0, 0, 1.0)


# -- provider limits ---------------------------------------------------------------
# The 429 checks run on slow_sim, whose 60 s window lasts 30 real seconds, so
# no machine is slow enough to let it slide between two requests.


def test_rpm_limit_returns_429_with_retry_headers(slow_sim):
    sim = slow_sim
    sim.capacity(rpm=3).raise_for_status()
    remaining = []
    for _ in range(3):
        response = sim.chat(sim={"output_tokens": 1})
        assert response.status_code == 200
        remaining.append(response.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]

    response = sim.chat(sim={"output_tokens": 1})
    assert response.status_code == 429
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    time_scale = sim.stats()["config"]["time_scale"]
    retry_ms = int(response.headers["retry-after-ms"])
    assert 0 < retry_ms <= math.ceil(60_000 / time_scale)
    assert int(response.headers["retry-after"]) == math.ceil(retry_ms / 1000)
    # stated per real minute: the simulator runs time_scale times faster
    assert response.headers["x-ratelimit-limit-requests"] == str(round(3 * time_scale))
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    # The window is full: its reset is when the oldest request slides out,
    # at most the Retry-After just given (both in real time).
    reset_ms = duration_ms(response.headers["x-ratelimit-reset-requests"])
    assert 0 < reset_ms <= retry_ms

    with pytest.raises(openai.RateLimitError) as caught:
        sim.openai.chat.completions.create(model="sim-small", messages=USER)
    assert caught.value.response.headers["retry-after"]

    stats = sim.stats()
    assert (stats["completed"], stats["rejected_429"], stats["rate_limited"]["requests"]) == (3, 2, 2)
    assert stats["by_status"] == {"200": 3, "429": 2}


def test_tpm_limit_checks_worst_case_and_counts_actual_usage(slow_sim):
    sim = slow_sim
    prompt_tokens = llm_tokens.count_chat_tokens(USER)
    max_tokens = 100
    tpm = prompt_tokens + max_tokens  # the first request fits exactly
    sim.capacity(tpm=tpm).raise_for_status()

    first = sim.chat(sim={"output_tokens": 5}, max_tokens=max_tokens)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == str(round(tpm * sim.stats()["config"]["time_scale"]))
    # When it answered, the window still held its worst case (the whole
    # limit): the next token fits once it slides out, within the 60 s
    # window (30 real seconds at this time scale).
    assert 0 < duration_ms(first.headers["x-ratelimit-reset-tokens"]) <= 30_000
    # After it finished the window holds what it used, not its worst case.
    assert sim.stats()["window"]["tokens"] == prompt_tokens + 5

    second = sim.chat(sim={"output_tokens": 5}, max_tokens=max_tokens)
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "tokens"
    assert second.headers["x-ratelimit-remaining-tokens"] == str(tpm - prompt_tokens - 5)
    # Small enough to fit what is left: admitted.
    assert sim.chat(sim={"output_tokens": 5}, max_tokens=max_tokens - prompt_tokens - 5).status_code == 200

    with pytest.raises(openai.RateLimitError):
        sim.openai.chat.completions.create(model="sim-small", messages=USER, max_tokens=max_tokens)

    # A request larger than the whole limit can never fit: wait a full window.
    too_big = sim.chat(max_tokens=tpm)
    assert too_big.status_code == 429
    assert int(too_big.headers["retry-after-ms"]) == math.ceil(60_000 / sim.stats()["config"]["time_scale"])
    stats = sim.stats()
    assert (stats["rate_limited"]["tokens"], stats["window"]["requests"]) == (3, 2)


def test_rate_limit_window_slides_in_simulated_time(sim):
    """On the fast server the 60 s window lasts 1.2 real seconds: waiting the
    retry-after the server gave is enough to be admitted again."""
    sim.capacity(rpm=1).raise_for_status()
    for _attempt in range(3):
        sim.reset()
        sim.capacity(rpm=1).raise_for_status()
        assert sim.chat(sim={"output_tokens": 1}).status_code == 200
        blocked = sim.chat(sim={"output_tokens": 1})
        if blocked.status_code == 429:
            break
        # This machine took longer than a whole window between two requests.
    assert blocked.status_code == 429
    time.sleep(int(blocked.headers["retry-after-ms"]) / 1000 + 0.05)
    assert sim.chat(sim={"output_tokens": 1}).status_code == 200


# -- failures ----------------------------------------------------------------------


def test_injected_failures(sim):
    sim.capacity(rpm=1000).raise_for_status()
    for status in (500, 502, 503):
        response = sim.chat(sim={"fail_status": status})
        assert response.status_code == status
        assert response.json()["error"]["type"] == "server_error"
        with pytest.raises(openai.InternalServerError):
            sim.openai.chat.completions.create(
                model="sim-small", messages=USER, extra_body={"sim": {"fail_status": status}}
            )
    response = sim.chat(sim={"fail_status": 429, "fail_retry_after": 3})
    assert response.status_code == 429
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("3", "3000")
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        sim.openai.chat.completions.create(model="sim-small", messages=USER, extra_body={"sim": {"fail_status": 429}})
    assert sim.chat(sim={"output_tokens": 1}).status_code == 200
    stats = sim.stats()
    assert stats["by_status"] == {"200": 1, "429": 2, "500": 2, "502": 2, "503": 2}
    # Injected failures never reached the pool: the window saw one request.
    assert (stats["completed"], stats["rate_limited"]["requests"]) == (1, 0)
    assert stats["window"]["requests"] <= 1


def test_outage_fails_everything_until_it_ends(slow_sim):
    sim = slow_sim
    response = sim.http.post("/admin/outage", json={"seconds": 600, "status": 503})
    assert response.json()["outage"]["active"] is True
    for _ in range(2):
        failed = sim.chat(sim={"output_tokens": 1})
        assert failed.status_code == 503
        assert failed.json()["error"]["type"] == "server_error"
        assert int(failed.headers["retry-after"]) >= 1
    with pytest.raises(openai.InternalServerError):
        sim.openai.chat.completions.create(model="sim-small", messages=USER)
    assert sim.stats()["outage"]["status"] == 503

    sim.http.post("/admin/outage", json={"seconds": 0}).raise_for_status()
    assert sim.chat(sim={"output_tokens": 1}).status_code == 200

    sim.http.post("/admin/outage", json={"seconds": 600, "status": 429}).raise_for_status()
    assert sim.chat().status_code == 429
    with pytest.raises(openai.RateLimitError):
        sim.openai.chat.completions.create(model="sim-small", messages=USER)
    assert sim.http.post("/admin/outage", json={"seconds": 5, "status": 404}).status_code == 400
    sim.reset()  # also ends an outage
    assert sim.chat(sim={"output_tokens": 1}).status_code == 200


def test_outage_ends_by_itself(sim):
    sim.http.post("/admin/outage", json={"seconds": 2, "status": 502}).raise_for_status()
    time.sleep(2 / sim.stats()["config"]["time_scale"] + 0.1)
    assert sim.stats()["outage"]["active"] is False
    assert sim.chat(sim={"output_tokens": 1}).status_code == 200


# -- counters, seeding, concurrency --------------------------------------------------


def test_stats_counters(slow_sim):
    sim = slow_sim
    usages = [sim.chat(messages=m, sim={"output_tokens": k}).json()["usage"] for m, k in zip(PROMPTS, (4, 8, 15))]
    sim.chat(model="nope")
    sim.chat(messages="nope")
    sim.chat(sim={"fail_status": 502})
    stats = sim.stats()
    assert stats["requests_total"] == 6
    assert stats["completed"] == 3
    assert stats["by_status"] == {"200": 3, "400": 1, "404": 1, "502": 1}
    assert stats["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert stats["completion_tokens"] == 4 + 8 + 15
    assert (stats["in_flight"], stats["running"], stats["queued"], stats["kv_tokens_in_use"]) == (0, 0, 0, 0)
    assert stats["window"]["requests"] == 3
    assert stats["window"]["tokens"] == stats["prompt_tokens"] + stats["completion_tokens"]

    sim.reset()
    stats = sim.stats()
    assert (stats["requests_total"], stats["completed"], stats["prompt_tokens"], stats["by_status"]) == (0, 0, 0, {})
    assert stats["window"]["tokens"] == 0


def test_seeded_output_lengths_replay_after_reset(sim):
    config = sim.stats()["config"]
    sampler = OutputLengthSampler(config["seed"], config["output_median"], config["output_sigma"])
    expected = [min(sampler.sample(), 300) for _ in range(6)]

    def run() -> list[int]:
        return [sim.chat(max_tokens=300).json()["usage"]["completion_tokens"] for _ in range(6)]

    assert run() == expected
    sim.reset()
    assert run() == expected
    assert len(set(expected)) > 1


def test_many_concurrent_requests_share_four_slots(sim):
    # A slower engine (steps of ~4 ms real) so the 40 requests surely overlap.
    sim.capacity(slots=4, capacity_factor=0.1).raise_for_status()
    n = 40
    lengths = [10 + i % 7 for i in range(n)]

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json={
                            "model": "sim-small",
                            "messages": [{"role": "user", "content": f"request number {i}"}],
                            "sim": {"output_tokens": lengths[i]},
                        },
                    )
                    for i in range(n)
                )
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * n
    bodies = [r.json() for r in responses]
    for length, body in zip(lengths, bodies):
        assert body["usage"]["completion_tokens"] == length
        assert n_tokens(body["choices"][0]["message"]["content"]) == length
    assert sum(float(r.headers["x-sim-queue-ms"]) for r in responses) > 0  # most of them queued

    stats = sim.stats()
    assert (stats["requests_total"], stats["completed"], stats["by_status"]) == (n, n, {"200": n})
    assert stats["max_running"] == 4
    assert stats["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert stats["completion_tokens"] == sum(lengths)
    assert (stats["in_flight"], stats["running"], stats["queued"]) == (0, 0, 0)


def test_kv_cache_budget_limits_the_batch(sim):
    prompt_tokens = llm_tokens.count_chat_tokens(USER)
    per_request = prompt_tokens + 20
    budget = 2 * per_request + per_request // 2  # room for two, not three
    sim.capacity(kv_cache_tokens=budget, capacity_factor=0.1).raise_for_status()

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=60) as client:
            body = {"model": "sim-small", "messages": USER, "sim": {"output_tokens": 20}}
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(8)))

    assert [r.status_code for r in asyncio.run(fire())] == [200] * 8
    stats = sim.stats()
    assert stats["max_running"] == 2
    assert stats["max_kv_tokens_in_use"] == 2 * per_request
    assert stats["completed"] == 8


def test_client_disconnect_aborts_the_sequence(sim):
    with pytest.raises(httpx.ReadTimeout):
        sim.http.post(
            "/v1/chat/completions",
            json={"model": "sim-small", "messages": USER, "max_tokens": 5000, "sim": {"output_tokens": 5000}},
            timeout=0.3,
        )
    deadline = time.monotonic() + 10
    while sim.stats()["aborted"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = sim.stats()
    assert (stats["aborted"], stats["completed"], stats["running"], stats["in_flight"]) == (1, 0, 0, 0)
    assert stats["kv_tokens_in_use"] == 0


# -- configuration from flags and environment -------------------------------------


def test_env_flags_schedule_and_zero_latency(start_extra_sim):
    schedule = [{"at_s": 0, "capacity_factor": 0.5, "rpm": 100}, {"at_s": 100, "slots": 2, "tpm": 9000}]
    sim = start_extra_sim(
        "--tpm",
        "5000",  # a flag beats the environment
        "--time-scale",
        "100",
        env={"SIM_TPM": "1", "SIM_MODELS": "m1", "SIM_ZERO_LATENCY": "1", "SIM_SCHEDULE": json.dumps(schedule)},
    )
    sim.reset()  # restarts the schedule clock: the second entry is 1 s (real) away
    config = sim.stats()["config"]
    assert (config["models"], config["zero_latency"], config["time_scale"]) == (["m1"], True, 100.0)
    assert (config["capacity_factor"], config["rpm"], config["tpm"]) == (0.5, 100, 5000)  # at_s 0 applied at start

    response = sim.chat(model="m1", sim={"output_tokens": 33})
    assert response.status_code == 200
    assert n_tokens(response.json()["choices"][0]["message"]["content"]) == 33
    assert [response.headers[f"x-sim-{part}-ms"] for part in ("queue", "prefill", "decode")] == ["0.000"] * 3
    assert sim.chat(model="sim-small").status_code == 404
    events = sse_events(sim.chat(model="m1", stream=True, sim={"output_tokens": 3}))
    assert len(events) == 1 + 3 + 1 + 1

    # The second entry lands 100 simulated seconds (1 s real) after the reset.
    deadline = time.monotonic() + 10
    while sim.stats()["schedule"]["applied"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    config = sim.stats()["config"]
    assert (config["slots"], config["tpm"]) == (2, 9000)

    # Reset replays the schedule from its start.
    sim.reset()
    stats = sim.stats()
    assert stats["schedule"]["applied"] == 1
    assert (stats["config"]["slots"], stats["config"]["capacity_factor"]) == (16, 0.5)


def test_cli_rejects_bad_configuration():
    for args in (["--slots", "0"], ["--schedule", '[{"at_s": 1, "gpus": 3}]'], ["--time-scale", "0"]):
        result = subprocess.run(
            [sys.executable, "-m", "inference_sim", *args],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, args
        assert "error" in result.stderr


def duration_ms(text: str) -> int:
    """Milliseconds of a Go-style duration as the headers write it."""
    minutes, _, rest = text.rpartition("m") if text.endswith("s") and "m" in text[:-2] else ("", "", text)
    if rest.endswith("ms"):
        return int(rest[:-2]) + int(minutes or 0) * 60_000
    return round(float(rest[:-1]) * 1000) + int(minutes or 0) * 60_000


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (1.5, "1.5s"), (59.25, "59.25s"),
    (360, "6m0s"), (61.5, "1m1.5s"),
])
def test_reset_durations_are_written_as_openai_writes_them(seconds, text):
    from inference_sim.limits import go_duration

    assert go_duration(seconds) == text
    assert duration_ms(text) == math.ceil(seconds * 1000)
