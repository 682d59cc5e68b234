"""A task that runs one coroutine function now and then every period, until closed.

    refresher = Periodic(registry.refresh, every_s=5.0, what="variant list refresh")
    await refresher.start()     # runs it once, then in the background
    await refresher.close()

One failed run is logged and the next runs on time: the loop survives anything one run does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("services.router")


class Periodic:
    def __init__(self, fn: Callable[[], Awaitable[object]], every_s: float, what: str):
        self.fn, self.every_s, self.what = fn, every_s, what
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.fn()
        self._task = asyncio.create_task(self._loop(), name=self.what)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.fn()
            except Exception:
                log.exception("%s failed", self.what)
