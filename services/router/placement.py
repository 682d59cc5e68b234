"""Which worker serves a request: a pure decision over typed views (no I/O, no clock).

    w = choose_worker("coder", delta_bytes, views)       # a WorkerView, or None when every worker is full

Rules, in order (ties go to the lower address, so decisions are repeatable):
1. Only workers that are up (healthy, not draining, serving the family's base), not excluded
   (a retry never goes back to the worker that just failed), and with room (`in_flight < capacity`).
2. The base runs anywhere: the least loaded worker.
3. A variant goes where it already is, so its requests batch together on one resident delta and
   N requests for a cold variant cause one load:
     tier 0  the variant has requests in flight there (join them: one batch, one load),
     tier 1  the variant is resident there,
     tier 2  the variant is loading there,
     tier 3  anywhere else: first where the delta fits in the free budget (no eviction), then the
             least loaded.
   Within tiers 0-2 the least loaded worker wins. A variant reaches a second worker only when the
   worker that runs it is full (rule 1): its load demands it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerView:
    """What the router knows about one worker, as of its last Status plus the router's own counts."""

    address: str
    up: bool
    capacity: int  # requests the router runs on it at once
    in_flight: int = 0  # router-side requests running there now
    resident: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    free_bytes: int = 0  # delta budget not in use
    in_flight_by_variant: Mapping[str, int] = field(default_factory=dict)

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    @property
    def load(self) -> float:
        return self.in_flight / self.capacity if self.capacity else 1.0


def tier(view: WorkerView, variant: str, delta_bytes: int) -> tuple[int, int]:
    """(tier, fits) of `variant` on `view`: lower is better (see the module docstring)."""
    if view.in_flight_by_variant.get(variant, 0) > 0:
        return 0, 0
    if variant in view.resident:
        return 1, 0
    if variant in view.loading:
        return 2, 0
    return 3, 0 if delta_bytes <= view.free_bytes else 1


def choose_worker(
    variant: str | None, delta_bytes: int, views: Sequence[WorkerView], exclude: Collection[str] = ()
) -> WorkerView | None:
    """The worker for a request of `variant` (None: the base), or None if no candidate has room."""
    candidates = [v for v in views if v.up and v.address not in exclude and v.has_room]
    if not candidates:
        return None
    if variant is None:
        return min(candidates, key=lambda v: (v.load, v.address))
    return min(candidates, key=lambda v: (*tier(v, variant, delta_bytes), v.load, v.address))
