"""One value per event loop (gateway/web/per_loop.py): made once per loop,
made again when it no longer fits, and a closed loop's value dropped."""

from __future__ import annotations

import asyncio

from gateway.web.per_loop import PerLoop


def test_each_loop_gets_its_own_value_made_once():
    values: PerLoop[object] = PerLoop()
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    async def twice() -> tuple[object, object]:
        return values.get(make), values.get(make)

    first = asyncio.run(twice())
    second = asyncio.run(twice())
    assert first[0] is first[1] and second[0] is second[1]
    assert first[0] is not second[0] and len(made) == 2
    # the first loop closed: its value went when the second loop's was made
    assert len(values) == 1


def test_a_value_that_no_longer_fits_is_made_again():
    values: PerLoop[dict] = PerLoop()

    async def sizes() -> list[int]:
        seen = [values.get(lambda: {"size": 1}, fits=lambda v: v["size"] == 1)["size"]]
        seen.append(values.get(lambda: {"size": 2}, fits=lambda v: v["size"] == 2)["size"])
        seen.append(values.get(lambda: {"size": 3}, fits=lambda v: v["size"] == 2)["size"])
        return seen

    assert asyncio.run(sizes()) == [1, 2, 2]


def test_values_of_open_loops_are_kept():
    values: PerLoop[str] = PerLoop()
    loops = [asyncio.new_event_loop() for _ in range(2)]
    try:
        for n, loop in enumerate(loops):
            loop.run_until_complete(_get(values, f"loop {n}"))
        assert len(values) == 2
        assert loops[0].run_until_complete(_get(values, "again")) == "loop 0"
    finally:
        for loop in loops:
            loop.close()


async def _get(values: PerLoop[str], text: str) -> str:
    return values.get(lambda: text)
