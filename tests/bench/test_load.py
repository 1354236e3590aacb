"""The bench's Sampler stops when asked, also when Python 3.11's
``asyncio.wait_for`` swallows the cancel (its inner call finished in the
same turn of the loop as the cancel: gh-86296, fixed in 3.12).

No __init__.py in this folder on purpose (see test_baseline_gateway.py)."""

from __future__ import annotations

import asyncio
import time

from bench.load import Sampler


def test_stop_ends_the_sampler_when_wait_for_swallows_the_cancel():
    async def scenario() -> tuple[bool, list[dict]]:
        loop = asyncio.get_running_loop()
        inside = asyncio.Event()
        pending: list[asyncio.Future] = []

        async def probe() -> dict:
            # As the bench's HttpClient does: the exchange under wait_for.
            inner = loop.create_future()
            pending.append(inner)
            inside.set()
            return await asyncio.wait_for(inner, 30)

        sampler = Sampler(probe, 0.05, time.monotonic()).start()
        await inside.wait()
        # The answer lands and the stop arrives in the same turn of the loop:
        # wait_for sees its inner future done when the cancel reaches it.
        pending[-1].set_result({"n": 1})
        stopping = asyncio.ensure_future(sampler.stop())
        done, _ = await asyncio.wait({stopping}, timeout=3)
        if not done:  # the sampler kept polling: answer its probes so it can be torn down
            sampler._stopping = True
            for fut in pending:
                if not fut.done():
                    fut.set_result({})
            stopping.cancel()
        return bool(done), sampler.samples

    stopped, samples = asyncio.run(scenario())
    assert stopped, "Sampler.stop did not return: the loop outlived a swallowed cancel"
    # The probe's answer, returned by wait_for in place of the cancel, is kept; nothing after it.
    assert [s.get("n") for s in samples] == [1]


def test_stop_cancels_a_probe_in_progress():
    async def scenario() -> list[dict]:
        started = asyncio.Event()

        async def probe() -> dict:
            started.set()
            await asyncio.sleep(30)
            return {}

        sampler = Sampler(probe, 0.05, time.monotonic()).start()
        await started.wait()
        return await asyncio.wait_for(sampler.stop(), 3)

    assert asyncio.run(scenario()) == []
