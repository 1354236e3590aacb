"""One value per event loop, for the web's helpers that keep state on the
loop they run on (the door, the shared claim looks, the loop-lag watch,
the key lookups, the shared stream read): a
web process has one loop, but tests and management commands run requests
on loops of their own, which come and go. A closed loop's value is dropped
when the next loop's is made, so the map holds only loops still open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """This running loop's value, made on first use (and again when the one
    kept no longer ``fits``)."""

    def __init__(self) -> None:
        self._values: dict[asyncio.AbstractEventLoop, T] = {}

    def get(self, make: Callable[[], T], *, fits: Callable[[T], bool] | None = None) -> T:
        loop = asyncio.get_running_loop()
        value = self._values.get(loop)
        if value is None or (fits is not None and not fits(value)):
            for closed in [other for other in self._values if other.is_closed()]:
                del self._values[closed]
            value = self._values[loop] = make()
        return value

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
