"""Who holds a device slot: the lifecycle of every delta on this worker.

    ABSENT ──load──▶ LOADING ──verified──▶ RESIDENT ──evict──▶ EVICTING ──last ref released──▶ ABSENT
                        │  │                   ▲                   │
                        │  └─evict─▶ EVICTING  └────── requested ──┘   (revived: its bytes are still there)
                        │           (aborted: every waiter gets ABORTED at once; ABSENT once its reads stop)
                        └──error──▶ FAILED (kept for Status, at most MAX_FAILED_ENTRIES of them)
                           (unknown delta or no room: no entry at all, so unknown names cannot grow Status)

- The budget is bytes: a delta costs one slot of the stacks (`SlotLayout.slot_bytes`) per sign
  plane of its matrices (format v3: k planes hold a contiguous run of k slots, evicting until one
  is free) plus its embedding/head tensors, low-rank factors and column α's. Slots and bytes are reserved
  before the first byte moves, so `used_bytes <= budget_bytes` holds at every instant; a delta
  of more planes than this worker has slots is refused at once (RESOURCE_EXHAUSTED).
- Victims come from `bitdelta.cache_policy.WeightedLRUPolicy` (LRU weighted by
  request rate, the hottest `pin_top_n` pinned). Explicitly pinned deltas
  (LoadDelta pin=true), loading deltas and deltas in use by running
  sequences are never evicted at once; a victim in use turns EVICTING and its
  slot is freed when its last sequence leaves the batch.
- A load waits for room only while some bytes are held for now (a load
  streaming, a delta whose requests are about to take it, a victim whose
  sequences are finishing): each of those frees or becomes evictable without
  waiting for anything, so loads never wait on each other in a cycle. A load
  that pinned deltas leave no room for fails at once (RESOURCE_EXHAUSTED).
- Loads are idempotent and coalesced: one task per delta, every caller awaits
  its `done` future.
- Runs on the asyncio loop only; the engine thread releases references
  through `loop.call_soon_threadsafe(manager.release, name)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from bitdelta.cache_policy import WeightedLRUPolicy
from bitdelta.rpc import telemetry
from bitdelta.rpc.receiver import Receiver
from services.gpu_worker.errors import Aborted, DeltaLoadError, NotFound, ResourceExhausted
from services.gpu_worker.loader import SlotWriter, VariantTokenizer, plan_delta
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import DeltaSource

log = logging.getLogger("gpu_worker.manager")

# FAILED entries kept for Status (the oldest go first): enough to see what broke, bounded
# however many distinct broken deltas clients ask for.
MAX_FAILED_ENTRIES = 32
# Load failures that say nothing about the delta itself leave no entry (an unknown name,
# no room now): otherwise every request for a new unknown name would grow Status forever.
_NO_ENTRY_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED)


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
    slots: tuple[int, ...] = ()  # every slot it holds: plane 1's (its own, what sequences carry) first
    bytes: int = 0
    pinned: bool = False  # explicitly (LoadDelta pin=true)
    refs: int = 0  # sequences that use the slot
    error: str = ""
    transport: str = ""  # how the resident bytes arrived: file | stream | shared-memory
    content: str = ""  # the resident bytes' identity (DeltaInfo.content_id): keys its prefix-cached KV
    eos_ids: frozenset[int] = frozenset()  # the resident delta's own end-of-sequence tokens; empty: the base's
    tokenizer: VariantTokenizer | None = None  # the resident delta's own tokenizer (its fine-tune's); None: the base's
    vocab_size: int = 0  # the resident delta's grown vocabulary (tokens added); 0: the base's
    task: asyncio.Task | None = None  # the load
    done: asyncio.Future | None = None  # the load's outcome for its waiters (None, or the error)
    aborted: bool = False  # evicted while loading: its slot returns once the load's reads have stopped

    @property
    def slot(self) -> int | None:
        """Its own slot (plane 1's: norms, biases, extras), the one a sequence carries; None: none held."""
        return self.slots[0] if self.slots else None


@dataclass(frozen=True)
class SlotInfo:
    """A snapshot of one delta for Status."""

    name: str
    state: DeltaState
    bytes: int
    pinned: bool
    request_rate: float
    error: str
    transport: str
    slots: int = 0  # device slots it holds (one per sign plane of its matrices)


class DeltaManager:
    def __init__(
        self,
        layout: SlotLayout,
        slots: SlotTensors,
        source: DeltaSource | None,
        base_fingerprint: str,
        budget_bytes: int,
        policy: WeightedLRUPolicy,
        load_stream=None,
        shard=None,
        peers=None,
    ):
        """shard, peers: tensor parallelism (`parallel.ShardedLoad`: this rank's slice of each delta;
        `parallel.Driver`: the other ranks load theirs, a load is resident once every rank has it)."""
        self.layout, self.slots, self.source = layout, slots, source
        self.base_fingerprint = base_fingerprint
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.load_stream = load_stream
        self.shard, self.peers = shard, peers
        self.entries: dict[str, DeltaEntry] = {}
        self._wanted: Counter[str] = Counter()  # requests waiting in acquire(), by delta
        self.free_slots: list[int] = list(range(slots.n_slots - 1, -1, -1))
        self.peak_used_bytes = 0
        self.loads_started = 0  # load tasks created (coalesced calls share one)
        self.evictions = 0  # deltas whose slot was freed by an eviction (policy, EvictDelta), for metrics
        self.on_loaded: Callable[[str, int, float], None] | None = None  # (name, bytes, seconds), for metrics
        self._changed = asyncio.Event()

    # -- accounting --------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(
            e.bytes
            for e in self.entries.values()
            if e.state in (DeltaState.LOADING, DeltaState.RESIDENT, DeltaState.EVICTING)
        )

    @property
    def resident_bytes(self) -> int:
        """Bytes of the deltas that hold their slots with every byte in (RESIDENT, EVICTING)."""
        return sum(e.bytes for e in self.entries.values() if e.state in (DeltaState.RESIDENT, DeltaState.EVICTING))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def state_of(self, name: str) -> DeltaState:
        e = self.entries.get(name)
        return DeltaState.ABSENT if e is None else e.state

    def snapshot(self) -> list[SlotInfo]:
        now = time.monotonic()
        hot = self.policy.pinned(now)
        return [
            SlotInfo(
                e.name,
                e.state,
                e.bytes,
                e.pinned or (e.name in hot and e.state == DeltaState.RESIDENT),
                self.policy.rate(e.name, now),
                e.error,
                e.transport if e.state == DeltaState.RESIDENT else "",
                len(e.slots),
            )
            for e in sorted(self.entries.values(), key=lambda e: e.name)
        ]

    # -- use by requests ------------------------------------------------------------------------------
    async def acquire(self, name: str) -> int:
        """Slot index of `name`, loading it if needed; the caller must `release(name)` once done."""
        self.policy.record(name, time.monotonic())
        e = await self._resident(name)
        e.refs += 1
        return e.slot

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
        e = await self._resident(name)
        e.pinned = e.pinned or pin
        return e

    async def evict(self, name: str) -> DeltaState:
        """Free `name`'s slot (now, or when its running sequences finish). Idempotent; overrides pins.

        Evicting a LOADING delta cancels the load: every request waiting on it ends at once with
        ABORTED, and this call returns once the load's reads have stopped and its slot is free.
        """
        e = self.entries.get(name)
        if e is None:
            return DeltaState.ABSENT
        e.pinned = False
        if e.state == DeltaState.LOADING or e.aborted:
            self._abort(e)
            await self._stopped(e)
            return self.state_of(name)  # ABSENT, unless a new request has started a new load since
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
    async def _resident(self, name: str) -> DeltaEntry:
        """`name`'s entry once it is RESIDENT: loaded (or joined to its load), revived, or as it is."""
        # While a caller waits, its delta must not be evicted between becoming resident and the
        # caller taking it (two loads would otherwise evict each other forever when the budget
        # holds one of them): `_reserve` treats wanted deltas as held for now.
        self._wanted[name] += 1
        try:
            while True:
                e = self.entries.get(name)
                if e is not None and e.aborted:
                    await self._stopped(e)  # a cancelled load still stopping its reads: then load anew
                    continue
                if e is not None and e.state == DeltaState.EVICTING:
                    e.state = DeltaState.RESIDENT  # revive: its bytes never left the slot
                    self._notify()
                if e is not None and e.state == DeltaState.RESIDENT:
                    return e
                await self._load_task(name)
        finally:
            self._wanted[name] -= 1
            if not self._wanted[name]:
                del self._wanted[name]
                self._notify()  # a load may be waiting for this delta to be taken or let go

    async def _load_task(self, name: str) -> None:
        e = self.entries.get(name)
        if e is None or e.state == DeltaState.FAILED:
            if self.source is None:
                raise NotFound(
                    f"no delta source is configured on this worker, so {name!r} cannot be loaded "
                    "(start it with --delta-store or --delta-dir)"
                )
            loop = asyncio.get_running_loop()
            e = self.entries[name] = DeltaEntry(name, DeltaState.LOADING, done=loop.create_future())
            self.loads_started += 1
            # The outcome reaches every waiter through `done`; a load whose waiters all went away
            # must not log "exception was never retrieved".
            e.done.add_done_callback(_retrieve)
            e.task = loop.create_task(self._load(e), name=f"load-{name}")
            e.task.add_done_callback(_retrieve)
        if e.state == DeltaState.LOADING:
            await asyncio.shield(e.done)  # a waiter that goes away leaves the load running for the others

    async def _stopped(self, e: DeltaEntry) -> None:
        """Wait until the aborted load of `e` has ended and its entry is gone."""
        await asyncio.wait([e.task])  # its outcome went to its waiters; not raised here
        if self.entries.get(e.name) is e:  # cancelled before it ever ran, so nothing was reserved
            del self.entries[e.name]
            self._notify()

    def _abort(self, e: DeltaEntry) -> None:
        """Cancel `e`'s load: its waiters get ABORTED now; it stays EVICTING (holding its bytes) until
        the load's task has stopped writing into its slot (a read thread cannot be interrupted)."""
        if e.aborted:
            return
        e.aborted = True
        e.state = DeltaState.EVICTING
        _settle(
            e.done,
            Aborted(
                f"delta {e.name!r} was evicted (EvictDelta) while it was loading, so its load was "
                "cancelled; send the request again to load it anew"
            ),
        )
        e.task.cancel()
        self._notify()

    async def _load(self, e: DeltaEntry) -> None:
        t0 = time.perf_counter()
        receiver = streaming = peer = None
        parent = telemetry.traceparent()  # the load's: every rank's slice is a span under it
        # tensor parallelism: this rank's own slice is a `worker.rank_load` span, as each other rank's
        rank_span = self.shard.span(e.name) if self.shard is not None else contextlib.nullcontext(trace.INVALID_SPAN)
        try:
            with rank_span as span:
                info = await self.source.open(e.name, self.base_fingerprint)
                plan = plan_delta(self.layout, info) if self.shard is None else self.shard.plan(info)
                span.set_attributes({"bytes": plan.total_bytes, "transport": info.transport})
                await self._reserve(e, plan.total_bytes, plan.planes)
                writer = (SlotWriter if self.shard is None else self.shard.writer)(
                    plan, self.slots, e.slots, self.load_stream
                )
                if self.peers is not None:  # the other ranks load their slices meanwhile
                    peer = asyncio.ensure_future(self.peers.load(e.name, e.slots, parent))
                    peer.add_done_callback(_retrieve)
                receiver = Receiver(plan.name, plan.tensors, writer, check_sha256=not info.verified)
                # A task of its own, so that a cancelled load can wait for its reads to stop before
                # the slot is handed to another delta.
                streaming = asyncio.ensure_future(self.source.stream(info, receiver))
                streaming.add_done_callback(_retrieve)
                await asyncio.shield(streaming)
                await receiver.finish()
                extras = await writer.finish()
                tokenizer = await asyncio.to_thread(writer.tokenizer)
            if peer is not None:
                await asyncio.shield(peer)  # resident only once every rank holds its slice
            if e.aborted:  # evicted at the last moment (a source swallowed the cancellation)
                raise asyncio.CancelledError
            if not extras.empty:
                self.slots.extras = {**self.slots.extras, e.slot: extras}  # copy-on-write for the engine
            e.state = DeltaState.RESIDENT
            e.error, e.transport, e.content = "", info.transport, info.content_id
            e.eos_ids = frozenset(info.eos_token_ids)
            e.tokenizer = tokenizer
            e.vocab_size = info.vocab_size
            _settle(e.done, None)
            log.info(
                "delta %s resident in slot %s (%d bytes, %.1f ms, %s)",
                e.name,
                ",".join(map(str, e.slots)),
                e.bytes,
                (time.perf_counter() - t0) * 1e3,
                info.transport,
            )
            if self.on_loaded is not None:
                self.on_loaded(e.name, e.bytes, time.perf_counter() - t0)
        except BaseException as exc:
            if receiver is not None:
                receiver.abort()
            if streaming is not None and not streaming.done():
                await asyncio.wait([streaming])  # bytes may still be landing in the slot
            if peer is not None and not peer.done():
                peer.cancel()  # and on the other ranks
                await asyncio.wait([peer])
            if e.slots:
                self._free(e, keep_entry=True)
            if e.aborted or isinstance(exc, asyncio.CancelledError):
                if self.entries.get(e.name) is e:
                    del self.entries[e.name]
                _settle(e.done, Aborted(f"the load of delta {e.name!r} was cancelled; send the request again"))
                raise
            where = self.shard.where if self.shard is not None else ""
            err = exc if isinstance(exc, DeltaLoadError) else DeltaLoadError(e.name, exc, where)
            if err.code in _NO_ENTRY_CODES:
                if self.entries.get(e.name) is e:
                    del self.entries[e.name]
                if err.code == grpc.StatusCode.NOT_FOUND:
                    self.policy.forget(e.name)  # nor a request history
            else:
                e.state, e.error = DeltaState.FAILED, str(exc)
                self._trim_failed()
            # An unknown name or no room is the caller's business (and cheap to repeat): not a warning.
            log.log(
                logging.INFO if err.code in _NO_ENTRY_CODES else logging.WARNING,
                "delta %s failed to load: %s",
                e.name,
                exc,
            )
            _settle(e.done, err)
        finally:
            self._notify()

    async def _reserve(self, e: DeltaEntry, size: int, k: int = 1) -> None:
        """Find `k` slots and `size` bytes for `e`, evicting what the policy says; may wait for bytes
        held for now (see module docstring), never for what only an eviction by hand could free."""
        if k > self.slots.n_slots:
            raise ResourceExhausted(
                f"delta {e.name!r} has {k} sign planes per matrix, each taking a slot, but this worker has "
                f"{self.slots.n_slots} slots; raise --max-slots (and --delta-budget), or compress it with "
                "fewer planes (--planes)"
            )
        if size > self.budget_bytes:
            raise ResourceExhausted(
                f"delta {e.name!r} needs {size} device bytes but the whole delta budget is "
                f"{self.budget_bytes}; raise --delta-budget"
            )
        while True:
            used = self.used_bytes
            if self._run(k) is not None and used + size <= self.budget_bytes:
                break
            now = time.monotonic()
            hot = self.policy.pinned(now)
            holding = {n: x for n, x in self.entries.items() if n != e.name and x.slot is not None}
            # Held for good: explicit pins and the --pin-hottest top. If they leave no room, nothing
            # that finishes by itself can make room: fail now, whoever else is waiting.
            pinned = {n for n, x in holding.items() if x.state != DeltaState.EVICTING and (x.pinned or n in hot)}
            pinned_bytes = sum(holding[n].bytes for n in pinned)
            pinned_slots = sum(len(holding[n].slots) for n in pinned)
            if pinned_bytes + size > self.budget_bytes or pinned_slots + k > self.slots.n_slots:
                raise ResourceExhausted(
                    f"delta {e.name!r} ({size} bytes, {k} slots) cannot be loaded while the pinned deltas "
                    f"{sorted(pinned)} hold {pinned_bytes} of the {self.budget_bytes}-byte delta budget "
                    f"({pinned_slots} of {self.slots.n_slots} slots); evict one of them (EvictDelta also "
                    "unpins), lower --pin-hottest, or raise --delta-budget"
                )
            # Held for now: loads streaming (they become resident, then evictable), cancelled loads
            # whose reads are stopping, deltas whose waiting requests are about to take them, and
            # victims whose sequences are finishing. Each of these changes state by itself, without
            # waiting for any other load, so waiting for them cannot close a cycle.
            transient = {
                n
                for n, x in holding.items()
                if x.state == DeltaState.LOADING or x.aborted or (self._wanted.get(n) and x.refs == 0)
            }
            finishing = {n for n, x in holding.items() if x.state == DeltaState.EVICTING and x.refs}
            # Bytes to free: enough for `size`, and at least one delta while no run of k slots is free.
            need = size if self._run(k) is not None else max(size, self.budget_bytes - used + 1)
            victims = self.policy.plan(e.name, need, now, busy=transient | pinned | {e.name})
            if victims is None and (transient or finishing):
                await self._changed.wait()  # one of them will change state and notify
                continue
            if victims is None:  # not expected: what is neither pinned nor transient can be evicted
                raise ResourceExhausted(
                    f"delta {e.name!r} ({size} bytes) does not fit: budget {self.budget_bytes} bytes, "
                    f"{used} in use by {sorted(holding)}; evict some, or raise --delta-budget"
                )
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
            if waiting and not (self._run(k) is not None and self.used_bytes + size <= self.budget_bytes):
                await self._changed.wait()
        e.slots = self._run(k)
        self.free_slots = [s for s in self.free_slots if s not in e.slots]
        e.bytes = size
        self.policy.add(e.name, size)
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        assert self.used_bytes <= self.budget_bytes

    def _trim_failed(self) -> None:
        failed = [n for n, x in self.entries.items() if x.state == DeltaState.FAILED]
        for n in failed[: max(0, len(failed) - MAX_FAILED_ENTRIES)]:
            del self.entries[n]

    def _run(self, k: int) -> tuple[int, ...] | None:
        """The lowest run of k contiguous free slots, None if there is none: a delta's planes are one
        view of the stacks (the fused kernel's, and the column α's launch)."""
        free = sorted(self.free_slots)
        return next(
            (tuple(free[i : i + k]) for i in range(len(free) - k + 1) if free[i + k - 1] - free[i] == k - 1), None
        )

    def _free(self, e: DeltaEntry, keep_entry: bool = False) -> None:
        if e.slots:
            if e.slot in self.slots.extras:
                self.slots.extras = {k: v for k, v in self.slots.extras.items() if k != e.slot}
            if self.peers is not None:
                self.peers.free(e.slot)
            self.free_slots.extend(reversed(e.slots))
        if not keep_entry and e.slots:
            self.evictions += 1
        e.slots, e.bytes = (), 0
        self.policy.remove(e.name)
        if not keep_entry:
            self.entries.pop(e.name, None)


def _settle(fut: asyncio.Future | None, outcome: BaseException | None) -> None:
    """Resolve a load's `done` future once (the first outcome wins)."""
    if fut is None or fut.done():
        return
    if outcome is None:
        fut.set_result(None)
    else:
        fut.set_exception(outcome)


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()
