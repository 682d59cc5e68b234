"""The router's admission queue: requests waiting for a worker with room, bounded per variant and
in total, served by request priority (lower first), oldest first within one. Holds keys and counts only; the caller decides when to wake it.

    ticket = admission.join("coder", "'coder'", priority=0)   # ResourceExhausted when a bound is reached
    await admission.wait(ticket)                   # until wake_all(); then try to place again
    admission.leave(ticket)
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from services.router.errors import ResourceExhausted


@dataclass
class _Waiter:
    key: str
    priority: int
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Admission:
    """Requests waiting for a worker with room: bounded per variant and in total; by priority, then FIFO."""

    def __init__(self, max_total: int, max_per_variant: int):
        self.max_total, self.max_per_variant = max_total, max_per_variant
        self.waiters: collections.OrderedDict[int, _Waiter] = collections.OrderedDict()
        self.by_key: collections.Counter[str] = collections.Counter()
        self._ids = 0

    def __len__(self) -> int:
        return len(self.waiters)

    def join(self, key: str, shown: str, priority: int = 0) -> int:
        if len(self.waiters) >= self.max_total:
            raise ResourceExhausted(
                f"the router's queue is full ({self.max_total} requests wait for a worker); retry later"
            )
        if self.by_key[key] >= self.max_per_variant:
            raise ResourceExhausted(
                f"{self.max_per_variant} requests for {shown} already wait for a worker; retry later"
            )
        self._ids += 1
        self.waiters[self._ids] = _Waiter(key, priority)
        self.by_key[key] += 1
        return self._ids

    async def wait(self, ticket: int) -> None:
        w = self.waiters[ticket]
        await w.event.wait()
        w.event.clear()

    def leave(self, ticket: int) -> None:
        w = self.waiters.pop(ticket)
        self.by_key[w.key] -= 1
        if self.by_key[w.key] <= 0:
            del self.by_key[w.key]

    def wake_all(self) -> None:
        """Capacity freed (or a worker came up): every waiter tries again, best priority first, oldest
        first within one (the loop resumes them in the order they are woken)."""
        for _, w in sorted(self.waiters.items(), key=lambda tw: (tw[1].priority, tw[0])):
            w.event.set()
