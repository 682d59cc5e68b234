"""Which deltas stay resident under a byte budget: LRU weighted by request rate, with pinning.

One small object with no I/O and no clock of its own (every call takes `now`
in seconds), so scripted request sequences test its decisions exactly. The
delta store's host cache uses it; a GPU worker can use it for its device
slots (keys are variant names, sizes are bytes, `busy` are slots in use).

Score. Each request adds 1 to a key's score, and scores halve every
`half_life_s` seconds:

    score(k, now) = Σ_{requests r of k} 2 ** (-(now - t_r) / half_life_s)

(LRFU's "combined recency and frequency"). score × ln2 / half_life_s is the
request rate per second, averaged over roughly the last half-life. Two keys'
scores decay by the same factor, so their order changes only when one is
requested: a key with a high recent rate outranks a key touched once more
recently, while a key that stopped being requested sinks as the others are
used. half_life_s → 0 gives plain LRU, → ∞ gives LFU. Keys are ranked in
the log domain, so the order stays exact after long idle times; ties go to
the least recently used.

Decisions:
- `pinned(now)`: the `pin_top_n` keys with the highest scores among all
  tracked keys; they are never chosen as victims.
- `plan(key, size, now)`: the victims to evict so that `key` fits, lowest
  score first, skipping pinned and `busy` keys; `None` when it cannot be
  admitted (larger than the budget, or the pinned and busy keys leave too
  little room): the caller then serves it without caching it.
  Pinning matters when a newcomer needs more room than the cold keys hold:
  without it, a large delta requested once evicts the hot ones as well.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable
from dataclasses import dataclass

Key = Hashable


@dataclass
class _Stats:
    score: float  # as of `last`
    last: float  # time of the last request


class WeightedLRUPolicy:
    """Eviction and admission decisions for a byte-budgeted cache (no I/O)."""

    def __init__(self, budget_bytes: int, half_life_s: float = 60.0, pin_top_n: int = 0, max_tracked: int = 10_000):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if pin_top_n < 0:
            raise ValueError(f"pin_top_n must be >= 0, got {pin_top_n}")
        self.budget_bytes = budget_bytes
        self.half_life_s = half_life_s
        self.pin_top_n = pin_top_n
        self.max_tracked = max_tracked
        self.resident: dict[Key, int] = {}  # key -> bytes it occupies
        self._stats: dict[Key, _Stats] = {}  # request history, also of keys not resident

    # -- what happened ---------------------------------------------------------------
    def record(self, key: Key, now: float) -> None:
        """One request for `key` at time `now` (hit or miss)."""
        s = self._stats.get(key)
        if s is None:
            self._stats[key] = _Stats(1.0, now)
            if len(self._stats) > self.max_tracked:
                self._forget_coldest(now)
        else:
            s.score = s.score * self._decay(now - s.last) + 1.0
            s.last = max(s.last, now)

    def add(self, key: Key, size: int) -> None:
        """`key` is now resident and occupies `size` bytes."""
        self.resident[key] = size

    def remove(self, key: Key) -> None:
        """`key` is no longer resident (evicted, deleted or replaced)."""
        self.resident.pop(key, None)

    def forget(self, key: Key) -> None:
        """Drop `key` and its request history (e.g. the variant was deleted)."""
        self.resident.pop(key, None)
        self._stats.pop(key, None)

    # -- questions -------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(self.resident.values())

    def score(self, key: Key, now: float) -> float:
        s = self._stats.get(key)
        return 0.0 if s is None else s.score * self._decay(now - s.last)

    def rate(self, key: Key, now: float) -> float:
        """Recent requests per second of `key`."""
        return self.score(key, now) * math.log(2) / self.half_life_s

    def pinned(self, now: float) -> set[Key]:
        """The top `pin_top_n` keys by score (ties: most recent first)."""
        if not self.pin_top_n:
            return set()
        ranked = sorted(self._stats, key=lambda k: self._rank(k, now), reverse=True)
        return set(ranked[: self.pin_top_n])

    def plan(self, key: Key, size: int, now: float, busy: Collection[Key] = ()) -> list[Key] | None:
        """Victims to evict, in order, so that `key` (`size` bytes) fits; None: do not admit it.

        Does not change anything: the caller evicts the victims, then calls `add`.
        """
        if size > self.budget_bytes:
            return None
        others = {k: v for k, v in self.resident.items() if k != key}
        free = self.budget_bytes - sum(others.values())
        if size <= free:
            return []
        protected = self.pinned(now) | set(busy) | {key}
        candidates = sorted((k for k in others if k not in protected), key=lambda k: self._rank(k, now))
        victims = []
        for k in candidates:
            victims.append(k)
            free += others[k]
            if size <= free:
                return victims
        return None

    # -- internals -------------------------------------------------------------------
    def _decay(self, dt: float) -> float:
        return 2.0 ** (-max(dt, 0.0) / self.half_life_s)

    def _rank(self, key: Key, now: float) -> tuple[float, float]:
        # log2(score(now)) + now / half_life, which does not depend on `now`: the order is
        # exact even when the scores themselves have decayed below what a float can hold.
        s = self._stats.get(key)
        return (-math.inf, -math.inf) if s is None else (math.log2(s.score) + s.last / self.half_life_s, s.last)

    def _forget_coldest(self, now: float) -> None:
        # Bound memory for request histories: drop the coldest non-resident tenth.
        idle = sorted((k for k in self._stats if k not in self.resident), key=lambda k: self._rank(k, now))
        for k in idle[: max(1, len(self._stats) // 10)]:
            del self._stats[k]
