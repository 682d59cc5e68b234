"""Tensor parallelism: one worker as N ranks on torch.distributed (gloo on CPU, NCCL on CUDA).

    rank 0   the worker: gRPC, the manager, the scheduler, sampling. Its `Driver` stands where the
             ModelRunner stood: each step it BROADCASTS the step's batch metadata (the SeqWork
             list, plus any pending control ops) once, then runs the same forward on its shards.
    rank r   a `Follower`: receives each message, applies its ops (load/cancel/free a slot, copy
             KV rows of a fork, warm up, stop) and runs the forward on its shards.

Every rank holds 1/N of the base and of every resident delta, split by `bitdelta.shard` (the
split per tensor role). Inside a step (`ShardedRunner`): the vocabulary-parallel embedding is one
all-reduce, each row-parallel projection (o, down) computes its partial sum — base GEMM plus the
delta term of every row's variant — and all-reduces it once, and the vocabulary-parallel head's
logits are gathered on rank 0. Nothing is sent per delta or per variant: slot ids are the same on
every rank, and the metadata names them.

Loads: the manager on rank 0 decides (slot, budget, eviction) as with one rank; a load sends one
`LoadOp` to the followers, every rank streams its own slice from its own source (only that slice
lands in its slot; from the store, a part several ranks hold is fetched by the lowest of them and
handed to the others through the TCPStore, so each byte leaves the store once), and the delta is
resident once every rank acknowledged its slice (acks through the rendezvous TCPStore). A failed slice fails the load with the follower's status code, naming
the rank; an evicted load is cancelled on every rank before its slot is reused.

Faults: every collective runs under the process group's timeout (`--tp-timeout-s`); rank 0 sends a
heartbeat when idle, so a follower whose rank 0 went away stops within that timeout too. A rank
that dies (its process exits) or hangs makes the driver fail: the step in flight and every later
one raise UNAVAILABLE, the worker drains (NOT_SERVING) and exits; spawned ranks die with rank 0
(PR_SET_PDEATHSIG) and are reaped by it.

Started two ways (docs/tensor-parallel.md): `python -m services.gpu_worker --tensor-parallel N`
(rank 0 spawns ranks 1..N-1 as `python -m services.gpu_worker.parallel`, the config passed in the
environment), or `torchrun --nproc-per-node N -m services.gpu_worker --tensor-parallel N ...`
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from torchrun). CUDA device = LOCAL_RANK.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import itertools
import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from opentelemetry import trace

from bitdelta.arch import ModelArgs
from bitdelta.checkpoint import CheckpointReader, fingerprint, read_config
from bitdelta.format import DTYPES, ArchMismatchError
from bitdelta.rpc import telemetry
from bitdelta.rpc.checksums import crc32
from bitdelta.rpc.receiver import Receiver
from bitdelta.shard import ROW_GROUPS, TPLayout, group_kind
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.errors import DeltaLoadError, Unavailable, WorkerError
from services.gpu_worker.loader import DeltaPlan, Kind, SlotWriter, plan_delta
from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner, SeqWork, StepMeta
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import DeltaInfo, TensorSpec, source_of

log = logging.getLogger("gpu_worker.parallel")

# The step message travels in one broadcast of this many bytes (a longer one — thousands of
# prefill tokens — takes a second broadcast of exactly its tail): ~100 µs on loopback gloo.
STEP_BYTES = 64 << 10
HEARTBEAT_S = 1.0  # rank 0 idle this long sends an empty message (the followers' liveness)
POLL_S = 0.01  # how often a load polls its followers' acks
CONFIG_ENV = "BITDELTA_TP_CONFIG"  # a spawned rank's config (pickled WorkerConfig, base64)
PARENT_ENV = "BITDELTA_TP_PARENT"  # a spawned rank's rank 0 (its pid): it dies with it


# -- the collectives -----------------------------------------------------------------------------
class Collectives:
    """The torch.distributed calls of one worker's ranks, counted by kind (`counts`: the tests
    count one step's collectives). The default process group's timeout bounds every call."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        # every kind present from the start: a scrape on another thread sums it while steps count
        self.counts: Counter[str] = Counter(broadcast=0, all_reduce=0, gather=0)
        self._buf = torch.empty(STEP_BYTES, dtype=torch.uint8, device=device)

    def all_reduce(self, t: torch.Tensor) -> None:
        """t (every rank's partial sum) <- the sum over ranks, in place."""
        self.counts["all_reduce"] += 1
        dist.all_reduce(t)

    def broadcast_message(self, payload: bytes | None = None) -> bytes:
        """Rank 0 sends `payload`; every rank returns it. One broadcast (two when it is long)."""
        self.counts["broadcast"] += 1
        head = STEP_BYTES - 8
        if self.rank == 0:
            first = struct.pack("<Q", len(payload)) + payload[:head]
            self._buf[: len(first)].copy_(torch.frombuffer(bytearray(first), dtype=torch.uint8))
        dist.broadcast(self._buf, src=0)
        if self.rank == 0:
            n = len(payload)
        else:
            data = self._buf.cpu().numpy().tobytes()
            (n,) = struct.unpack("<Q", data[:8])
            payload = data[8 : 8 + min(n, head)]
        if n > head:  # the tail, in a second broadcast of exactly its size
            self.counts["broadcast"] += 1
            tail = torch.empty(n - head, dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                tail.copy_(torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8))
            dist.broadcast(tail, src=0)
            if self.rank != 0:
                payload += tail.cpu().numpy().tobytes()
        return payload

    def gather_vocab(self, local: torch.Tensor, tp: TPLayout) -> torch.Tensor:
        """local: fp32 [R, v1 - v0] (this rank's vocabulary rows' logits) -> [R, vocab] on rank 0
        (an empty [0, 0] tensor elsewhere). One gather, padded to the largest rank's rows."""
        self.counts["gather"] += 1
        vmax = tp.vocab_max
        if local.shape[1] < vmax:
            local = torch.nn.functional.pad(local, (0, vmax - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        if self.rank != 0:
            return local.new_empty(0, 0)
        return torch.cat([p[:, : b - a] for p, (a, b) in zip(parts, (tp.vocab(r) for r in range(self.size)))], 1)


# -- the sharded model step ------------------------------------------------------------------------
class ShardedRunner(ModelRunner):
    """The ModelRunner on one rank's shards (its `args` are `TPLayout.local_args()`: its heads, KV
    heads, MLP columns and vocabulary rows), plus the three places a rank meets the others."""

    def __init__(self, base: BaseWeights, args: ModelArgs, slots, kv, comm: Collectives, tp: TPLayout, **kw):
        super().__init__(base, args, slots, kv, **kw)
        self.comm, self.tp = comm, tp
        self.kv_owner = tp.kv_owner()  # whether this rank's k counts in a sum over every head

    def _linear(self, x: torch.Tensor, layer: int, group: str, m: StepMeta) -> torch.Tensor:
        if group_kind(group) not in ROW_GROUPS:
            return super()._linear(x, layer, group, m)
        # row-parallel: this rank's input columns give a partial sum of x·Wᵀ + α ⊙ (x·Sᵀ) (the delta
        # term of every row's variant included); ONE all-reduce sums them, then the bias, once. An
        # expert's down ("down.e") stays partial: `_sparse` sums the experts' first, then all-reduces
        y = self._linear_nobias(x, layer, group, m)
        if group_kind(group) == group:  # o, down (not an expert's)
            self.comm.all_reduce(y)
        bias = self.slots.biases[layer].get(group)
        if bias is None:
            return y
        return y + (bias[m.single_norm] if m.norm_idx is None else bias[m.norm_idx])

    def _whole_qk_norms(
        self, q: torch.Tensor, k: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], m: StepMeta, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's whole-projection q and k norms over this rank's heads: its rows' sums of squares of q
        and of k (a KV head several ranks replicate counted by the first of them only), ONE all-reduce of
        both for the layer, then each rank scales its own heads."""
        full = self.tp.args
        hd = full.head_dim
        kf = k.float() if self.kv_owner else torch.zeros_like(k, dtype=torch.float32)
        squares = torch.stack([q.float().pow(2).sum(-1), kf.pow(2).sum(-1)], 1)  # [N, 2]
        self.comm.all_reduce(squares)
        out = []
        for t, w, s, width in zip((q, k), weights, squares.unbind(1), (full.n_heads * hd, full.n_kv_heads * hd)):
            out.append(self._scaled(t, t.float() * torch.rsqrt(s / width + eps)[:, None], w, m))
        return out[0], out[1]

    def _sparse(self, h: torch.Tensor, layer: int, m: StepMeta) -> torch.Tensor:
        """A sparse layer on this rank's columns of every expert: each rank routes every row the same
        way (the router and h are whole on each), sums its partial experts' outputs, then ONE
        all-reduce for the layer."""
        out = super()._sparse(h, layer, m)
        self.comm.all_reduce(out)
        return out

    def _embed(self, m: StepMeta) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows (a variant's own table sharded the same way),
        zeros for tokens other ranks hold, one all-reduce."""
        v0, v1 = self.tp.vocab()
        local = m.tokens - v0
        inside = (local >= 0) & (local < v1 - v0)
        t_all = torch.where(inside, local, torch.zeros_like(local))
        x = self.base.embed[t_all]  # [N, dim]
        self._variant_embeddings(x, m, t_all)
        x = x.masked_fill(~inside[:, None], 0)
        self.comm.all_reduce(x)
        return x

    def _logits(self, h: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """This rank's vocabulary rows of the head (each row's variant's), gathered on rank 0."""
        return self.comm.gather_vocab(super()._logits(h, m), self.tp)


def load_base_shard(ckpt, tp_size: int, rank: int, dtype: torch.dtype, device: torch.device):
    """This rank's slices of the base, read straight from the checkpoint (only their bytes: a rank
    never holds the whole base, on the host or the device), as `BaseWeights` with the group layout
    of `BaseWeights.load`. Returns (base shard, the whole model's args, the layout)."""
    tp = TPLayout(ModelArgs.from_hf(read_config(ckpt)), tp_size, rank)

    def part(r: CheckpointReader, name: str) -> torch.Tensor:
        sh = tp.shard_of(name, "weight", tuple(r.shape(name)))
        return r.get_part(name, sh.rows, sh.cols)

    base, args = BaseWeights.load(ckpt, dtype, device, part)
    return base, args, tp


@dataclasses.dataclass
class RankModel:
    """One rank's part of the worker: its shards, slot stacks and KV pool, and its runner."""

    tp: TPLayout
    args: ModelArgs  # the whole model's
    base: BaseWeights  # this rank's slices
    layout: SlotLayout  # this rank's slot layout (local shapes)
    slots: SlotTensors
    kv: KVPool
    runner: ShardedRunner
    shard_load: ShardedLoad

    @property
    def memory(self) -> dict[str, int]:
        """Device bytes this rank holds, by part (Status' per-rank memory)."""
        kv = self.kv.k.numel() * self.kv.k.element_size() * 2
        return {"base": self.base.nbytes, "slot_stacks": self.slots.stack_bytes, "kv": kv}


def build_rank(
    c: WorkerConfig, dtype: torch.dtype, device: torch.device, comm: Collectives, backend: str | None, store
) -> RankModel:
    """Load this rank's slices of the base onto `device`, allocate its slot stacks and KV pool. Slot and block counts come from rank 0's shapes (it holds the most of every part, see
    bitdelta.shard), so every rank has the same slots and blocks and rank 0's accounting bounds all."""
    base, args, tp = load_base_shard(c.base, comm.size, comm.rank, dtype, device)
    largest = TPLayout(args, comm.size, 0).local_args()
    local = tp.local_args()
    layout = SlotLayout(local, dtype)
    n_slots = c.max_slots or c.delta_budget // SlotLayout(largest, dtype).slot_bytes
    slots = SlotTensors.allocate(
        layout, n_slots, device, base.norms, base.final_norm, base.biases, base.final_norm_bias, base.head_bias
    )
    n_blocks = c.kv_cache // KVPool.bytes_per_token(largest, dtype) // c.block_size
    if n_blocks < 1:
        raise ValueError(f"--kv-cache {c.kv_cache} bytes holds less than one block of {c.block_size} tokens")
    kv = KVPool(local, n_blocks, c.block_size, dtype, device)
    runner = ShardedRunner(base, local, slots, kv, comm, tp, use_fused=c.fused_single_variant, backend=backend)
    return RankModel(tp, args, base, layout, slots, kv, runner, ShardedLoad(tp, layout, store, c.store_timeout_s))


# -- loading a rank's slice of a delta ----------------------------------------------------------------
class ShardedLoad:
    """Plan and write one rank's slice of a delta: every tensor of the delta as the source announces
    it (whole: its crc32s and sha256 are checked as sent), only this rank's part kept in the slot.

    From the store each slice leaves it once: a slice several ranks hold is fetched by the lowest of
    them (`TPLayout.owner`), whose writer posts it, checked, with its crc32 on the TCPStore
    (`HandoffWriter`); the others `receive` it from there into their receiver, which checks that
    crc32 like any chunk's."""

    def __init__(self, tp: TPLayout, layout: SlotLayout, store, timeout_s: float):
        self.tp, self.layout, self.store, self.timeout_s = tp, layout, store, timeout_s
        self.where = f"rank {tp.rank} of {tp.size}"  # named in its load errors

    def plan(self, info: DeltaInfo) -> DeltaPlan:
        """plan_delta against this rank's layout (the slices' shapes), placements keeping the
        announced tensors (the receiver's): the slices themselves when the source sent only those
        (`DeltaInfo.sliced`: the store's sharded Fetch), else whole tensors to cut here. A resized
        vocabulary is refused: its added rows have no rank in the base's vocabulary split."""
        if info.vocab_size:
            raise ArchMismatchError(
                f"delta {info.name!r} grew the vocabulary to {info.vocab_size} tokens, which tensor-parallel "
                "ranks do not serve (their vocabulary split is the base's); serve it on one device"
            )
        if info.sliced:
            plan = plan_delta(self.layout, info)
            index = {t.name: i for i, t in enumerate(plan.tensors)}
            return ShardPlan(
                **{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)},
                handoff=f"hand/{info.name}/{info.version}/",
                handed_from={index[n]: h for n, h in info.handed_from.items()},
                hands_to={index[n]: h for n, h in info.hands_to.items()},
            )
        local = dataclasses.replace(info, tensors=[self._local(t, info.axis(t)) for t in info.tensors])
        plan = plan_delta(self.layout, local)
        plan.placements = [dataclasses.replace(p, spec=t) for p, t in zip(plan.placements, info.tensors)]
        plan.whole = True
        return plan

    @contextlib.contextmanager
    def span(self, name: str, traceparent: str = ""):
        """This rank's `worker.rank_load` span over loading its slice of delta `name` (`rank`,
        `model_id`; the loader adds `bytes` of the slice and `transport`): every rank has one, rank 0's a child of
        the current span (the load's), a follower's of the LoadOp's `traceparent`, the same one."""
        attrs = {"rank": self.tp.rank, "model_id": name}
        ctx = telemetry.context_of(traceparent)
        with telemetry.tracer().start_as_current_span("worker.rank_load", context=ctx, attributes=attrs) as span:
            yield span

    def _local(self, t: TensorSpec, axis: str) -> TensorSpec:
        shape = self.tp.shard_of(t.param, t.role, t.shape, axis).shape(t.shape)
        n = DTYPES[t.dtype].itemsize if t.dtype in DTYPES else 0
        for d in shape:
            n *= d
        return dataclasses.replace(t, shape=shape, nbytes=n if t.dtype in DTYPES else t.nbytes)

    def writer(self, plan: DeltaPlan, slots: SlotTensors, ids: tuple[int, ...], load_stream=None) -> SlotWriter:
        if not plan.whole:  # the slices arrived: they land like any tensor (those others need: posted)
            return HandoffWriter(plan, slots, ids, load_stream, store=self.store)
        return ShardWriter(plan, slots, ids, load_stream, tp=self.tp)

    async def receive(self, plan: DeltaPlan, receiver: Receiver) -> None:
        """The parts of slices other ranks fetched for this one (a whole slice, or a fused qkv's
        shared k/v rows after its own query rows, which came from the store), from the TCPStore into
        `receiver` at their offset (crc32 checked there); the last rank to read one deletes it.
        Bounded by the store timeout. Rank 0 never receives: it is the lowest rank holding any part
        it holds."""
        if not plan.whole:
            for i, (owner, offset) in plan.handed_from.items():
                key, t = plan.handoff + plan.tensors[i].name, plan.tensors[i].name
                deadline = time.monotonic() + self.timeout_s
                while not self.store.check([key]):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"tensor {t}: rank {owner} did not hand it over in {self.timeout_s:.0f} s")
                    await asyncio.sleep(POLL_S)
                data = self.store.get(key)
                crc, readers = struct.unpack("<II", data[:8])
                receiver.put(i, offset, data[8:], crc)
                if self.store.add(key + "/read", 1) == readers:
                    self.store.delete_key(key)
                    self.store.delete_key(key + "/read")


@dataclasses.dataclass
class ShardPlan(DeltaPlan):
    """A plan of slices from the store, with what this rank hands over and receives (by tensor index)."""

    handoff: str = ""  # the TCPStore key prefix of this delta's handed slices
    # -> (the rank that fetches its bytes from `offset` on, offset)
    handed_from: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # -> (how many ranks receive its bytes from `offset` on, offset)
    hands_to: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)


class HandoffWriter(SlotWriter):
    """A SlotWriter that posts each slice (or its shared tail) other ranks receive from this one
    (`ShardPlan.hands_to`), once it passed its checks, with its crc32 on the TCPStore."""

    def __init__(self, plan: ShardPlan, slots: SlotTensors, ids: tuple[int, ...], load_stream=None, *, store):
        self.store = store
        super().__init__(plan, slots, ids, load_stream)

    def complete(self, index: int) -> None:
        if index in self.plan.hands_to:
            readers, offset = self.plan.hands_to[index]
            data = bytes(self.buffer(index)[offset:])
            key = self.plan.handoff + self.plan.tensors[index].name
            self.store.set(key + "/read", "0")
            self.store.set(key, struct.pack("<II", crc32(data), readers) + data)
        super().complete(index)


class ShardWriter(SlotWriter):
    """A SlotWriter that keeps this rank's slice of each tensor (`TensorShard.take`)."""

    def __init__(self, plan: DeltaPlan, slots: SlotTensors, ids: tuple[int, ...], load_stream=None, *, tp: TPLayout):
        self.shards = [
            tp.shard_of(p.spec.param, p.spec.role, p.spec.shape, "col" if p.kind is Kind.PROJ_COL else "row")
            for p in plan.placements
        ]
        super().__init__(plan, slots, ids, load_stream)

    def select(self, index: int, src: torch.Tensor) -> torch.Tensor:
        return self.shards[index].take(src)


# -- what rank 0 tells the others -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoadOp:
    load_id: int
    name: str
    slots: tuple[int, ...]  # every slot the delta holds (one per sign plane), its own first
    traceparent: str = ""  # the load's trace (W3C): each rank's `worker.rank_load` span joins it


@dataclasses.dataclass(frozen=True)
class CancelLoadOp:
    load_id: int


@dataclasses.dataclass(frozen=True)
class FreeSlotOp:
    slot: int


@dataclasses.dataclass(frozen=True)
class CopyRowsOp:
    src: int
    dst: int
    rows: int


@dataclasses.dataclass(frozen=True)
class WarmupOp:
    max_rows: int
    max_seqs: int


@dataclasses.dataclass(frozen=True)
class StopOp:
    pass


@dataclasses.dataclass
class StepMessage:
    """One broadcast: control ops (applied first, in order), then the step's work (None: no step)."""

    ops: list
    work: list[SeqWork] | None


class PeerLoadError(DeltaLoadError):
    """A follower could not load its slice: its status code and message (naming the rank)."""

    def __init__(self, name: str, message: str, code: grpc.StatusCode):
        WorkerError.__init__(self, message)
        self.name, self.cause, self.code = name, None, code


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """One rank's device and memory, for Status."""

    rank: int
    device: str
    base_bytes: int
    slot_stack_bytes: int
    kv_bytes: int
    delta_bytes: int = 0  # its slices of the resident deltas: their slots and the extras it allocated


def _ack_key(load_id: int, rank: int) -> str:
    return f"load/{load_id}/{rank}"


class _KV:
    """The KV pool as the engine sees it on rank 0: a fork's row copy runs here and reaches the
    followers with the next message (before the next step reads those rows)."""

    def __init__(self, kv: KVPool, driver: Driver):
        self._kv, self._driver = kv, driver

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        self._kv.copy_rows(src, dst, rows)
        self._driver.queue(CopyRowsOp(src, dst, rows))

    def __getattr__(self, name):
        return getattr(self._kv, name)


class Driver:
    """Rank 0's stand-in for the ModelRunner (what the engine calls: forward, decode_steps, args,
    device, kv, warmup) and the manager's link to the other ranks (load, free). Thread-safe: the engine thread,
    the event loop and the heartbeat share the process group under one lock."""

    def __init__(
        self,
        model: RankModel,
        comm: Collectives,
        store,
        procs: list[subprocess.Popen],
        ranks: list[RankInfo],
        on_failure: Callable[[str], None],
    ):
        self.model, self.runner, self.comm, self.store = model, model.runner, comm, store
        self.args, self.device = self.runner.args, self.runner.device
        self.kv = _KV(model.kv, self)
        self.procs, self.ranks, self.on_failure = procs, ranks, on_failure
        self.failed: str | None = None
        self.last_step: Counter[str] = Counter()  # the collectives of the last step, by kind (tests, docs)
        self._lock = threading.Lock()  # one message (and its step's collectives) at a time
        self._qlock = threading.Lock()
        self._pending: list = []
        self._last_sent = time.monotonic()
        self._ids = itertools.count(1)
        self._held: dict[int, list[int]] = {}  # a loaded delta's own slot -> its bytes on ranks 1..N-1
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._beat.start()

    # -- the engine's side ------------------------------------------------------------------------
    def forward(self, work: list[SeqWork], ready: Callable[[], None] | None = None) -> torch.Tensor:
        with self._lock:
            before = Counter(self.comm.counts)
            self._send(StepMessage(self._take(), work))
            try:
                return self.runner.forward(work, ready)
            except Exception as e:
                raise self._fail(f"a collective of the step failed: {e}") from e
            finally:
                self.last_step = self.comm.counts - before

    bursts = False  # ModelRunner.bursts

    def decode_steps(self, work: list[SeqWork], steps: int, *args) -> None:
        """No bursts across ranks: every step is a message to them (the engine takes single steps)."""
        return None

    def warmup(self, max_rows: int, max_seqs: int) -> list[tuple[int, str]]:
        with self._lock:
            self._send(StepMessage([*self._take(), WarmupOp(max_rows, max_seqs)], None))
            return self.runner.warmup(max_rows, max_seqs)

    @property
    def collectives(self) -> int:
        """Collectives rank 0 has run (each with every other rank), for the metrics."""
        return sum(self.comm.counts.values())

    # -- control ---------------------------------------------------------------------------------
    def queue(self, op) -> None:
        """Send `op` with the next message (a step, a control message or the heartbeat)."""
        with self._qlock:
            self._pending.append(op)

    def send(self, *ops) -> None:
        """Send the pending ops and `ops` now (blocks while a step runs: call it off the loop)."""
        with self._lock:
            self._send(StepMessage([*self._take(), *ops], None))

    def _take(self) -> list:
        with self._qlock:
            ops, self._pending = self._pending, []
        return ops

    def _send(self, msg: StepMessage) -> None:
        if self.failed is not None:
            raise Unavailable(self.failed)
        try:
            self.comm.broadcast_message(pickle.dumps(msg))
        except Exception as e:
            raise self._fail(f"the step broadcast failed: {e}") from e
        self._last_sent = time.monotonic()

    def _fail(self, why: str) -> Unavailable:
        """Mark the worker failed (once) and return the error every stream gets."""
        if self.failed is None:
            self.failed = (
                f"tensor-parallel rank failure ({why}); this worker is stopping, send the request to another worker"
            )
            log.error("%s", self.failed)
            self.on_failure(self.failed)
        return Unavailable(self.failed)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 4):
            for r, p in enumerate(self.procs, 1):
                if p.poll() is not None and self.failed is None:
                    self._fail(f"rank {r} exited with code {p.returncode}")
            if self.failed is not None:
                return
            if time.monotonic() - self._last_sent >= HEARTBEAT_S and self._lock.acquire(timeout=HEARTBEAT_S):
                try:
                    self._send(StepMessage(self._take(), None))
                except Unavailable:
                    return
                finally:
                    self._lock.release()

    # -- the manager's side -------------------------------------------------------------------------
    async def load(self, name: str, slots: tuple[int, ...], traceparent: str) -> None:
        """Every follower loads its slice of `name` into `slots` (the same run as rank 0's: one slot
        per sign plane, its own first), its span a child of `traceparent` (the load's, as rank 0's
        own); returns once all have it, raises the first follower's error (PeerLoadError, naming
        the rank). Cancelled: the followers' loads are cancelled and awaited (none writes into the
        slots afterwards)."""
        load_id = next(self._ids)
        await asyncio.to_thread(self.send, LoadOp(load_id, name, tuple(slots), traceparent))
        try:
            acks = await self._acks(load_id, name)
        except asyncio.CancelledError:
            self.queue(CancelLoadOp(load_id))
            await asyncio.shield(asyncio.ensure_future(self._cancelled(load_id)))
            raise
        self._held[slots[0]] = [a["bytes"] for a in acks]

    async def _cancelled(self, load_id: int) -> None:
        await asyncio.to_thread(self.send)
        try:
            await self._acks(load_id)
        except WorkerError:
            pass  # cancelled or failed: either way that follower has stopped writing

    async def _acks(self, load_id: int, name: str = "") -> list[dict]:
        keys = [_ack_key(load_id, r) for r in range(1, self.comm.size)]
        while not self.store.check(keys):
            if self.failed is not None:
                raise Unavailable(self.failed)
            await asyncio.sleep(POLL_S)
        acks = [json.loads(self.store.get(k)) for k in keys]
        for k in keys:
            self.store.delete_key(k)
        for a in acks:
            if a["code"] != "OK":
                raise PeerLoadError(name, a["message"], grpc.StatusCode[a["code"]])
        return acks

    def free(self, slot: int) -> None:
        """The delta whose own slot is `slot` left rank 0 (all its slots): the followers drop its
        extras (embedding / head, low-rank factors, column α's, its further planes' slots)."""
        self._held.pop(slot, None)
        self.queue(FreeSlotOp(slot))

    def rank_memory(self, rank0_delta_bytes: int) -> list[RankInfo]:
        """Each rank's memory for Status: its device, base, stacks and KV pool, and the bytes of its
        slices of the resident deltas (rank 0's as its manager counts them; each follower's as it
        allocated them, sent with its acknowledgement)."""
        held = [sum(b[r - 1] for b in self._held.values()) for r in range(1, self.comm.size)]
        delta = [rank0_delta_bytes, *held]
        return [dataclasses.replace(info, delta_bytes=d) for info, d in zip(self.ranks, delta)]

    # -- lifecycle ---------------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop the followers (a StopOp; after a failure, SIGTERM), reap them, leave the group."""
        self._stop.set()
        if self.failed is None:
            try:
                self.send(StopOp())
            except Unavailable:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=timeout if self.failed is None else 2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# -- the other ranks ------------------------------------------------------------------------------
class Follower:
    """Rank r > 0: apply each broadcast message, run each step's forward; loads on a thread of its
    own (its own source and event loop), acknowledged through the store."""

    def __init__(self, model: RankModel, comm: Collectives, store, config: WorkerConfig, base_fingerprint: str):
        self.model, self.comm, self.store, self.config = model, comm, store, config
        self.source = None  # made on the loads' loop (a gRPC channel belongs to the loop it was made on)
        self.fingerprint = base_fingerprint
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tp-loads", daemon=True)
        self._loads: dict[int, object] = {}
        self._extras_lock = threading.Lock()
        self.load_stream = torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None

    def run(self) -> None:
        self._thread.start()
        try:
            while True:
                msg: StepMessage = pickle.loads(self.comm.broadcast_message())
                for op in msg.ops:
                    if isinstance(op, StopOp):
                        return
                    self._apply(op)
                if msg.work is not None:
                    self.model.runner.forward(msg.work)
        finally:
            for f in list(self._loads.values()):
                f.cancel()
            if self.source is not None:
                asyncio.run_coroutine_threadsafe(self.source.close(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)

    def _apply(self, op) -> None:
        if isinstance(op, LoadOp):
            fut = asyncio.run_coroutine_threadsafe(self._load(op), self.loop)
            self._loads[op.load_id] = fut
            fut.add_done_callback(lambda f, op=op: self._ack(op, f))
        elif isinstance(op, CancelLoadOp):
            fut = self._loads.get(op.load_id)
            if fut is not None:
                fut.cancel()
        elif isinstance(op, FreeSlotOp):  # the delta's further slots hold nothing beside its extras
            with self._extras_lock:
                slots = self.model.slots
                slots.extras = {k: v for k, v in slots.extras.items() if k != op.slot}
        elif isinstance(op, CopyRowsOp):
            self.model.kv.copy_rows(op.src, op.dst, op.rows)
        elif isinstance(op, WarmupOp):
            self.model.runner.warmup(op.max_rows, op.max_seqs)
        else:
            raise TypeError(f"unknown tensor-parallel op {op!r}")

    async def _load(self, op: LoadOp) -> int:
        with self.model.shard_load.span(op.name, op.traceparent) as span:
            return await self._load_slice(op, span)

    async def _load_slice(self, op: LoadOp, span: trace.Span) -> int:
        """Load this rank's slice of the delta into `op.slots`; returns the bytes it holds here."""
        if self.source is None:
            self.source = source_of(self.config, self.model.tp)
        if self.source is None:
            raise DeltaLoadError(op.name, RuntimeError("no delta source is configured"))
        info = await self.source.open(op.name, self.fingerprint)
        sl = self.model.shard_load
        plan = sl.plan(info)
        span.set_attributes({"bytes": plan.total_bytes, "transport": info.transport})
        writer = sl.writer(plan, self.model.slots, op.slots, self.load_stream)  # one slot per sign plane
        receiver = Receiver(plan.name, plan.tensors, writer, check_sha256=not info.verified)
        try:
            await self.source.stream(info, receiver)
            await sl.receive(plan, receiver)
            await receiver.finish()
        except BaseException:
            receiver.abort()
            raise
        extras = await writer.finish()
        if not extras.empty:
            with self._extras_lock:
                self.model.slots.extras = {**self.model.slots.extras, op.slots[0]: extras}
        return len(op.slots) * self.model.layout.slot_bytes + extras.nbytes

    def _ack(self, op: LoadOp, fut) -> None:
        self._loads.pop(op.load_id, None)
        r, n = self.comm.rank, self.comm.size
        if fut.cancelled():
            ack = {"code": "ABORTED", "message": f"rank {r} of {n}: the load of {op.name!r} was cancelled"}
        elif fut.exception() is not None:
            e = fut.exception()
            err = e if isinstance(e, DeltaLoadError) else DeltaLoadError(op.name, e, f"rank {r} of {n}")
            ack = {"code": err.code.name, "message": str(err)}
            log.warning("rank %d: delta %s failed to load: %s", r, op.name, e)
        else:
            ack = {"code": "OK", "message": "", "bytes": fut.result()}
        self.store.set(_ack_key(op.load_id, r), json.dumps(ack))


# -- start-up -------------------------------------------------------------------------------------
def rank_device(config: WorkerConfig, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK on CUDA (auto or cuda), else the CPU."""
    dev = config.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda"):
        return torch.device("cuda", local_rank)
    return torch.device(dev)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where this rank is and how the ranks meet (torchrun's variables, or rank 0's for the ranks
    it spawns)."""

    rank: int
    size: int
    local_rank: int
    addr: str
    port: int
    agent_store: bool = False  # torchrun's agent hosts the TCPStore (rank 0 is a client of it too)
    run: str = "spawned/0"  # keys of one run (torchrun: its run id and restart count)
    config: str = ""  # a spawned rank's config (CONFIG_ENV)
    parent: int = 0  # a spawned rank's rank 0, its pid (PARENT_ENV): it dies with it; 0 under torchrun

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """Read once at start-up; None when no launcher set RANK and WORLD_SIZE."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", "0")),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")),
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            env.get("TORCHELASTIC_RUN_ID", "spawned") + "/" + env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            env.get(CONFIG_ENV, ""),
            int(env.get(PARENT_ENV, "0")),
        )


def _store(rv: Rendezvous, config: WorkerConfig):
    """The ranks' TCPStore: rank 0 hosts it (unless torchrun's agent does), the others connect. Its
    timeout is the start-up's: a rank may take long to import and load its shards, not a step."""
    master = rv.rank == 0 and not rv.agent_store
    timeout = timedelta(seconds=config.tp_start_timeout_s)
    return dist.TCPStore(rv.addr, rv.port, rv.size, is_master=master, timeout=timeout, wait_for_workers=False)


def _init_group(rv: Rendezvous, config: WorkerConfig, device: torch.device, store):
    """The process group (NCCL on CUDA, gloo on CPU) on the ranks' TCPStore, every collective under
    --tp-timeout-s; returns the store's part for the load acks, rank info and handed slices."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pg_store = dist.PrefixStore(f"bitdelta/{rv.run}/pg", store)
    timeout = timedelta(seconds=config.tp_timeout_s)
    dist.init_process_group(backend, store=pg_store, rank=rv.rank, world_size=rv.size, timeout=timeout)
    return dist.PrefixStore(f"bitdelta/{rv.run}/tp", store)


def _wait_for(store, key: str, what: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until a follower set `key`, failing at once (with its exit code) when a spawned rank
    exits first, and saying what did not happen after `timeout_s` (--tp-start-timeout-s)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        for r, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor parallelism: rank {r} exited with code {p.returncode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor parallelism: {what} did not happen within --tp-start-timeout-s {timeout_s:.0f} s"
            )
        time.sleep(POLL_S * 10)


def _die_with_parent(parent: int) -> None:
    """A spawned rank, first thing: SIGKILL when rank 0 (`parent`) exits, so no rank outlives it;
    and if it has exited already, exit now. Set here, not between fork and exec (`preexec_fn`): that
    runs Python and gRPC's fork handlers in a child of a process with threads (gRPC's, a store
    client's), which is not safe."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        raise SystemExit(f"rank 0 (pid {parent}) exited before this rank started")


def _spawn(config: WorkerConfig, rv: Rendezvous, dtype: torch.dtype, backend: str | None) -> list[subprocess.Popen]:
    """Ranks 1..N-1 as `python -m services.gpu_worker.parallel`, each told its rank and rank 0's config
    with rank 0's dtype and kernels (resolved there: `auto` and process settings decide nothing twice)."""
    resolved = dataclasses.replace(config, kernel_backend=backend or "", dtype=str(dtype).removeprefix("torch."))
    blob = base64.b64encode(pickle.dumps(resolved)).decode()
    procs = []
    for r in range(1, rv.size):
        env = {
            **os.environ,
            CONFIG_ENV: blob,
            "RANK": str(r),
            "WORLD_SIZE": str(rv.size),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": rv.addr,
            "MASTER_PORT": str(rv.port),
        }
        cmd = [sys.executable, "-m", "services.gpu_worker.parallel"]
        procs.append(subprocess.Popen(cmd, env={**env, PARENT_ENV: str(os.getpid())}))
    return procs


def start_driver(
    config: WorkerConfig,
    dtype: torch.dtype,
    on_failure: Callable[[str], None],
    backend: str | None,
    rendezvous: Rendezvous | None = None,
) -> Driver:
    """Rank 0: spawn ranks 1..N-1 (unless a launcher started them: `rendezvous`, torchrun's), join the
    group, load this rank's shards, collect the followers' memory. Blocking (the worker calls it on a
    thread)."""
    n = config.tensor_parallel
    procs: list[subprocess.Popen] = []
    if rendezvous is not None:
        rv = rendezvous
        if rv.size != n or rv.rank != 0:
            raise ValueError(f"--tensor-parallel {n} but the launcher says rank {rv.rank} of WORLD_SIZE {rv.size}")
        store = _store(rv, config)
    else:  # the store first, on a port it binds itself (a free port looked up, then bound, can be taken)
        store = _store(Rendezvous(0, n, 0, "127.0.0.1", 0), config)
        rv = Rendezvous(0, n, 0, "127.0.0.1", store.port)
        procs = _spawn(config, rv, dtype, backend)
    device = rank_device(config, rv.local_rank)
    wait = config.tp_start_timeout_s
    try:
        joined = dist.PrefixStore(f"bitdelta/{rv.run}/joined", store)
        for r in range(1, n):  # before the process group's own rendezvous, which cannot see a rank exit
            _wait_for(joined, str(r), f"rank {r} joining", procs, wait)
        store = _init_group(rv, config, device, store)
        comm = Collectives(0, n, device)
        model = build_rank(config, dtype, device, comm, backend, store)
        mem = model.memory
        ranks = [RankInfo(0, str(device), mem["base"], mem["slot_stacks"], mem["kv"])]
        for r in range(1, n):  # each follower posts its own once its shards are resident
            _wait_for(store, f"rank/{r}", f"rank {r} loading its shards of the base", procs, wait)
            ranks.append(RankInfo(**json.loads(store.get(f"rank/{r}"))))
        store.set("started", "1")  # the followers' first broadcast now waits a heartbeat, not a load
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    log.info("tensor parallel: %d ranks (%s) joined", n, ", ".join(r.device for r in ranks))
    return Driver(model, comm, store, procs, ranks, on_failure)


def run_follower(config: WorkerConfig, rv: Rendezvous) -> None:
    """Rank r > 0, until rank 0 says stop (exit 0) or a collective fails (exit 1)."""
    from bitdelta.precision import serving_dtype
    from bitdelta_kernels.settings import current as kernel_settings

    rank, size = rv.rank, rv.size
    device = rank_device(config, rv.local_rank)
    if config.tensor_parallel != size:
        raise SystemExit(f"--tensor-parallel {config.tensor_parallel} but WORLD_SIZE is {size}")
    dt = config.dtype if config.dtype != "auto" else serving_dtype(device).torch_name
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dt]
    telemetry.setup("worker", config.otlp_endpoint, instance=f"{config.address}/rank{rank}")
    store = _store(rv, config)
    dist.PrefixStore(f"bitdelta/{rv.run}/joined", store).set(str(rank), "1")
    store = _init_group(rv, config, device, store)
    comm = Collectives(rank, size, device)
    model = build_rank(config, dtype, device, comm, config.kernel_backend or kernel_settings().backend, store)
    mem = model.memory
    store.set(
        f"rank/{rank}", json.dumps(dataclasses.asdict(RankInfo(rank, str(device), *mem.values())), sort_keys=True)
    )
    follower = Follower(model, comm, store, config, fingerprint(config.base))
    log.info("rank %d of %d ready on %s", rank, size, device)
    try:
        try:  # rank 0 may still be loading its shards: the start's deadline, not a collective's
            store.wait(["started"])
        except Exception:
            raise RuntimeError(
                f"rank 0 did not finish starting within --tp-start-timeout-s {config.tp_start_timeout_s:.0f} s"
            ) from None
        follower.run()
    except Exception as e:
        log.error("rank %d of %d: %s; stopping", rank, size, e)
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        telemetry.shutdown()
    log.info("rank %d of %d stopped", rank, size)


def main() -> None:
    """A rank spawned by rank 0 (`python -m services.gpu_worker.parallel`, config in the environment)."""
    rv = Rendezvous.from_env()
    _die_with_parent(rv.parent)
    config: WorkerConfig = pickle.loads(base64.b64decode(rv.config))
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_follower(config, rv)


if __name__ == "__main__":  # run the module's own copy: the ops' classes must be the ones rank 0 pickles
    from services.gpu_worker import parallel

    parallel.main()
