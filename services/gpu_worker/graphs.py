"""CUDA graphs of a decode step's layers, one per (batch bucket, planes per row, delta kernel).

On the GPU a decode step's weights take a fraction of a millisecond to read, while launching its
~25 ops a layer one by one from Python costs more (an H200 measured 1.9 ms of host work against
0.38 ms of reads per step of 4 Llama-7B layers: bench/results/2026-12-04-NVIDIA-H200). A captured
graph replays every layer's kernels with one launch. Only the layers are captured: the embedding,
the final norm, the heads and sampling stay eager (a variant's own embedding or sign head rows vary
from step to step).

A step is served when every row is a one-token decode and every delta in it is sign planes of row
α's (`StepMeta.host_slots`; column α's and low-rank terms keep the eager path), with at most the
largest bucket's rows. Its rows are padded to the bucket with copies of its last row (the same
token, slot, KV row and block table: a pad row writes the same K and V to the same place, and its
output is dropped). The batched delta's plan is built from the padded host rows each step, with
BGMV's or SGMV's index tensors copied into the shape's fixed buffers (SGMV's tiles padded with
empty ones, which add nothing). Every fused single-variant step takes the batched kernels here,
as a mixed step does: the numbers of a mixed step, not of the fused kernel.

The worker captures every bucket's one-plane shapes at start-up (`warm`, while no KV block is in
use); any other shape the first time a step needs it, after its buffers hold that step's inputs: the
two warm-up runs before the capture write the step's own K and V rows, so no live KV block is
touched by anything but its own values. Without `capture` (CPU, tests) the same buffers and plans
run eagerly, which is what the CPU tests check against the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitdelta_kernels import plan_batch
from bitdelta_kernels.configs import config_for
from bitdelta_kernels.plan import BatchPlan
from services.gpu_worker.runner import ModelRunner, SeqWork, StepMeta

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode rows per graph


@dataclass
class _Shape:
    """One graphed shape: its fixed input buffers, the StepMeta the layers read over them, the
    graph (None: not captured, or run eagerly) and its output [B, dim]."""

    x: torch.Tensor
    slots: torch.Tensor  # int32 [B, P]: each row's slot of every plane (the plan's row_slots)
    meta: StepMeta
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class DecodeGraphs:
    """The captured decode shapes of one runner (`runner.graphs`; worker setting cuda_graphs)."""

    def __init__(self, runner: ModelRunner, max_rows: int, capture: bool | None = None):
        """max_rows: the most decode rows a step can have (the worker's max_running); capture: record
        CUDA graphs (default: on a CUDA runner); without, the fixed buffers run eagerly."""
        if not runner.own_layers():
            raise ValueError("this runner's layers are not its own (tensor parallelism): no CUDA graphs")
        self.runner = runner
        self.buckets = tuple(b for b in BUCKETS if b <= max_rows) or (1,)
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.shapes: dict[tuple[int, int, str], _Shape] = {}
        self.replays = 0  # steps served
        # block-table width of every shape: the longest sequence's blocks (the model's context, or the pool)
        self.width = min(runner.kv.n_blocks, -(-runner.args.max_seq_len // runner.kv.block_size))

    def serves(self, m: StepMeta) -> bool:
        """Whether the step `m` (prepared by the runner) runs here: one-token decodes only, sign planes
        of row α's only (no low-rank term), at most the largest bucket's rows, no block table past the
        model's context, no attention temperature (Ministral 3 past its original context)."""
        n = m.tokens.shape[0]
        return (
            0 < n <= self.buckets[-1]
            and not m.prefills
            and m.decode_rows is not None
            and m.decode_rows.shape[0] == n
            and m.decode_tables.shape[1] <= self.width
            and m.host_slots is not None
            and m.lowrank_rows is None
            and m.q_temperature is None
        )

    def run(self, x: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """The layers over the embedded rows x [n, dim] of a step `serves` took -> [n, dim]."""
        n = x.shape[0]
        B = next(b for b in self.buckets if b >= n)
        rows = m.host_slots.reshape(n, -1)
        padded = torch.cat([rows, rows[-1:].expand(B - n, -1)])
        plan = plan_batch(padded, self.runner.slots.n_slots, self.runner.device, unpack=False)
        key = (B, padded.shape[1], plan.kind)
        st = self.shapes.get(key) or self._new(key, x, m, plan.block_m)
        self._fill(st, x, m, plan)
        if self.capture and st.graph is None:
            self._record(st)
        if st.graph is not None:
            st.graph.replay()
        else:
            st.out = self.runner._layers(st.x, st.meta)
        self.replays += 1
        return st.out[:n]

    def _new(self, key: tuple[int, int, str], x: torch.Tensor, m: StepMeta, block_m: int) -> _Shape:
        B, P, kind = key
        dev = x.device

        def empty(like: torch.Tensor) -> torch.Tensor:  # B rows of `like`'s
            return torch.zeros(B, *like.shape[1:], dtype=like.dtype, device=dev)

        slots = torch.full((B, P), -1, dtype=torch.int32, device=dev)
        tiles = {}
        if kind == "sgmv":  # at most B tiles (each holds a row at least); the rest stay empty
            tiles = dict(
                row_idx=torch.zeros(B, dtype=torch.int32, device=dev),
                tile_start=torch.zeros(B, dtype=torch.int32, device=dev),
                tile_end=torch.zeros(B, dtype=torch.int32, device=dev),
                tile_slots=torch.full((B, P), -1, dtype=torch.int32, device=dev),
            )
        plan = BatchPlan(kind, B, dev, slots, 0, (), block_m, **tiles)
        meta = StepMeta(
            tokens=torch.zeros(B, dtype=torch.int64, device=dev),  # the embedding is done before
            cos=empty(m.cos),
            sin=empty(m.sin),
            local_cos=None if m.local_cos is None else empty(m.local_cos),
            local_sin=None if m.local_sin is None else empty(m.local_sin),
            row_slot=slots[:, 0],
            norm_idx=torch.zeros(B, dtype=torch.int64, device=dev),
            single_norm=0,
            any_delta=kind != "none",
            single_slot=None,
            write_rows=empty(m.write_rows),
            decode_rows=torch.arange(B, device=dev),
            decode_tables=torch.zeros(B, self.width, dtype=torch.int32, device=dev),
            decode_lens=empty(m.decode_lens),
            prefills=[],
            logit_rows=torch.arange(B, device=dev),
            logit_slots=[],
            plan=plan,
            extras={},
            row_slots=slots if P > 1 else None,
        )
        st = _Shape(torch.zeros(B, x.shape[1], dtype=x.dtype, device=dev), slots, meta)
        self.shapes[key] = st
        return st

    def _fill(self, st: _Shape, x: torch.Tensor, m: StepMeta, plan: BatchPlan) -> None:
        """The step's inputs into the shape's buffers, rows past its own n copies of its last."""
        n, sm = x.shape[0], st.meta

        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            w = src.shape[1] if src.dim() > 1 else None
            d = dst if w is None else dst[:, :w]
            d[:n].copy_(src)
            if d.shape[0] > n:
                d[n:].copy_(src[n - 1 : n].expand(d.shape[0] - n, *src.shape[1:]))

        put(st.x, x)
        put(sm.cos, m.cos)
        put(sm.sin, m.sin)
        if m.local_cos is not None:  # Gemma 3's sliding layers' rope
            put(sm.local_cos, m.local_cos)
            put(sm.local_sin, m.local_sin)
        put(sm.write_rows, m.write_rows)
        put(sm.decode_tables, m.decode_tables)
        put(sm.decode_lens, m.decode_lens)
        st.slots.copy_(plan.row_slots)  # the padded rows' slots, on the device already
        sm.norm_idx.copy_(st.slots[:, 0])
        sm.norm_idx += 1  # row 0 of the norm stacks: the base's
        if plan.kind == "sgmv":
            p, T = sm.plan, plan.tile_start.shape[0]
            p.row_idx[: plan.row_idx.shape[0]].copy_(plan.row_idx)
            p.tile_start[:T].copy_(plan.tile_start)
            p.tile_end[:T].copy_(plan.tile_end)
            p.tile_slots[:T].copy_(plan.tile_slots)
            p.tile_start[T:].zero_()  # empty tiles: no row, no slot
            p.tile_end[T:].zero_()
            p.tile_slots[T:].fill_(-1)

    def _record(self, st: _Shape) -> None:
        """Capture the shape's layers (its buffers hold the current step's inputs: the warm-up runs
        write that step's own K and V rows, as the replay then does)."""
        dev = st.x.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles every kernel and settles the allocator first
            for _ in range(2):
                self.runner._layers(st.x, st.meta)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a delta load's copies on another thread do not break a capture at run time
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            st.out = self.runner._layers(st.x, st.meta)
        st.graph = graph

    def warm(self) -> list[tuple[int, int, str]]:
        """Capture every bucket's one-plane shapes now (the worker's start-up, beside the kernels'
        warm-up; the largest first, so the smaller ones reuse its memory): decode steps at position 0
        of block 0 (the pool's blocks are not in use yet) with no delta, a few rows of slot 0 (BGMV)
        and every row of slot 0 (SGMV, where the bucket holds sgmv_min_rows rows). Returns the shapes
        held after it; a step of more planes per row is captured when one comes."""
        r = self.runner
        sgmv_from = config_for(r.device)["sgmv_min_rows"]
        for B in sorted(self.buckets, reverse=True):
            mixes = [[-1] * B]
            if r.slots.n_slots:
                few = min(B, sgmv_from - 1)
                mixes += [[0] * few + [-1] * (B - few)] + ([[0] * B] if B >= sgmv_from else [])
            for slots in mixes:
                with torch.inference_mode():
                    m = r.prepare([SeqWork([0], 0, s, [0], True) for s in slots])
                    self.run(r._embed(m), m)
        return sorted(self.shapes)


__all__ = ["DecodeGraphs", "BUCKETS"]
