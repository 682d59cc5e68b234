"""The workers as the router sees them: health and residency from `Status` polls, plus the
router's own in-flight counts and optimistic residency notes between polls.

    pool = WorkerPool(["127.0.0.1:50061", ...], capacity=64, poll_s=1.0, call_timeout_s=5.0)
    await pool.start()                     # first poll of every worker, then a poll loop
    views = pool.views()                   # placement.WorkerView per worker
    pool.acquire(addr, "coder"); ...; pool.release(addr, "coder")

A worker is up when its last `Status` answered, it is ready (base loaded), not draining, and it
serves the family's base (the fingerprint most workers report). A failed call marks it down at
once (`mark_down`); the next successful poll brings it back without a restart.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.rpc.errors import RpcError
from services.router.periodic import Periodic
from services.router.placement import WorkerView

log = logging.getLogger("services.router.pool")


@dataclass(frozen=True)
class BaseInfo:
    """The family's base as the workers report it."""

    name: str
    fingerprint: str


@dataclass
class WorkerState:
    """Mutable per-worker record, owned by the pool."""

    address: str
    client: WorkerClient
    reachable: bool = False
    why_down: str = "not polled yet"
    ready: bool = False
    draining: bool = False
    base: BaseInfo | None = None
    device: str = ""
    resident: set[str] = field(default_factory=set)
    loading: set[str] = field(default_factory=set)
    budget_bytes: int = 0
    used_bytes: int = 0
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    by_variant: collections.Counter = field(default_factory=collections.Counter)
    noted: dict[str, float] = field(default_factory=dict)  # variant -> when the router last learnt its state


class WorkerPool:
    def __init__(
        self,
        addresses: list[str] | tuple[str, ...],
        *,
        capacity: int,
        poll_s: float,
        call_timeout_s: float,
        on_change: Callable[[], None] = lambda: None,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.capacity, self.poll_s, self.call_timeout_s = capacity, poll_s, call_timeout_s
        self.workers = {
            a: WorkerState(a, WorkerClient(a, timeout_s=call_timeout_s, credentials=credentials)) for a in addresses
        }  # credentials: TLS (the router's certificate), or None
        self.on_change = on_change  # called when capacity frees or a worker comes up (wakes queued requests)
        self._poller = Periodic(self.poll_all, poll_s, "worker Status poll")

    async def start(self) -> None:
        """Poll every worker once, then every `poll_s` in the background."""
        await self._poller.start()

    async def close(self) -> None:
        await self._poller.close()
        for w in self.workers.values():
            await w.client.close()

    async def poll_all(self, exclude: tuple[str, ...] | list[str] = ()) -> None:
        await asyncio.gather(*(self.poll(a) for a in self.workers if a not in exclude))

    async def poll(self, address: str) -> bool:
        """Refresh one worker from its Status; returns whether it answered."""
        w = self.workers[address]
        was_up = self.is_up(w)
        asked = time.monotonic()
        try:
            st = await w.client.status(timeout_s=self.call_timeout_s)
        except RpcError as e:
            self._down(w, f"Status failed: {e.code.name}: {e.details[:200]}")
            return False
        w.reachable, w.why_down = True, ""
        self._apply(w, st, asked)
        if self.is_up(w) and not was_up:
            log.info("worker %s is up (%s, base %s)", address, w.device, w.base.name if w.base else "?")
            self.on_change()
        return True

    def _apply(self, w: WorkerState, st: wpb.StatusResponse, asked: float) -> None:
        """Take the worker's report, except for variants the router learnt about after asking: a
        Status answered before a load finished must not undo the token the router saw since."""
        w.ready, w.draining, w.device = st.ready, st.draining, st.device
        w.base = BaseInfo(st.base_model, st.base_fingerprint) if st.base_fingerprint else None
        fresher = {v for v, t in w.noted.items() if t > asked}
        resident = {s.name for s in st.slots if s.state == wpb.DELTA_STATE_RESIDENT}
        loading = {s.name for s in st.slots if s.state == wpb.DELTA_STATE_LOADING}
        w.resident = (resident - fresher) | (w.resident & fresher)
        w.loading = (loading - fresher) | (w.loading & fresher)
        w.noted = {v: t for v, t in w.noted.items() if t > asked}
        w.budget_bytes, w.used_bytes = st.delta_budget_bytes, st.delta_used_bytes
        w.running, w.waiting = st.running, st.waiting

    def _down(self, w: WorkerState, why: str) -> None:
        if w.reachable or w.why_down != why:
            log.warning("worker %s is down: %s", w.address, why)
        w.reachable, w.why_down = False, why

    def mark_down(self, address: str, why: str) -> None:
        """A call to the worker failed at the transport: skip it until a poll answers again."""
        self._down(self.workers[address], why)

    # -- the family's base ---------------------------------------------------------------------------
    def family_base(self) -> BaseInfo | None:
        """The base most reachable, ready workers serve (None before any has reported one)."""
        counts = collections.Counter(w.base for w in self.workers.values() if w.reachable and w.ready and w.base)
        if not counts:
            return None
        return max(counts.items(), key=lambda kv: (kv[1], kv[0].fingerprint))[0]

    def is_up(self, w: WorkerState) -> bool:
        base = self.family_base()
        return w.reachable and w.ready and not w.draining and base is not None and w.base == base

    def why_not_up(self, w: WorkerState) -> str:
        if not w.reachable:
            return w.why_down
        if not w.ready:
            return "loading its base"
        if w.draining:
            return "draining"
        if w.base != self.family_base():
            return f"serves another base ({w.base.name if w.base else '?'})"
        return ""

    # -- views and accounting --------------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        return [
            WorkerView(
                address=w.address,
                up=self.is_up(w),
                capacity=self.capacity,
                in_flight=w.in_flight,
                resident=frozenset(w.resident),
                loading=frozenset(w.loading),
                free_bytes=max(0, w.budget_bytes - w.used_bytes),
                in_flight_by_variant=dict(w.by_variant),
            )
            for w in self.workers.values()
        ]

    def any_up(self, exclude: tuple[str, ...] | list[str] = ()) -> bool:
        return any(self.is_up(w) for a, w in self.workers.items() if a not in exclude)

    def acquire(self, address: str, variant: str | None) -> None:
        w = self.workers[address]
        w.in_flight += 1
        if variant is not None:
            w.by_variant[variant] += 1
            if variant not in w.resident:
                w.loading.add(variant)  # optimistic until the next poll: the worker is loading it for us
                w.noted[variant] = time.monotonic()

    def release(self, address: str, variant: str | None) -> None:
        w = self.workers[address]
        w.in_flight -= 1
        if variant is not None:
            w.by_variant[variant] -= 1
            if w.by_variant[variant] <= 0:
                del w.by_variant[variant]
        self.on_change()

    def note_resident(self, address: str, variant: str) -> None:
        """The worker streamed a token of `variant`: its delta is resident there now."""
        w = self.workers[address]
        w.resident.add(variant)
        w.loading.discard(variant)
        w.noted[variant] = time.monotonic()

    def where(self, variant: str) -> tuple[list[str], list[str]]:
        """(workers where `variant` is resident, workers where it is loading), up workers only."""
        up = [w for w in self.workers.values() if self.is_up(w)]
        return (
            [w.address for w in up if variant in w.resident],
            [w.address for w in up if variant in w.loading and variant not in w.resident],
        )
