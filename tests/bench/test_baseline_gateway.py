"""The bench's minimal priority gateway: classification, clamping, priority
order and the queue timeout. No timing assertions (CONVENTIONS: speed claims
live in bench/).

No __init__.py in this folder on purpose (as tests/inference_sim): with one,
pytest would import it as a package named ``bench`` and shadow the real one."""

from __future__ import annotations

import asyncio

from bench.baseline_gateway import LONG, SHORT, PriorityGateway, clamp, classify
from bench.windows import sliding_max, sliding_series


def _body(chars: int, max_tokens: int | None) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * chars}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def test_short_means_small_prompt_and_small_max_tokens():
    assert classify(_body(1999, 127)) == SHORT
    assert classify(_body(2000, 64)) == LONG
    assert classify(_body(10, 128)) == LONG
    assert classify(_body(10, None)) == LONG  # the pool's default is unknown: long
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 2500}]}],
             "max_tokens": 16}
    assert classify(parts) == LONG


def test_max_tokens_is_clamped_to_1024():
    assert clamp({"max_tokens": 4096})["max_tokens"] == 1024
    assert clamp({"max_completion_tokens": 2000})["max_completion_tokens"] == 1024
    assert clamp({"max_tokens": 64})["max_tokens"] == 64


def test_short_requests_jump_the_queue_and_stale_ones_time_out():
    async def scenario():
        order: list[str] = []
        release = asyncio.Event()

        async def send(body):
            order.append(body["messages"][0]["content"][:1])
            await release.wait()
            return 200, {}, b"{}"

        # given one worker busy with a long request
        gateway = PriorityGateway(send, workers=1, queue_timeout_s=5.0)
        gateway.start()
        first = asyncio.create_task(gateway.submit(_body(3000, 512)))
        await asyncio.sleep(0.01)
        # when a long and then a short request queue behind it
        long_two = asyncio.create_task(gateway.submit({**_body(3000, 512), "messages": [
            {"role": "user", "content": "L" * 3000}]}))
        short = asyncio.create_task(gateway.submit({**_body(10, 16), "messages": [{"role": "user", "content": "S"}]}))
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, long_two, short)
        await gateway.stop()
        return order

    # then the short one is served before the long one that arrived earlier
    assert asyncio.run(scenario()) == ["x", "S", "L"]


def test_a_request_queued_past_the_timeout_gets_503_and_never_reaches_the_pool():
    async def scenario():
        sent = []
        block = asyncio.Event()

        async def send(body):
            sent.append(body)
            await block.wait()
            return 200, {}, b"{}"

        gateway = PriorityGateway(send, workers=1, queue_timeout_s=0.05)
        gateway.start()
        busy = asyncio.create_task(gateway.submit(_body(10, 16)))
        await asyncio.sleep(0.01)
        status, _, body = await gateway.submit(_body(10, 16))
        block.set()
        await busy
        await asyncio.sleep(0.01)
        await gateway.stop()
        return status, body, len(sent), gateway.stats["queue_timeout"]

    status, body, sent, timeouts = asyncio.run(scenario())
    assert (status, sent, timeouts) == (503, 1, 1)
    assert b"queue_timeout" in body


def test_sliding_window_sums():
    events = [(0.0, 5), (10.0, 5), (59.9, 5), (60.0, 7), (125.0, 1)]
    assert sliding_max(events, 60.0) == 17  # [10, 70): 5 + 5 + 7
    xs, ys = sliding_series(events, 60.0, step=30.0, end=120.0)
    assert xs == [0.0, 30.0, 60.0, 90.0, 120.0]
    assert ys == [5, 10, 17, 12, 0]
