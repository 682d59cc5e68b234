"""Who holds a device slot: the lifecycle of every delta on this worker.

    ABSENT ──load──▶ LOADING ──verified──▶ RESIDENT ──evict──▶ EVICTING ──last ref released──▶ ABSENT
                        │                      ▲                   │
                        └──error──▶ FAILED     └────── requested ──┘   (revived: its bytes are still there)

- The budget is bytes: a delta costs one slot of the stacks (`SlotLayout.slot_bytes`)
  plus its embedding/head tensors. Bytes are reserved before the first byte
  moves, so `used_bytes <= budget_bytes` holds at every instant.
- Victims come from `bitdelta.cache_policy.WeightedLRUPolicy` (LRU weighted by
  request rate, the hottest `pin_top_n` pinned). Explicitly pinned deltas
  (LoadDelta pin=true), loading deltas and deltas in use by running
  sequences are never evicted at once; a victim in use turns EVICTING and its
  slot is freed when its last sequence leaves the batch.
- Loads are idempotent and coalesced: one task per delta, every caller awaits it.
- Runs on the asyncio loop only; the engine thread releases references
  through `loop.call_soon_threadsafe(manager.release, name)`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from dataclasses import dataclass

from bitdelta.cache_policy import WeightedLRUPolicy
from services.gpu_worker.errors import DeltaLoadError, NotFound, ResourceExhausted
from services.gpu_worker.loader import SlotWriter, plan_delta
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import DeltaSource

log = logging.getLogger("gpu_worker.manager")


class DeltaState(enum.Enum):
    ABSENT = 1
    LOADING = 2
    RESIDENT = 3
    EVICTING = 4
    FAILED = 5


@dataclass
class DeltaEntry:
    name: str
    state: DeltaState = DeltaState.ABSENT
    slot: int | None = None
    bytes: int = 0
    pinned: bool = False  # explicitly (LoadDelta pin=true)
    refs: int = 0  # sequences that use the slot
    error: str = ""
    task: asyncio.Task | None = None


@dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one delta for Status."""

    name: str
    state: DeltaState
    bytes: int
    pinned: bool
    request_rate: float
    error: str


class DeltaManager:
    def __init__(self, layout: SlotLayout, slots: SlotTensors, source: DeltaSource | None, base_fingerprint: str,
                 budget_bytes: int, policy: WeightedLRUPolicy, load_stream=None):  # fmt: skip
        self.layout, self.slots, self.source = layout, slots, source
        self.base_fingerprint = base_fingerprint
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.load_stream = load_stream
        self.entries: dict[str, DeltaEntry] = {}
        self._wanted: Counter[str] = Counter()  # requests waiting in acquire(), by delta
        self.free_slots: list[int] = list(range(slots.n_slots - 1, -1, -1))
        self.peak_used_bytes = 0
        self.loads_started = 0  # load tasks created (coalesced calls share one)
        self._changed = asyncio.Event()

    # -- accounting --------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values()
                   if e.state in (DeltaState.LOADING, DeltaState.RESIDENT, DeltaState.EVICTING))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def state_of(self, name: str) -> DeltaState:
        e = self.entries.get(name)
        return DeltaState.ABSENT if e is None else e.state

    def snapshot(self) -> list[SlotInfo]:
        now = time.monotonic()
        hot = self.policy.pinned(now)
        return [SlotInfo(e.name, e.state, e.bytes, e.pinned or (e.name in hot and e.state == DeltaState.RESIDENT),
                         self.policy.rate(e.name, now), e.error)
                for e in sorted(self.entries.values(), key=lambda e: e.name)]  # fmt: skip

    # -- use by requests ------------------------------------------------------------------------------
    async def acquire(self, name: str) -> int:
        """Slot index of `name`, loading it if needed; the caller must `release(name)` once done."""
        self.policy.record(name, time.monotonic())
        # While a request waits for its delta, that delta must not be evicted between
        # becoming resident and the request taking its reference (two loads would
        # otherwise evict each other forever when the budget holds one of them).
        self._wanted[name] += 1
        try:
            while True:
                e = self.entries.get(name)
                if e is not None and e.state == DeltaState.EVICTING:
                    e.state = DeltaState.RESIDENT  # revive: its bytes never left the slot
                    self._notify()
                if e is not None and e.state == DeltaState.RESIDENT:
                    e.refs += 1
                    return e.slot
                await self._load_task(name)
        finally:
            self._wanted[name] -= 1
            if not self._wanted[name]:
                del self._wanted[name]

    def release(self, name: str) -> None:
        e = self.entries.get(name)
        if e is None or e.refs == 0:
            return
        e.refs -= 1
        if e.refs == 0 and e.state == DeltaState.EVICTING:
            self._free(e)
        self._notify()

    # -- explicit lifecycle ------------------------------------------------------------------------------
    async def load(self, name: str, pin: bool = False) -> DeltaEntry:
        """Make `name` resident (idempotent; concurrent calls share one load)."""
        self.policy.record(name, time.monotonic())
        while True:
            e = self.entries.get(name)
            if e is not None and e.state == DeltaState.EVICTING:
                e.state = DeltaState.RESIDENT
                self._notify()
            if e is not None and e.state == DeltaState.RESIDENT:
                e.pinned = e.pinned or pin
                return e
            await self._load_task(name)

    async def evict(self, name: str) -> DeltaState:
        """Free `name`'s slot (now, or when its running sequences finish). Idempotent; overrides pins."""
        e = self.entries.get(name)
        if e is None:
            return DeltaState.ABSENT
        e.pinned = False
        if e.state == DeltaState.LOADING:
            e.task.cancel()
            try:
                await asyncio.shield(e.task)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001  # the load's error is moot
                pass
            e = self.entries.get(name)
            if e is None:
                return DeltaState.ABSENT
        if e.state == DeltaState.FAILED:
            del self.entries[name]
            return DeltaState.ABSENT
        if e.refs:
            e.state = DeltaState.EVICTING
            return e.state
        self._free(e)
        self._notify()
        return DeltaState.ABSENT

    # -- internals ---------------------------------------------------------------------------------------
    async def _load_task(self, name: str) -> None:
        e = self.entries.get(name)
        if e is None or e.state == DeltaState.FAILED:
            if self.source is None:
                raise NotFound(f"no delta source is configured on this worker, so {name!r} cannot be loaded "
                               "(start it with --delta-store or --delta-dir)")
            e = self.entries[name] = DeltaEntry(name, DeltaState.LOADING)
            self.loads_started += 1
            e.task = asyncio.get_running_loop().create_task(self._load(e), name=f"load-{name}")
            # The failure is reported through the entry's state and to every waiter; a load
            # whose waiters all went away must not log "exception was never retrieved".
            e.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if e.state == DeltaState.LOADING:
            await asyncio.shield(e.task)

    async def _load(self, e: DeltaEntry) -> None:
        t0 = time.perf_counter()
        writer = None
        try:
            info = await self.source.open(e.name, self.base_fingerprint)
            plan = plan_delta(self.layout, info)
            await self._reserve(e, plan.total_bytes)
            writer = SlotWriter(plan, self.slots, e.slot, self.load_stream)
            await self.source.stream(info, writer)
            extras = await writer.finish()
            if extras.embed is not None or extras.head is not None:
                self.slots.extras = {**self.slots.extras, e.slot: extras}  # copy-on-write for the engine
            e.state = DeltaState.RESIDENT
            e.error = ""
            log.info("delta %s resident in slot %d (%d bytes, %.1f ms)", e.name, e.slot, e.bytes,
                     (time.perf_counter() - t0) * 1e3)
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            if e.slot is not None:
                self._free(e, keep_entry=True)
            cancelled = isinstance(exc, asyncio.CancelledError)
            if cancelled:
                self.entries.pop(e.name, None)
            else:
                e.state, e.error = DeltaState.FAILED, str(exc)
                log.warning("delta %s failed to load: %s", e.name, exc)
            self._notify()
            if cancelled or isinstance(exc, DeltaLoadError):
                raise
            raise DeltaLoadError(e.name, exc) from exc
        finally:
            self._notify()

    async def _reserve(self, e: DeltaEntry, size: int) -> None:
        """Find a slot and `size` bytes for `e`, evicting what the policy says; may wait for busy victims."""
        if size > self.budget_bytes:
            raise ResourceExhausted(f"delta {e.name!r} needs {size} device bytes but the whole delta budget is "
                                    f"{self.budget_bytes}; raise --delta-budget")
        while True:
            used = self.used_bytes
            if self.free_slots and used + size <= self.budget_bytes:
                break
            now = time.monotonic()
            # Bytes to free: enough for `size`, and at least one delta when no slot is free.
            need = size if self.free_slots else max(size, self.budget_bytes - used + 1)
            # Held only for now: loads in flight, and deltas whose requests are about to use them.
            transient = {n for n, x in self.entries.items() if n != e.name and
                         (x.state == DeltaState.LOADING or (self._wanted.get(n) and x.refs == 0))}  # fmt: skip
            protected = transient | {n for n, x in self.entries.items() if x.pinned} | {e.name}
            victims = self.policy.plan(e.name, need, now, busy=protected)
            if victims is None and transient:
                # Once those are in use they can be evicted after their requests finish: wait, don't fail.
                await self._changed.wait()
                continue
            if victims is None:
                pinned = [n for n in self.entries if n in protected and n != e.name]
                raise ResourceExhausted(
                    f"delta {e.name!r} ({size} bytes) does not fit: budget {self.budget_bytes} bytes, "
                    f"{used} in use, and the rest is held by pinned or loading deltas {sorted(pinned)}; "
                    "evict or unpin some, or raise --delta-budget")
            waiting = False
            for v in victims:
                x = self.entries.get(v)
                if x is None:
                    self.policy.remove(v)
                elif x.refs == 0:
                    log.info("evicting %s for %s (policy)", v, e.name)
                    self._free(x)
                else:
                    x.state = DeltaState.EVICTING
                    waiting = True
            if waiting and not (self.free_slots and self.used_bytes + size <= self.budget_bytes):
                await self._changed.wait()
        e.slot = self.free_slots.pop()
        e.bytes = size
        self.policy.add(e.name, size)
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        assert self.used_bytes <= self.budget_bytes

    def _free(self, e: DeltaEntry, keep_entry: bool = False) -> None:
        if e.slot is not None:
            if e.slot in self.slots.extras:
                self.slots.extras = {k: v for k, v in self.slots.extras.items() if k != e.slot}
            self.free_slots.append(e.slot)
        e.slot, e.bytes = None, 0
        self.policy.remove(e.name)
        if not keep_entry:
            self.entries.pop(e.name, None)
