"""The model step: one ragged ("packed tokens") forward over a batch that mixes
sequences of several variants and of the base.

    x: [N, dim]   the new tokens of every scheduled sequence, concatenated

For every linear layer the base GEMM runs ONCE over all N rows; then one
`bitdelta_delta_batched` launch adds each row's delta, selected by
`row_slot[r]` (−1 = base row) from the slot stacks (a variant of k sign planes:
each of its k slots, `row_slots[r, p]`, in the same launch), and each variant with a
low-rank residual adds (x·Vᵀ)·Uᵀ to its rows, all in fp32 before the one rounding. A
batch whose rows all belong to one variant uses the fused `bitdelta_linear` instead
(its k planes as one view of the stacks when its slots are a contiguous run). Attention runs
per sequence against its own blocks of the paged KV pool (the decode rows of all
sequences in one `bitdelta_kernels.paged_decode` call that reads their blocks in place). The LM head
reads the base's head once for the base's rows and once for the rows of every variant whose head
is the base's plus sign planes (a tied embedding compressed to signs), each adding its own.

No host sync inside a step: every index tensor of a step is built on the host in
`prepare` (from the scheduler's lists, never from device values) and copied over
asynchronously from pinned memory; the layers only launch work. The one sync per
step is the engine reading the sampled tokens. `warmup` runs every kernel
configuration a step can launch once at start-up, so no request pays a JIT compile.

This module sees tensors and slot indices only; who runs (ids, budgets) is the
scheduler's business, which delta sits in which slot is the manager's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from bitdelta.checkpoint import CheckpointReader, read_config
from bitdelta.model import (
    ModelArgs,
    RopeCache,
    attend,
    attention_mask,
    embed_scaled,
    final_logits,
    gate_act,
    residual,
    rotate,
    route,
)
from bitdelta.shard import EMBED, HEAD, HEAD_BIAS
from bitdelta_kernels import (
    backend_for,
    bitdelta_delta_batched,
    bitdelta_linear,
    dense_linear,
    lowrank_delta,
    paged_decode,
    plan_batch,
)
from bitdelta_kernels.configs import config_for
from bitdelta_kernels.cpu_decode import (
    GROUPS,
    Burst,
    DecodeLayer,
    DecodeLayers,
    DecodeOptions,
    DecodeShape,
    EmbedPlanes,
    HeadPlanes,
    Interrupt,
    LowRankTable,
)
from bitdelta_kernels.cpu_ops import dense_gemv_max_m
from bitdelta_kernels.lowrank import factor_mm
from services.gpu_worker.slots import BigTensor, SlotExtras, SlotTensors


@dataclass
class SeqWork:
    """One sequence's part of a step (built by the engine from scheduler output).

    tokens: the new token ids; start: position of tokens[0]; slot: delta slot
    (−1 = base); blocks: its KV block table; want_logits: sample after this step; prompt_logits: i,
    also the logits of tokens[i:] (but the sampling row) after the sampling rows: each predicts
    the next prompt token (echo's prompt logprobs); prefill: the tokens are the prompt's (a
    batch-invariant runner keeps a one-token chunk of them on the prefill path, where the
    prompt's other tokens ran, whatever the token budget cut).
    """

    tokens: list[int]
    start: int
    slot: int
    blocks: list[int]
    want_logits: bool
    prompt_logits: int | None = None
    prefill: bool = False


def _nothing() -> None:
    pass


def _base_head_only(m: StepMeta) -> bool:
    """Every logit row of the step reads the base's head alone."""
    return m.sign_heads is None and len(m.logit_groups) == 1 and m.logit_groups[0][0] == -1


def _c_adds_delta(extras: dict, w: SeqWork) -> bool:
    """Whether the C decode layers add `w`'s rows' delta: the base, or a variant of k ≥ 1 sign planes
    of row α's, with or without a low-rank term (`LowRankTable`), not one with column α's or a grown
    vocabulary."""
    ex = extras.get(w.slot) if w.slot >= 0 else None
    return ex is None or not (ex.cols or ex.vocab_size)


def _multi_plane(extras: dict, slots: set[int]) -> dict[int, tuple[int, ...]]:
    """The variants among `slots` of k ≠ 1 sign planes -> their planes' slots (`_plane_rows`): k > 1,
    or none (an imported LoRA's factors alone: its rows take no plane)."""
    return {s: extras[s].slots for s in slots if s in extras and (extras[s].slots or not extras[s].sign_planes)}


def _c_parts(slots: list[int], extras: dict) -> tuple[tuple[bool, HeadPlanes | None], tuple[bool, EmbedPlanes | None]]:
    """Whether the C decode layers make the heads and the embeddings of rows of `slots` (in order),
    and the variants' parts they add, each as (True, None) where every row's is the base's, (True,
    parts) where some variant's is the C call's to make, (False, None) where one is not: heads of
    the base's + one sign plane and nothing else (no U · V; `HeadPlanes`, each row's plane, −1 for
    the base's head alone), not dense, low-rank or of more planes; embeddings of a dense table or
    the base's + sign planes (`EmbedPlanes`), not low-rank."""
    head_of: dict[int, int] = {}
    embed_of: dict[int, int] = {}
    heads, embeds = [], []
    heads_ok = embeds_ok = True
    for s in dict.fromkeys(slots):
        ex: SlotExtras | None = extras.get(s) if s >= 0 else None
        h, e = (None, None) if ex is None else (ex.head, ex.embed)
        if h is not None and (h.weight is not None or h.u is not None or h.signs.shape[0] != 1):
            heads_ok = False
        elif h is not None:
            head_of[s] = len(heads)
            heads.append((h.signs[0], h.alpha[0]))
        if e is not None and e.u is not None:
            embeds_ok = False
        elif e is not None:
            embed_of[s] = len(embeds)
            embeds.append(e.weight if e.weight is not None else (e.signs, e.alpha))
    hp = HeadPlanes(tuple(heads), [head_of.get(s, -1) for s in slots]) if heads_ok and heads else None
    ep = EmbedPlanes(tuple(embeds), [embed_of.get(s, -1) for s in slots]) if embeds_ok and embeds else None
    return (heads_ok, hp), (embeds_ok, ep)


@dataclass
class _HostStep:
    """A step of single-token rows as the C call takes it in host integers (`DecodeLayers.bind`'s
    arguments): each row's token, slot, pool row, block list (its positions' blocks) and length,
    the rope tables and each row's row of them (None: a length-dependent rope's own tables, row b
    row b's), and its head planes, single-variant form, planes and embeddings."""

    tokens: list[int]
    row_slot: list[int]
    cos: torch.Tensor
    sin: torch.Tensor
    write_rows: list[int]
    tables: list[list[int]]
    lens: list[int]
    rope_rows: list[int] | None
    head_planes: HeadPlanes | None
    fuse: bool
    row_planes: torch.Tensor | None
    embeds: EmbedPlanes | None
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # Gemma 3's sliding layers' tables, rows as cos'

    def rows(self) -> tuple:
        """bind's positional arguments up to the block size."""
        return self.tokens, self.row_slot, self.cos, self.sin, self.write_rows, self.tables, self.lens


class HostArena:
    """Host tensors carved one after another from a few large buffers, so that a model's small
    matrices lie on 2 MB pages too: torch's allocator puts a buffer of 2 MB or more on transparent
    huge pages (the worker's process sets THP_MEM_ALLOC_ENABLE, services/gpu_worker/__main__.py),
    and a bf16 SmolLM2-135M has most of its matrices below that. A buffer's untouched rest is never
    resident, except the rest of its last partly used 2 MB page (the kernel faults a huge page in
    whole): `release_tails` gives that back once every tensor is carved."""

    CHUNK = 256 << 20  # bytes per buffer; a larger tensor gets one of its own
    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._used = 0
        self._done: list[tuple[torch.Tensor, int]] = []  # earlier buffers and the bytes they hold

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if n > self.CHUNK:
            return torch.empty(shape, dtype=dtype)
        if self._buf is None or self._used + n > self.CHUNK:
            if self._buf is not None:
                self._done.append((self._buf, self._used))
            self._buf, self._used = torch.empty(self.CHUNK, dtype=torch.uint8), 0
        out = self._buf[self._used : self._used + n].view(dtype).view(shape)
        self._used = -(-(self._used + n) // self.ALIGN) * self.ALIGN
        return out

    def release_tails(self) -> None:
        """Give back each buffer's pages past its last tensor (`madvise(MADV_DONTNEED)`: the kernel
        splits the partly used huge page and frees its rest, up to 2 MB a buffer). No tensor may be
        carved after this. A kernel without madvise keeps them: nothing changes but the RSS."""
        page = os.sysconf("SC_PAGE_SIZE")
        bufs = self._done + ([(self._buf, self._used)] if self._buf is not None else [])
        for buf, used in bufs:
            # whole pages inside the buffer only: a buffer the allocator placed on its heap shares its
            # first and last pages with its neighbours, which madvise would zero
            start = -(-(buf.data_ptr() + used) // page) * page
            end = (buf.data_ptr() + buf.numel()) // page * page
            if end > start:
                _madvise_dontneed(start, end - start)
        self._buf, self._done = None, []


def _madvise_dontneed(addr: int, length: int) -> None:
    """madvise(addr, length, MADV_DONTNEED) where libc has it (Linux); else nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


@dataclass
class BaseWeights:
    """The base, resident once. The matrices of a projection group are concatenated along d_out
    in the checkpoint's own layout (`ModelArgs.matrices()`: q ‖ k ‖ v, or Phi-3's fused qkv)."""

    embed: torch.Tensor  # [vocab, dim]
    layers: list[dict[str, torch.Tensor]]  # group -> [d_out_g, d_in_g]
    norms: list[dict[str, torch.Tensor]]  # norm parameter key (ModelArgs.norm_params) -> [size]
    biases: list[dict[str, torch.Tensor]]  # group -> [d_out_g], for groups with biases
    final_norm: torch.Tensor  # [dim]
    head: torch.Tensor  # [vocab, dim]; the embedding itself when tied
    final_norm_bias: torch.Tensor | None = None  # [dim], StableLM's (Family.norm_bias)
    head_bias: torch.Tensor | None = None  # [vocab], Phi's (Family.head_bias)

    @classmethod
    def load(cls, ckpt, dtype: torch.dtype, device: torch.device, part=None) -> tuple[BaseWeights, ModelArgs]:
        """Read the base straight from the checkpoint: each tensor is copied from the file mapping
        (cast to `dtype`) into its place in a tensor of its own, a group's matrices into one
        [d_out_g, d_in_g], so the weights cost their bytes and nothing beside them (building the
        model first left 77 MB more resident in fp32 for SmolLM2-135M, the allocator's leftovers of
        its copies) and no view of the mapping outlives the reader. `part(reader, name)`: the
        part of a tensor kept (a tensor-parallel rank's slice, `parallel.load_base_shard`); default
        all of it. The checkpoint's tensors must be the ones its config describes."""
        args = ModelArgs.from_hf(read_config(ckpt))
        take = part or (lambda r, name: r.get(name))
        read: set[str] = set()
        arena = HostArena() if device.type == "cpu" else None

        def tensor(r: CheckpointReader, names: list[str]) -> torch.Tensor:
            parts = [take(r, n) for n in names]  # views of the mapping (or a slice's read)
            shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
            out = arena.empty(shape, dtype) if arena else torch.empty(shape, dtype=dtype, device=device)
            row = 0
            for t in parts:
                out[row : row + t.shape[0]].copy_(t)
                row += t.shape[0]
            read.update(names)
            return out

        layers, norms, biases = [], [], []
        with CheckpointReader(ckpt) as r:
            for i in range(args.n_layers):
                groups: dict[str, list[str]] = {}
                for m in args.matrices():
                    groups.setdefault(m.group, []).append(f"model.layers.{i}.{m.name}")
                layers.append({g: tensor(r, [f"{n}.weight" for n in ns]) for g, ns in groups.items()})
                biases.append(
                    {g: tensor(r, [f"{n}.bias" for n in ns]) for g, ns in groups.items() if f"{ns[0]}.bias" in r}
                )
                # Command R+'s q/k norms [heads, head_dim] flattened as the slots' stacks hold them
                norms.append({key: tensor(r, [f"model.layers.{i}.{p}"]).view(-1) for key, p, _ in args.norm_params()})
            embed = tensor(r, [EMBED])
            head = embed if args.tie_embeddings else tensor(r, [HEAD])
            final = tensor(r, [f"{args.final_norm_path}.weight"])
            final_bias = tensor(r, [f"{args.final_norm_path}.bias"]) if args.family.norm_bias else None
            head_bias = tensor(r, [HEAD_BIAS]) if args.family.head_bias else None
            unexpected = [
                k
                for k in r.keys()
                if k not in read and not k.endswith("rotary_emb.inv_freq") and not (args.tie_embeddings and k == HEAD)
            ]
        if unexpected:
            raise ValueError(f"{ckpt}: checkpoint does not match the config: unexpected {sorted(unexpected)[:5]}")
        if arena:
            arena.release_tails()
        return cls(embed, layers, norms, biases, final, head, final_bias, head_bias), args

    @property
    def nbytes(self) -> int:
        ts = [self.embed, self.final_norm] + [t for d in self.layers + self.norms + self.biases for t in d.values()]
        ts += [t for t in (self.final_norm_bias, self.head_bias) if t is not None]
        if self.head is not self.embed:
            ts.append(self.head)
        return sum(t.numel() * t.element_size() for t in ts)


class KVPool:
    """Paged KV cache: k, v [n_layers, n_blocks * block_size, n_kv_heads, head_dim].

    Token j of a sequence with block table B lives at row B[j // bs] * bs + j % bs.
    Which blocks belong to whom is the scheduler's (`kv.BlockAllocator`).
    """

    def __init__(self, args: ModelArgs, n_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.block_size, self.n_blocks = block_size, n_blocks
        shape = (args.n_layers, n_blocks * block_size, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
        return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype.itemsize

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` tokens of block `src` into block `dst` (a forked sequence's own copy of a
        shared, partly filled block), every layer."""
        a, b = src * self.block_size, dst * self.block_size
        self.k[:, b : b + rows] = self.k[:, a : a + rows]
        self.v[:, b : b + rows] = self.v[:, a : a + rows]

    def table(self, blocks: list[int], length: int) -> list[int]:
        """The blocks of a sequence's table (`blocks`) that its first `length` tokens use."""
        return blocks[: -(-length // self.block_size)]

    def rows(self, blocks: list[int], start: int, end: int) -> list[int]:
        """Pool rows of positions [start, end) of a sequence with block table `blocks`, on the host
        (a decode row's one row costs no tensor op)."""
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


@dataclass
class StepMeta:
    """Per-step index metadata (vLLM's punica wrapper role): built once, read by every layer."""

    tokens: torch.Tensor  # [N] int64
    cos: torch.Tensor  # [N, 1, rotary dims]
    sin: torch.Tensor
    row_slot: torch.Tensor  # [N] int32, −1 = base
    norm_idx: torch.Tensor | None  # [N] int64 into the norm stacks; None: all rows share `single_norm`
    single_norm: int
    any_delta: bool
    single_slot: int | None  # all rows belong to this one variant: the fused kernel serves
    write_rows: torch.Tensor  # [N] pool rows the new k/v go to
    decode_rows: torch.Tensor | None  # [B] rows of x that are single-token decodes
    decode_tables: torch.Tensor | None  # [B, max_blocks] int32 their block tables (padded with 0)
    decode_lens: torch.Tensor | None  # [B] int32 their lengths, the new token included
    prefills: list[tuple[int, int, torch.Tensor, dict]]  # (row0, n, pool rows [L], window -> mask [n, L])
    logit_rows: torch.Tensor  # [R] rows whose logits are wanted
    logit_slots: list[int]  # [R] their slots
    plan: object = None  # kernels.BatchPlan: rows grouped by slot, shared by every layer of the step
    extras: dict | None = None  # the slots' extras snapshot this step reads (copy-on-write in slots.py)
    embed_rows: dict | None = None  # slot -> [n] rows of x whose slot has its own embedding (None: every row)
    logit_norm_idx: torch.Tensor | None = None  # [R] final-norm rows of the logit rows (None: single_norm)
    logit_groups: list | None = None  # [(slot or −1, [r] rows of the logits)]: the base's head or a dense one
    # The logit rows of variants whose head is the base's + sign planes (+ U · V): one product with the
    # base's head for all of them (`_sign_heads`); None: no such row
    sign_heads: SignHeads | None = None
    # The batched launch's rows when they are not `row_slot`: with variants of k > 1 sign planes each
    # row's slot of every plane ([N, K] int32, −1 where its variant has fewer), and without the
    # rows of variants with column α's (−1), which launch apart (`col_launches`); `plan` is its plan
    row_slots: torch.Tensor | None = None
    # Variants with column α's: (their first slot s, planes k, rows [N] or [N, k] into the view
    # s..s+k of the stacks, −1 elsewhere, its plan): one launch each, with their col_alpha
    col_launches: list[tuple[int, int, torch.Tensor, object]] | None = None
    single_planes: int = 1  # the fused path's variant: its planes, slots single_slot.. (a run)
    # Each row's slots on the host ([N] int32, or [N, K] with k > 1 planes) where no delta of the step
    # has column α's: what the C decode layers and `graphs.DecodeGraphs` (no low-rank term) take
    host_slots: torch.Tensor | None = None
    lowrank_rows: dict | None = None  # slot -> [n] rows of x (None: every row) whose variant has a low-rank part
    # Gemma 3's sliding-window layers' own rope (ModelArgs.local_rope): cos, sin as above; None: one rope
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    # Ministral 3's attention temperature: [N, 1, 1] each row's q factor in the dtype, or None where
    # every row's is 1 (every position below the original context: ModelArgs.q_temperature)
    q_temperature: torch.Tensor | None = None
    host_rows: torch.Tensor | None = None  # [N] int32 row_slot on the host (a sparse layer's experts' rows)
    # a variant's grown vocabulary in the step: tokens past the base's (its rows' embeddings are its
    # own table's), and the logits' columns (the widest logit row's vocabulary; −inf past a row's own)
    grown_tokens: bool = False
    vocab: int = 0


@dataclass
class SignHeads:
    """The logit rows whose variant's head is the base's plus its own sign planes (+ U · V), e.g. a
    tied embedding compressed to signs: built on the host in `prepare`, read by `_sign_heads`."""

    rows: torch.Tensor | None  # [n] int64 rows of the logits, in order (None: all of them)
    # per variant: (slot, [n, k] int32 over `rows`: 0..k−1 on its rows, −1 elsewhere, its plan,
    # [n_s] int64 its positions in `rows` for the low-rank term, or None when it has every row)
    variants: list[tuple[int, torch.Tensor, object, torch.Tensor | None]]


class StepGraphs(Protocol):
    """What runs some steps' layers in place of `ModelRunner._layers` (`graphs.DecodeGraphs`)."""

    def serves(self, m: StepMeta) -> bool: ...

    def run(self, x: torch.Tensor, m: StepMeta) -> torch.Tensor: ...


# A layer's norms in the C layers' order (DecodeLayer.norms): a family has some of them


def c_norm_names(args: ModelArgs) -> tuple[str | None, ...]:
    """A layer's norms in the C layer's order (`DecodeLayer.norms`): the input's; the post-attention
    one (a Llama layer's MLP input, a sandwich's or OLMo's attention output); a sandwich's MLP input;
    the MLP's output. None where the family has none."""
    inp, attn_out, mlp_in, mlp_out = args.norm_roles()
    return (inp, attn_out, mlp_in, mlp_out) if attn_out is not None else (inp, mlp_in, None, None)


class ModelRunner:
    """Holds the base weights, the slot stacks and the KV pool; runs steps."""

    def __init__(
        self,
        base: BaseWeights,
        args: ModelArgs,
        slots: SlotTensors,
        kv: KVPool,
        use_fused: bool = True,
        backend: str | None = None,
        batch_invariant: bool = False,
    ):
        """backend: the kernels' backend for every call (bitdelta_kernels.backend_for); None: the process's.
        batch_invariant: a row's numbers never depend on its step's other rows (CPU kernels only,
        and the process's kernel settings must say so too: the worker checks both at start): every
        projection by the per-row C paths, no fused single-variant form, every token's attention by
        the paged kernel, decode rows through the C layers at any count (docs/kernels.md)."""
        self.base, self.args, self.slots, self.kv = base, args, slots, kv
        self.device = base.embed.device
        self.dtype = base.embed.dtype
        self.batch_invariant = batch_invariant
        self.use_fused = use_fused and not batch_invariant
        self.backend = backend
        self.rope = RopeCache(args, self.dtype, self.device)
        local = None if args.local_rope is None else dataclasses.replace(args, rope=args.local_rope)
        self.local_rope = None if local is None else RopeCache(local, self.dtype, self.device)
        self._c_layers: DecodeLayers | None = None  # built on the first step the C layers serve
        self._c_lowrank_of: tuple[dict | None, LowRankTable | None] = (None, None)  # (extras, its table)
        # CUDA graphs of decode steps' layers (`graphs.DecodeGraphs`, the worker's --cuda-graphs); None: eager
        self.graphs: StepGraphs | None = None
        # byte -> its 8 signs as ±1 (bit j: column j, bitdelta_kernels.bits): a sign row unpacked in one lookup
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        self._sign_values = (bits * 2 - 1).to(torch.float32).to(self.device)  # [256, 8]

    # -- metadata -------------------------------------------------------------------------------
    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without a host sync: pinned, then copied asynchronously
        (torch's pinned allocator keeps the buffer until the copy has run)."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _plan(self, rows: torch.Tensor, n_slots: int, unpack: bool = True):
        """The batched delta's plan of host `rows` (bitdelta_kernels.plan_batch) for a device, built here
        from the host copy so no launch syncs; None on CPU, where the C kernels need none (and a
        Triton launch there plans from its CPU tensors itself): ~75 µs a plan, per step. `unpack`:
        a prefill chunk's slot set may take the unpacked GEMMs (not for column α's)."""
        return None if self.device.type == "cpu" else plan_batch(rows, n_slots, device=self.device, unpack=unpack)

    def prepare(self, work: list[SeqWork]) -> StepMeta:
        """Every index a step needs, built on the host from `work` (no device value is read)."""
        tokens, positions, seq_lens, row_slot, write_rows = [], [], [], [], []
        decode_rows, decode_ctx, prefills, logit_rows, logit_slots = [], [], [], [], []
        prompt_rows, prompt_slots = [], []  # after the sampling rows, in work order
        windows = set(self.args.windows or (None,))  # the distinct per-layer windows (None: full attention)
        r = 0
        for w in work:
            n = len(w.tokens)
            tokens.extend(w.tokens)
            positions.extend(range(w.start, w.start + n))
            seq_lens.extend([w.start + n] * n)  # the sequence's length at this step (dynamic rope, LongRoPE)
            row_slot.extend([w.slot] * n)
            write_rows.extend(self.kv.rows(w.blocks, w.start, w.start + n))
            if n == 1 or self.batch_invariant:  # batch-invariant: every token as a decode row (its own keys, in place)
                for j in range(n):
                    decode_rows.append(r + j)
                    decode_ctx.append((self.kv.table(w.blocks, w.start + j + 1), w.start + j + 1))
            else:
                L = w.start + n
                q_pos, k_pos = torch.arange(w.start, L), torch.arange(L)
                masks = {win: self._dev(attention_mask(q_pos, k_pos, win)) for win in windows}  # [n, L] each
                ctx = torch.tensor(self.kv.rows(w.blocks, 0, L))  # [L] the whole context incl. the new tokens
                prefills.append((r, n, self._dev(ctx), masks))
            if w.want_logits:
                logit_rows.append(r + n - 1)
                logit_slots.append(w.slot)
            if w.prompt_logits is not None:  # each row predicts the next prompt token (the sampling row: none)
                rows = range(r + w.prompt_logits, r + n - int(w.want_logits))
                prompt_rows.extend(rows)
                prompt_slots.extend([w.slot] * len(rows))
            r += n
        logit_rows, logit_slots = logit_rows + prompt_rows, logit_slots + prompt_slots
        slots_set = set(row_slot)
        single = next(iter(slots_set)) if len(slots_set) == 1 else None
        pos_t = self._dev(torch.tensor(positions, dtype=torch.int64))
        cos, sin = self.rope.tables(pos_t, max(positions, default=0) + 1, seq_lens)
        rs = torch.tensor(row_slot, dtype=torch.int32)
        extras = self.slots.extras  # one snapshot for the whole step
        deltas, plan_rows = self._row_deltas(rs, extras)
        meta = StepMeta(
            tokens=self._dev(torch.tensor(tokens, dtype=torch.int64)),
            cos=cos[:, None, :],
            sin=sin[:, None, :],
            norm_idx=None if single is not None else self._dev(rs.to(torch.int64) + 1),
            single_norm=(single + 1) if single is not None else 0,
            write_rows=self._dev(torch.tensor(write_rows, dtype=torch.int64)),
            decode_rows=None,
            decode_tables=None,
            decode_lens=None,
            prefills=prefills,
            logit_rows=self._dev(torch.tensor(logit_rows, dtype=torch.int64)),
            logit_slots=logit_slots,
            extras=extras,
            host_rows=rs,
            grown_tokens=max(tokens, default=0) >= self.args.vocab_size,
            vocab=max((self._vocab_of(s, extras) for s in logit_slots), default=self.args.vocab_size),
            **deltas,
        )
        if self.local_rope is not None:
            lc, ls = self.local_rope.tables(pos_t, max(positions, default=0) + 1, seq_lens)
            meta.local_cos, meta.local_sin = lc[:, None, :], ls[:, None, :]
        if not self._below_temperature(max(positions, default=0) + 1):
            temperature = self.args.q_temperature(torch.tensor(positions, dtype=torch.int64))
            meta.q_temperature = self._dev(temperature.to(self.dtype)[:, None, None])
        # rows whose slot brings its own embedding (dense or signs): found here, not by a device nonzero()
        meta.embed_rows = {}
        for slot, ex in extras.items():
            if ex.embed is not None and slot in slots_set:
                rows = None if single is not None else (rs == slot).nonzero(as_tuple=True)[0]  # host: no sync
                meta.embed_rows[slot] = None if rows is None else self._dev(rows.to(torch.int64))
        if len(set(logit_slots)) > 1:
            meta.logit_norm_idx = self._dev(torch.tensor(logit_slots, dtype=torch.int64) + 1)
        groups: dict[int, list[int]] = {}  # the base's head (−1) or a variant's dense one
        signed: dict[int, list[int]] = {}  # a variant's sign planes on the base's head
        for i, s in enumerate(logit_slots):
            head = extras[s].head if s >= 0 and s in extras else None
            if head is not None and head.weight is None:
                signed.setdefault(s, []).append(i)
            else:
                groups.setdefault(-1 if head is None else s, []).append(i)
        meta.logit_groups = [(s, self._dev(torch.tensor(idx, dtype=torch.int64))) for s, idx in groups.items()]
        if signed:
            meta.sign_heads = self._sign_head_rows(signed, len(logit_slots), extras)
        if decode_rows:
            width = max(len(t) for t, _ in decode_ctx)  # padded with block 0, never read
            tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in decode_ctx], dtype=torch.int32)
            meta.decode_rows = self._dev(torch.tensor(decode_rows, dtype=torch.int64))
            meta.decode_tables = self._dev(tables)
            meta.decode_lens = self._dev(torch.tensor([n for _, n in decode_ctx], dtype=torch.int32))
        if plan_rows is not None and not (self.graphs is not None and self.graphs.serves(meta)):
            meta.plan = self._plan(plan_rows, self.slots.n_slots)  # graphs.run plans its padded rows instead
        return meta

    def _row_deltas(self, rs: torch.Tensor, extras: dict) -> tuple[dict, torch.Tensor | None]:
        """How the projections add the deltas of rows whose host slots are `rs` ([N] int32, −1 = the
        base), as StepMeta's fields (row_slot, any_delta, single_slot, single_planes, row_slots,
        col_launches, host_slots, lowrank_rows), and the batched launch's host rows to plan (None:
        no batched launch). `extras`: the step's snapshot of the slots' extras."""
        slots_set = set(rs.tolist())
        single = next(iter(slots_set)) if len(slots_set) == 1 else None
        planes = _multi_plane(extras, slots_set)
        low = {s for s in slots_set if s in extras and extras[s].lowrank}
        colv = {s: len(extras[s].slots) or 1 for s in slots_set if s in extras and extras[s].cols}
        fused = single is not None and single >= 0 and self.use_fused  # a delta's slots are a run (SlotWriter)
        if fused and single in low and self.dtype != torch.float32:
            fused = False  # the fused kernel rounds; a low-rank term goes in before the one rounding
        out: dict = {
            "row_slot": self._dev(rs),
            "any_delta": any(s >= 0 for s in slots_set),
            "single_slot": single if fused else None,
            "single_planes": len(planes.get(single, (single,))) if fused else 1,
            "row_slots": None,
            "col_launches": None,
            "host_slots": None,
            "lowrank_rows": None,
        }
        plan_rows = None  # the batched delta's host row slots (planned last: a graphed step plans its own)
        if out["any_delta"] and not fused:  # every plan from host copies: no device sync
            main = rs.clone()
            out["col_launches"] = []
            for s, k in colv.items():  # a launch of its own over the view s..s+k, with its col_alpha
                mine = rs == s
                main[mine] = -1
                local = torch.full((len(rs), k), -1, dtype=torch.int32)
                local[mine] = torch.arange(k, dtype=torch.int32)
                local = local[:, 0].contiguous() if k == 1 else local
                out["col_launches"].append((s, k, self._dev(local), self._plan(local, k, unpack=False)))
            if planes.keys() - colv.keys():
                main = self._plane_rows(main, {s: v for s, v in planes.items() if s not in colv})
            if colv or planes:
                out["row_slots"] = self._dev(main)
            plan_rows = main
        if not colv:  # sign planes of row α's (and low-rank terms): the C layers' and a graphed decode's rows
            out["host_slots"] = plan_rows if plan_rows is not None else self._plane_rows(rs, planes) if planes else rs
        if low:
            out["lowrank_rows"] = {
                s: None if single is not None else self._dev((rs == s).nonzero(as_tuple=True)[0].to(torch.int64))
                for s in low
            }
        return out, plan_rows

    def _rows_meta(self, m: StepMeta, rows: torch.Tensor) -> StepMeta:
        """`m` for the projections of its host `rows` alone ([n] int64: a sparse layer's expert's
        tokens): their slots' delta fields, planned. Rows of one variant (or the base) alone read no
        per-row index: `m` itself serves them."""
        if m.single_slot is not None or not m.any_delta:
            return m
        deltas, plan_rows = self._row_deltas(m.host_rows[rows], m.extras)
        plan = None if plan_rows is None else self._plan(plan_rows, self.slots.n_slots)
        return dataclasses.replace(m, **deltas, plan=plan)

    def _plane_rows(self, rows: torch.Tensor, planes: dict[int, tuple[int, ...]]) -> torch.Tensor:
        """Host row slots [N] -> [N, k]: each row's slot of every plane (−1 where its variant has fewer),
        from a table slot -> its slots (`planes`: the variants of k ≠ 1 planes, `_multi_plane`; any
        other slot is its own one plane)."""
        k = max(1, max(len(v) for v in planes.values()))
        table = torch.full((self.slots.n_slots + 1, k), -1, dtype=torch.int32)
        table[1:, 0] = torch.arange(self.slots.n_slots, dtype=torch.int32)
        for s, ids in planes.items():
            table[s + 1] = -1
            table[s + 1, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table[rows.to(torch.int64) + 1]

    def _sign_head_rows(self, signed: dict[int, list[int]], n_logits: int, extras: dict) -> SignHeads:
        """`SignHeads` of the logit rows `signed` (slot -> its rows), on the host."""
        rows = sorted(i for idx in signed.values() for i in idx)
        at = {r: j for j, r in enumerate(rows)}  # logit row -> its position among `rows`
        variants = []
        for s, idx in signed.items():
            k = extras[s].head.signs.shape[0]
            local = torch.full((len(rows), k), -1, dtype=torch.int32)
            mine = torch.tensor([at[i] for i in idx], dtype=torch.int64)
            local[mine] = torch.arange(k, dtype=torch.int32)
            low = None if len(idx) == len(rows) else self._dev(mine)
            variants.append((s, self._dev(local), self._plan(local, k), low))
        every = len(rows) == n_logits  # then `rows` is 0..n−1
        return SignHeads(None if every else self._dev(torch.tensor(rows, dtype=torch.int64)), variants)

    # -- layers ---------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, layer: int, group: str, m: StepMeta) -> torch.Tensor:
        """y = x · W_baseᵀ, plus y[r] += α_s ⊙ (x[r] · S_sᵀ) for s = row_slot[r] ≥ 0.

        x: [N, d_in] -> y: [N, d_out_g]
        """
        y = self._linear_nobias(x, layer, group, m)
        bias = self.slots.biases[layer].get(group)
        if bias is None:
            return y
        # each row adds its variant's bias (row 0 of the stack: the base's), like the norms
        return y + (bias[m.single_norm] if m.norm_idx is None else bias[m.norm_idx])

    def _linear_nobias(self, x: torch.Tensor, layer: int, group: str, m: StepMeta) -> torch.Tensor:
        w = self.base.layers[layer][group]
        signs, alpha = self.slots.signs[layer][group], self.slots.alpha[layer][group]
        if m.single_slot is not None:  # a low-rank term here only in fp32 (prepare): no second rounding
            s, k = m.single_slot, m.single_planes
            ex = m.extras.get(s)
            c = ex.cols.get((layer, group)) if ex is not None else None
            cols = (
                {}
                if c is None
                else {"col_alpha": c[0] if k == 1 else c, "col_splits": self.slots.layout.group_rows[group]}
            )
            if not k:  # no sign plane (an imported LoRA): the base's product, its factors below
                y = dense_linear(x, w, backend=self.backend)
                self._add_lowrank(x, y, layer, group, m)
                return y
            planes = (signs[s], alpha[s]) if k == 1 else (signs[s : s + k], alpha[s : s + k])
            y = bitdelta_linear(x, w, *planes, **cols, backend=self.backend)
            self._add_lowrank(x, y, layer, group, m)
            return y
        if not m.any_delta or x.dtype == torch.float32:
            y = dense_linear(x, w, backend=self.backend)
            if m.any_delta:
                self._add_delta(x, signs, alpha, y, layer, group, m)
                self._add_lowrank(x, y, layer, group, m)
            return y
        # fp16/bf16: the base GEMM's output stays fp32 until the delta is in, then rounds ONCE,
        # like the fused kernel. Rounding x·Wᵀ to bf16 first would erase a real delta (a few
        # tenths of y's bf16 spacing): a request's tokens would depend on its batch.
        y = self._mm_fp32(x, w)
        self._add_delta(x, signs, alpha, y, layer, group, m)
        self._add_lowrank(x, y, layer, group, m)
        return y.to(x.dtype)

    def _add_delta(self, x, signs, alpha, y, layer: int, group: str, m: StepMeta) -> None:
        """y[r] += Σ_p α ⊙ (x[r] · Sᵀ) over the slots of every sign plane of row r's variant: one
        launch, and one per variant with column α's (over its slots' view, with its col_alpha)."""
        rows = m.row_slot if m.row_slots is None else m.row_slots
        bitdelta_delta_batched(x, signs, alpha, rows, y, plan=m.plan, backend=self.backend)
        for s, k, local, plan in m.col_launches or ():
            c = m.extras[s].cols.get((layer, group))
            cols = {} if c is None else {"col_alpha": c, "col_splits": self.slots.layout.group_rows[group]}
            bitdelta_delta_batched(
                x, signs[s : s + k], alpha[s : s + k], local, y, **cols, plan=plan, backend=self.backend
            )

    def _add_lowrank(self, x: torch.Tensor, y: torch.Tensor, layer: int, group: str, m: StepMeta) -> None:
        """y (fp32) [rows of each variant with a low-rank part] += (x · Vᵀ) · Uᵀ: one GEMM into its
        stacked rank, one per matrix out of it, accumulated in fp32."""
        for slot, rows in (m.lowrank_rows or {}).items():
            lr = m.extras[slot].lowrank.get((layer, group))
            if lr is None:
                continue
            lowrank_delta(x, lr.v, lr.u, y, rows)

    def _mm_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x · wᵀ with fp32 accumulation AND fp32 output. x: [N, d_in]; w: [d_out, d_in] -> fp32 [N, d_out]."""
        return dense_linear(x, w, out_fp32=True, backend=self.backend)

    def _norm(
        self, x: torch.Tensor, weights: torch.Tensor, m: StepMeta, eps: float, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm over the last dim with a per-row weight. x: [N, size] or [N, heads, size] (Qwen3's
        per-head q/k norms); weights: [n_slots + 1, size] (row 0 = base). Gemma's scales by (1 + w)
        in fp32 and rounds once, OLMo 2's by w, Cohere's LayerNorm subtracts the mean first and scales
        by w as OLMo 2's, StableLM's adds its per-row `bias` [n_slots + 1, size] before the rounding,
        Nemotron's scales by (w + 1) rounded to w's dtype (bitdelta.model.RMSNorm)."""
        xf = x.float()
        if self.args.family.layer_norm:
            xf = xf - xf.mean(-1, keepdim=True)
        xf = F.rms_norm(xf, (x.shape[-1],), eps=eps)  # one op for x·rsqrt(mean(x²) + eps)
        return self._scaled(x, xf, weights, m, bias)

    def _whole_qk_norms(
        self, q: torch.Tensor, k: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], m: StepMeta, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo 2's, OLMo 3's and OLMoE's q and k [N, heads · hd], each normed over every head together (a
        tensor-parallel rank holds some of the heads: `ShardedRunner` sums the squares across the ranks)."""
        return self._norm(q, weights[0], m, eps), self._norm(k, weights[1], m, eps)

    def _scaled(
        self, x: torch.Tensor, xf: torch.Tensor, weights: torch.Tensor, m: StepMeta, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`_norm`'s second half: x normalised in fp32 (xf) scaled by each row's weights (and bias) as the
        family rounds them, in x's dtype."""

        def rows(t: torch.Tensor) -> torch.Tensor:  # each row's slot's entry of a stack
            return t[m.single_norm] if m.norm_idx is None else t[m.norm_idx]

        w = rows(weights)
        if x.dim() == 3 and w.shape[-1] != x.shape[-1]:  # Command R+'s: each head its own weights
            w = w.view(*w.shape[:-1], *x.shape[1:])
        elif x.dim() == 3 and w.dim() == 2:
            w = w[:, None, :]
        if self.args.family.gemma:
            return (xf * (1.0 + w.float())).to(x.dtype)
        if self.args.family.norm_once or self.args.family.layer_norm:  # OLMo 2's, the LayerNorms': w · x in fp32, once
            y = (w + 1 if self.args.family.norm_plus_one else w).float() * xf  # Nemotron's w + 1 in w's dtype
            if bias is not None:
                y = y + rows(bias).float()
            return y.to(x.dtype)
        return w * xf.to(x.dtype)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, m: StepMeta) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, KV, hd] (new tokens) -> [N, H, hd]. The layer's sliding window
        (if any) is in the masks prepare() built for each distinct window."""
        win = self.args.window(layer)
        kc, vc = self.kv.k[layer], self.kv.v[layer]  # [rows, KV, hd]
        kc[m.write_rows] = k
        vc[m.write_rows] = v
        a = self.args
        out = torch.empty_like(q)
        if m.decode_rows is not None:  # each sequence's blocks read in place, fp32 softmax
            out[m.decode_rows] = paged_decode(
                q[m.decode_rows],
                kc,
                vc,
                m.decode_tables,
                m.decode_lens,
                self.kv.block_size,
                win,
                scale=a.attn_scale,
                softcap=a.attn_softcap,
                backend=self.backend,
            )
        for r0, n, ctx, mask in m.prefills:
            qs = q[r0 : r0 + n].transpose(0, 1)[None]  # [1, H, n, hd]
            ks = kc[ctx].transpose(0, 1)[None]  # [1, KV, L, hd]
            vs = vc[ctx].transpose(0, 1)[None]
            out[r0 : r0 + n] = attend(qs, ks, vs, mask[win], a)[0].transpose(0, 1)
        return out

    def _vocab_of(self, slot: int, extras: dict) -> int:
        """The vocabulary of a row of `slot`: its variant's grown one, else the base's."""
        ex = extras.get(slot) if slot >= 0 else None
        return (ex.vocab_size if ex is not None else 0) or self.args.vocab_size

    def _embed(self, m: StepMeta) -> torch.Tensor:
        # a grown vocabulary's tokens past the base's: any base row, replaced by their variant's own
        tokens = m.tokens.clamp(max=self.args.vocab_size - 1) if m.grown_tokens else m.tokens
        x = self.base.embed[tokens]  # [N, dim]
        self._variant_embeddings(x, m, m.tokens)
        return x

    def _variant_embeddings(self, x: torch.Tensor, m: StepMeta, tokens: torch.Tensor) -> None:
        """x[rows of each variant with its own embedding] = that embedding's rows `tokens` (indices
        into this runner's table): its dense table, or the base's rows + Σ_p α_p ⊙ S_p (+ U · V)."""
        for slot, rows in m.embed_rows.items():  # rows found on the host in prepare()
            ex: BigTensor = m.extras[slot].embed
            at = slice(None) if rows is None else rows
            t = tokens[at]
            if ex.weight is not None:
                x[at] = ex.weight[t]
                continue
            acc = x[at].float()
            for p in range(ex.signs.shape[0]):  # α_p[t] ⊙ S_p[t], S_p's bytes through the ±1 table
                s = self._sign_values[ex.signs[p][t].long()].view(t.shape[0], -1)[:, : self.args.dim]
                acc.addcmul_(ex.alpha[p][t][:, None], s)
            if ex.u is not None:
                acc += factor_mm(ex.u[t].float(), ex.v.t())
            x[at] = acc.to(x.dtype)

    def _sign_heads(self, h: torch.Tensor, sh: SignHeads, extras: dict) -> torch.Tensor:
        """fp32 logits of the rows h [n, dim] of variants whose head is the base's + their sign planes
        (+ U · V): the base's head read ONCE for all of them (fp32 out), then each variant's planes
        added to its own rows (one batched launch each; −1 rows untouched) and its U · V, all in fp32
        (never rounded to the model's dtype). A row's values do not depend on the other variants in
        the step."""
        y = self._mm_fp32(h, self.base.head)  # [n, vocab]
        for s, local, plan, low in sh.variants:
            head: BigTensor = extras[s].head
            bitdelta_delta_batched(h, head.signs, head.alpha, local, y, plan=plan, backend=self.backend)
            if head.u is not None:
                lowrank_delta(h, head.v, [(0, 0, head.u)], y, low)
        return y

    def _logits(self, h: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """h: [R, dim] (final-normed) -> fp32 logits [R, vocab], each row through its variant's head:
        the base's, a dense one of its own, or the base's + its sign planes (`_sign_heads`). Phi's head
        bias (each row's variant's) is added to the products in fp32 and the sum rounded once to the
        model's dtype, as transformers' Linear with a bias rounds it."""
        bias = self.slots.head_bias
        if bias is None:
            return self._head_logits(h, m)
        out = self._head_logits(h, m, fp32=True)
        rows = bias[m.logit_slots[0] + 1] if m.logit_norm_idx is None else bias[m.logit_norm_idx]
        n = bias.shape[1]
        out[:, :n] = (out[:, :n] + rows.float()).to(self.dtype).float()
        return out

    def _head_logits(self, h: torch.Tensor, m: StepMeta, fp32: bool = False) -> torch.Tensor:
        """`_logits` without the head's bias; `fp32`: the dense heads' products not rounded to the model's dtype."""
        sh = m.sign_heads
        if _base_head_only(m):
            return dense_linear(h, self.base.head, out_fp32=fp32, backend=self.backend).float()
        if sh is not None and sh.rows is None:  # every row's head is signs on the base's
            return self._sign_heads(h, sh, m.extras)
        width = max(m.vocab, self.base.head.shape[0])  # a grown vocabulary's rows: −inf past each row's own
        fill = torch.empty if width == self.base.head.shape[0] else functools.partial(torch.full, fill_value=-math.inf)
        out = fill((h.shape[0], width), dtype=torch.float32, device=h.device)
        for s, rows in m.logit_groups:  # row indices built in prepare()
            hr = h[rows]
            head = self.base.head if s < 0 else m.extras[s].head.weight
            out[rows, : head.shape[0]] = dense_linear(hr, head, out_fp32=fp32, backend=self.backend).float()
        if sh is not None:
            out[sh.rows, : self.base.head.shape[0]] = self._sign_heads(h[sh.rows], sh, m.extras)
        return out

    # -- step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, work: list[SeqWork], ready: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits [R, vocab]: the last row of each sequence with want_logits,
        in order, then the prompt_logits rows. `ready`, if given, is called once, when the step's inputs
        are built and before its kernels run (the engine hands the previous step's tokens to the
        streams there: their Python then runs beside the kernels, which hold no GIL).

        On CPU the single-token rows of the base and of variants of sign planes only (no column α's,
        no low-rank term; up to the decode GEMV's row count) run every layer in one C
        call (`bitdelta_kernels.cpu_decode`), the rest layer by layer: the two parts are separate sequences,
        so a decode row takes the same path, and gets the same values, whatever else its step holds."""
        dec = [i for i, w in enumerate(work) if self._c_row(w)]
        ready = ready or _nothing
        if not self._c_serves(len(dec)):
            return self._forward_layers(work, ready)
        if len(dec) == len(work):
            return self._forward_c(work, ready)
        rest = [i for i in range(len(work)) if i not in set(dec)]
        a = self._forward_c([work[i] for i in dec], ready)
        b = self._forward_layers([work[i] for i in rest], _nothing)
        # sampling rows in work order (from either part), then the rest's prompt_logits rows
        where, n_a, n_b = [], 0, 0
        part = dict.fromkeys(dec, 0) | dict.fromkeys(rest, 1)
        for i, w in enumerate(work):
            if w.want_logits:
                where.append(n_a if part[i] == 0 else a.shape[0] + n_b)
                n_a, n_b = n_a + (part[i] == 0), n_b + (part[i] == 1)
        where.extend(range(a.shape[0] + n_b, a.shape[0] + b.shape[0]))
        if a.shape[1] < b.shape[1]:  # the layers' part holds a grown vocabulary's rows: the C part's padded
            a = F.pad(a, (0, b.shape[1] - a.shape[1]), value=-math.inf)
        return torch.cat([a, b])[torch.tensor(where, dtype=torch.int64, device=a.device)]

    def _c_row(self, w: SeqWork, steps: int = 1) -> bool:
        """Whether `w` is a row the C layers take (for `steps` positions from its own): one token, no
        prompt logits, the base or a variant of sign planes only (a batch-invariant runner keeps a
        prefill's last token where the rest of its prompt ran), no attention temperature."""
        return (
            len(w.tokens) == 1
            and w.prompt_logits is None
            and _c_adds_delta(self.slots.extras, w)
            and not (w.prefill and self.batch_invariant)
            and self._below_temperature(w.start + steps)
        )

    def _below_temperature(self, length: int) -> bool:
        """Whether positions below `length` take no attention temperature (ModelArgs.q_temperature: 1
        below its original context; the C layers and the graphs run none)."""
        a = self.args
        return not a.temperature_beta or length <= a.temperature_original

    def _c_serves(self, rows: int) -> bool:
        """Whether a step's `rows` C rows run in the C call: some, up to the decode GEMV's row count
        (any count where batch-invariant), and the C layers serve here."""
        many = rows > dense_gemv_max_m(self.dtype) and not self.batch_invariant
        return rows > 0 and not many and self._c_decode_serves(rows)

    @property
    def bursts(self) -> bool:
        """Whether `decode_steps` can run a batch here at all (the C layers serve this runner's layer
        on CPU, and the rope's tables do not depend on the length: a burst's positions are rows of
        one table); a batch it cannot make in host integers still gets None."""
        return self._c_group_shapes is not None and not self.args.rope.length_dependent

    @torch.inference_mode()
    def decode_steps(
        self,
        work: list[SeqWork],
        steps: int,
        interrupt: Interrupt | None = None,
        deadline: float | None = None,
        ready: Callable[[], None] | None = None,
    ) -> Burst | None:
        """Up to `steps` greedy decode steps of `work`'s rows in one C call
        (`DecodeLayers.bind_steps`: each row's argmax its next token, fed back in C) -> a `Burst`
        (each row's tokens, one per step run, and when each step's were picked); None where the C
        call does not take this step in host integers (the engine runs single steps then). Each
        row's blocks must hold its burst's positions. The tokens are those of as many `forward`
        calls with each step's argmax; `interrupt` and `deadline` (time.monotonic()) end the burst
        after a step; `ready` as `forward`'s."""
        if not (self.bursts and all(self._c_row(w, steps) for w in work) and self._c_serves(len(work))):
            return None
        if self._c_layers is None:
            self._c_layers = self._build_c_layers()
        h = self._host_step(work, steps)
        if h is None:
            return None
        call = self._c_layers.bind_steps(
            *h.rows(),
            self.kv.block_size,
            steps,
            rope_rows=h.rope_rows,
            interrupt=interrupt,
            deadline=deadline,
            head_planes=h.head_planes,
            fuse=h.fuse,
            row_planes=h.row_planes,
            embeds=h.embeds,
            lowrank=self._c_lowrank(self.slots.extras),
            local=h.local,
        )
        (ready or _nothing)()
        return call()

    def _host_step(self, work: list[SeqWork], steps: int = 1) -> _HostStep | None:
        """The C call's arguments for single-token rows given as host integers, for `steps`
        positions a row from its own (the block lists and rope rows cover them); None where the
        call cannot make every row's embedding and head (or a row does not sample)."""
        c, extras = self._c_layers, self.slots.extras
        slots = [w.slot for w in work]
        (heads_ok, heads), (embeds_ok, embeds) = _c_parts(slots, extras)
        if not (heads_ok and embeds_ok and c.head is not None and c.embed is not None):
            return None
        if not all(w.want_logits for w in work):
            return None
        pos = [w.start for w in work]
        local = None
        if self.args.rope.length_dependent:  # a step's own tables, row b row b's
            cos, sin = self.rope.tables(torch.tensor(pos), max(pos) + 1, [p + 1 for p in pos])
            cos, sin, rope_rows = cos.contiguous(), sin.contiguous(), None
            if self.local_rope is not None:
                lc, ls = self.local_rope.tables(torch.tensor(pos), max(pos) + 1, [p + 1 for p in pos])
                local = (lc.contiguous(), ls.contiguous())
        else:
            (cos, sin), rope_rows = self.rope.cached(max(pos) + steps), pos
            if self.local_rope is not None:  # both tables cover the rows; the call wants them the same size
                lc, ls = self.local_rope.cached(max(pos) + steps)
                n = min(cos.shape[0], lc.shape[0])
                cos, sin, local = cos[:n], sin[:n], (lc[:n], ls[:n])
        planes = _multi_plane(extras, set(slots))
        return _HostStep(
            tokens=[w.tokens[0] for w in work],
            row_slot=slots,
            cos=cos,
            sin=sin,
            write_rows=[self.kv.rows(w.blocks, w.start, w.start + 1)[0] for w in work],
            tables=[self.kv.table(w.blocks, w.start + steps) for w in work],
            lens=[w.start + 1 for w in work],
            rope_rows=rope_rows,
            head_planes=heads,
            fuse=self.use_fused and len(set(slots)) == 1 and slots[0] >= 0,  # never batch-invariant
            row_planes=self._plane_rows(torch.tensor(slots, dtype=torch.int32), planes) if planes else None,
            embeds=embeds,
            local=local,
        )

    def _c_decode_serves(self, rows: int) -> bool:
        """Whether the C layers run this step's decode rows: the layer is one they have
        (`_c_group_shapes`) and the CPU kernels serve here, as every projection of `rows` rows would
        choose them."""
        shapes = self._c_group_shapes
        return shapes is not None and all(
            backend_for(self.device, rows * o * i, self.backend) == "cpu" for o, i in shapes.values()
        )

    def own_layers(self) -> bool:
        """Whether this runner's layer ops are ModelRunner's own (a tensor-parallel runner replaces
        them with its collectives): what the C decode layers and the CUDA graphs stand in for."""
        ops = ("_linear", "_norm", "_attention", "_logits", "_layers")
        return all(getattr(type(self), f) is getattr(ModelRunner, f) for f in ops)

    @functools.cached_property
    def _c_group_shapes(self) -> dict[str, tuple[int, int]] | None:
        """The projection groups' shapes where the C layers can run this runner's layer (on CPU, the four
        groups, one rotary width for every layer's rope; a runner that changes a layer, as tensor
        parallelism's, keeps its own; the library built with SIMD for this dtype), else None."""
        a = self.args
        ropes = [a.rope] + ([a.local_rope] if a.local_rope is not None else [])
        if self.device.type != "cpu" or any(r.dim != a.rope.dim for r in ropes) or not self.own_layers():
            return None
        if a.local_rope is not None and a.local_rope.length_dependent:
            return None
        shapes = a.group_shapes()
        return shapes if set(shapes) == set(GROUPS) and DecodeShape.supported(self.dtype) else None

    def _forward_c(self, work: list[SeqWork], ready: Callable[[], None]) -> torch.Tensor:
        """`forward` for single-token rows only, every layer in the C call. Where every row samples
        and the C call makes each row's embedding and head (the base's, a variant's sign planes on
        the base's, or a dense embedding), the step hands it host integers: no StepMeta and no
        torch op before the call (after the layers' stream every cache is cold, and each op cost
        ~10–150 µs: ~0.4 ms of a one-row bf16 SmolLM2-135M step of ~9.5 ms); else prepare()'s
        tensors, the embedding made here and, for heads the call cannot take, _logits after it.
        `ready` runs between binding the call and making it (`DecodeLayers.bind`)."""
        if self._c_layers is None:
            self._c_layers = self._build_c_layers()
        c, extras, bs = self._c_layers, self.slots.extras, self.kv.block_size
        h = self._host_step(work)
        if h is not None:
            call = c.bind(
                *h.rows(),
                bs,
                logits=True,
                rope_rows=h.rope_rows,
                head_planes=h.head_planes,
                fuse=h.fuse,
                row_planes=h.row_planes,
                embeds=h.embeds,
                lowrank=self._c_lowrank(extras),
                local=h.local,
            )
            ready()  # no torch op between these two: most release the GIL to the loop's thread
            return final_logits(self.args, call())
        (heads_ok, heads), _ = _c_parts([w.slot for w in work], extras)
        m = self.prepare(work)
        x = embed_scaled(self.args, self._embed(m))
        every = len(m.logit_slots) == len(work)  # every row samples: its logits row is its own
        # each row's head the base's, or the base's + one sign plane of its variant (a tied
        # embedding compressed to signs): the C call ends with them (the layers, the final norm, the
        # heads in one call); else it ends with the final norm and _logits takes the rows' heads
        fused = every and heads_ok and c.head is not None
        call = c.bind(
            x,
            m.row_slot,
            m.cos[:, 0],
            m.sin[:, 0],
            m.write_rows,
            m.decode_tables,
            m.decode_lens,
            bs,
            logits=fused,
            head_planes=heads if fused else None,
            fuse=m.single_slot is not None,  # the single-variant form (never batch-invariant: use_fused)
            row_planes=m.host_slots if m.host_slots.dim() == 2 else None,  # variants of k > 1 planes
            lowrank=self._c_lowrank(extras),
            local=None if m.local_cos is None else (m.local_cos[:, 0], m.local_sin[:, 0]),
        )
        ready()
        out = call()
        if fused:
            return final_logits(self.args, out)
        if not m.logit_slots:
            return torch.empty(0, self.args.vocab_size, dtype=torch.float32, device=out.device)
        return final_logits(self.args, self._logits(out if every else out[m.logit_rows], m))

    def _c_lowrank(self, extras: dict) -> LowRankTable | None:
        """The low-rank residuals of the resident deltas in `extras` as the C layers read them (None:
        none), made once per set of resident deltas (the manager replaces `slots.extras` on every
        load and eviction, never changes it in place)."""
        if self._c_lowrank_of[0] is not extras:
            terms = {(s, layer, g): (lr.v, lr.u) for s, ex in extras.items() for (layer, g), lr in ex.lowrank.items()}
            c = self._c_layers
            table = LowRankTable(terms, c.n_slots, len(c.layers), c.shape) if terms else None
            self._c_lowrank_of = (extras, table)
        return self._c_lowrank_of[1]

    def _build_c_layers(self) -> DecodeLayers:
        a, sl = self.args, self.slots
        layers = [
            DecodeLayer(
                weights=tuple(self.base.layers[i][g] for g in GROUPS),
                signs=tuple(sl.signs[i][g] for g in GROUPS),
                alpha=tuple(sl.alpha[i][g] for g in GROUPS),
                biases=tuple(sl.biases[i].get(g) for g in GROUPS),
                norms=tuple(None if n is None else sl.norms[i][n] for n in c_norm_names(a)),
                norm_biases=tuple(None if n is None else sl.norms[i].get(f"{n}.bias") for n in c_norm_names(a)),
                k=self.kv.k[i],
                v=self.kv.v[i],
                window=a.window(i),
                qk_norms=tuple(sl.norms[i][n] for n in a.family.qk_norm_names) if a.qk_norm else None,
                local=a.local(i),
                nope=not a.rotates(i),
            )
            for i in range(a.n_layers)
        ]
        shape = DecodeShape(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size, a.norm_eps)
        head = self.base.head
        # the head in the C call where the C GEMV is the one dense_linear takes for its rows
        work = head.numel()  # a 1-row head: more rows choose the same or "cpu"
        fits = (  # Phi's head bias: the runner's _logits after the call
            head.dtype == self.dtype
            and head.is_contiguous()
            and backend_for(self.device, work, self.backend) == "cpu"
            and self.slots.head_bias is None
        )
        embed = self.base.embed  # the rows' embedding in the C call (run given token ids)
        embed = embed if embed.dtype == self.dtype and embed.is_contiguous() else None
        options = DecodeOptions(
            gemma=a.family.gemma,
            act=a.act,
            embed_scale=a.embed_scale or 0.0,
            attn_scale=a.attn_scale,
            attn_softcap=a.attn_softcap,
            embed_multiplier=a.embed_multiplier,
            residual_multiplier=a.residual_multiplier,
            norm_once=a.family.norm_once,
            qk_full=a.family.qk_whole,
            qk_heads=a.qk_heads,
            qk_after_rope=a.family.qk_after_rope,
            rotary=a.rope.dim,
            interleaved=a.rope.interleaved,
            rope_fp32=a.rope.fp32,
            layer_norm=a.family.layer_norm,
            parallel=a.parallel,
            parallel_mlp_norm=a.parallel and a.parallel_mlp_norm,
            ungated=a.family.ungated_mlp is not None,
            norm_plus_one=a.family.norm_plus_one,
            sublayers_first=a.parallel and a.family.sublayers_first,
            clip_qkv=a.clip_qkv,
        )
        return DecodeLayers(
            layers,
            shape,
            self.dtype,
            final_norm=sl.final_norm,
            final_norm_bias=sl.final_norm_bias,
            head=head if fits else None,
            embed=embed,
            options=options,
        )

    def _forward_layers(self, work: list[SeqWork], ready: Callable[[], None]) -> torch.Tensor:
        """`forward` layer by layer, op by op (a decode step's layers one graph's replay where `graphs`
        serves it)."""
        m = self.prepare(work)
        x = embed_scaled(self.args, self._embed(m))
        ready()
        graphed = self.graphs is not None and self.graphs.serves(m)
        x = self.graphs.run(x, m) if graphed else self._layers(x, m)
        return self._final(x, m)

    def _layers(self, x: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """Every layer over the embedded rows x [N, dim] -> the last layer's output [N, dim]."""
        a = self.args
        hd, H, KV = a.head_dim, a.n_heads, a.n_kv_heads
        N = x.shape[0]
        inp, attn_out, mlp_in, mlp_out = a.norm_roles()
        for i in range(a.n_layers):
            norms = self.slots.norms[i]

            def norm(t: torch.Tensor, name: str, norms=norms) -> torch.Tensor:  # the layer's norm (StableLM's biased)
                return self._norm(t, norms[name], m, a.norm_eps, norms.get(f"{name}.bias"))

            cos, sin = (m.local_cos, m.local_sin) if a.local(i) else (m.cos, m.sin)
            rope = a.local_rope if a.local(i) else a.rope  # GLM's interleaved pairs, ERNIE's fp32 rotation
            h = x if inp is None else norm(x, inp)  # OLMo 2/3: no input norm
            qkv = self._linear(h, i, "qkv", m)
            clip = a.clip_qkv  # OLMo 1, OLMoE: q, k and v clipped, OLMoE's q and k after their norms
            if clip is not None and not a.family.qk_whole:
                qkv = qkv.clamp(-clip, clip)
            v = qkv[:, (H + KV) * hd :].view(N, KV, hd)
            qn, kn = a.family.qk_norm_names
            if a.family.qk_whole:  # OLMo 2, OLMoE: q and k normed whole, then split into heads
                q, k = self._whole_qk_norms(
                    qkv[:, : H * hd], qkv[:, H * hd : (H + KV) * hd], (norms[qn], norms[kn]), m, a.norm_eps
                )
                if clip is not None:
                    q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
                q, k = q.view(N, H, hd), k.view(N, KV, hd)
                if a.rotates(i):
                    q, k = rotate(rope, q, cos, sin), rotate(rope, k, cos, sin)
            elif a.qk_norm and a.family.qk_after_rope:  # Hunyuan: the rope, then the norms
                qk = qkv[:, : (H + KV) * hd].view(N, H + KV, hd)
                if a.rotates(i):
                    qk = rotate(rope, qk, cos, sin)
                q, k = norm(qk[:, :H], qn), norm(qk[:, H:], kn)
            elif a.qk_norm:
                q = norm(qkv[:, : H * hd].view(N, H, hd), qn)
                k = norm(qkv[:, H * hd : (H + KV) * hd].view(N, KV, hd), kn)
                if a.rotates(i):  # EXAONE 4's full layers: NoPE
                    q, k = rotate(rope, q, cos, sin), rotate(rope, k, cos, sin)
            elif not a.rotates(i):  # SmolLM3's and Cohere 2's NoPE layers: q and k as projected
                q, k = qkv[:, : H * hd].view(N, H, hd), qkv[:, H * hd : (H + KV) * hd].view(N, KV, hd)
            else:  # q ‖ k are adjacent in qkv: one rotation for both heads' sets (half the small ops)
                qk = rotate(rope, qkv[:, : (H + KV) * hd].view(N, H + KV, hd), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            if m.q_temperature is not None:  # Ministral 3 past its original context
                q = q * m.q_temperature
            att = self._linear(self._attention(q, k, v, i, m).reshape(N, H * hd), i, "o", m)
            if a.parallel:  # Cohere, StableLM's parallel residual: the MLP reads the attention's input
                if mlp_in is not None:  # GPT-NeoX's: its own norm of the block's input
                    h = norm(x, mlp_in)
                if not a.family.sublayers_first:  # Phi's: (attention + MLP) + x, below
                    x = x + att
            elif attn_out is not None:  # Gemma 2/3, GLM-4, OLMo 2/3: the attention's output normed, then the
                x = x + norm(att, attn_out)  # MLP's input by its own norm or not
                h = x if mlp_in is None else norm(x, mlp_in)
            else:
                x = residual(a, x, att)
                h = norm(x, mlp_in)
            down = self._sparse(h, i, m) if a.family.moe else self._mlp(h, i, m)
            if mlp_out is not None:
                down = norm(down, mlp_out)
            if a.parallel and a.family.sublayers_first:
                down = att + down
            x = residual(a, x, down)
        return x

    def _mlp(self, h: torch.Tensor, layer: int, m: StepMeta, expert: int | str | None = None) -> torch.Tensor:
        """The gated MLP of groups gate_up, down (expert e's: gate_up.e, down.e; the shared expert's:
        gate_up.shared, down.shared) over rows h [n, dim]."""
        of = "" if expert is None else f".{expert}"
        gu = self._linear(h, layer, f"gate_up{of}", m)
        if self.args.family.ungated_mlp is not None:  # StarCoder2's, Nemotron's: up alone, down(act(up))
            return self._linear(gate_act(self.args, gu), layer, f"down{of}", m)
        f = gu.shape[1] // 2  # gate ‖ up
        return self._linear(gate_act(self.args, gu[:, :f]) * gu[:, f:], layer, f"down{of}", m)

    def _sparse(self, h: torch.Tensor, layer: int, m: StepMeta) -> torch.Tensor:
        """A sparse layer over h [N, dim]: each row's router logits (its variant's router), its
        experts and weights (`model.route`), then each chosen expert over its rows, ascending, each
        row's outputs summed weighted, as transformers sums them; plus, where the family has one
        (Qwen2-MoE), the shared expert over every row scaled by sigmoid(its gate). Which rows an
        expert takes is read on the host (one sync per layer): the projections' delta launches are
        planned per expert."""
        weights, experts = route(self.args, self._linear(h, layer, "router", m))
        host = experts.cpu()
        out = torch.zeros_like(h)
        for e in host.unique().tolist():
            rows, k = (host == e).nonzero(as_tuple=True)
            at = self._dev(rows)
            y = self._mlp(h[at], layer, self._rows_meta(m, rows), e)
            out.index_add_(0, at, (y * weights[at, self._dev(k), None]).to(out.dtype))
        if self.args.family.shared_expert:
            out = out + torch.sigmoid(self._linear(h, layer, "shared_gate", m)) * self._mlp(h, layer, m, "shared")
        return out

    def _final(self, x: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """The last layer's output [N, dim] -> fp32 logits of the step's logit rows (final norm, head)."""
        a = self.args
        if m.logit_rows.numel() == 0:
            return torch.empty(0, a.vocab_size, dtype=torch.float32, device=x.device)
        xl = x[m.logit_rows]
        sub = StepMeta(
            **{
                **m.__dict__,
                "norm_idx": m.logit_norm_idx,
                "single_norm": (m.logit_slots[0] + 1) if m.logit_norm_idx is None else 0,
            }
        )
        h = self._norm(xl, self.slots.final_norm, sub, a.norm_eps, self.slots.final_norm_bias)
        return final_logits(a, self._logits(h, m))

    # -- start-up -------------------------------------------------------------------------------
    def warm_sizes(self, max_rows: int) -> list[int]:
        """One row count per distinct compiled variant of the fused kernel, for 1..max_rows rows.

        Triton compiles one binary per constexpr set (blocks, SPLIT_K: chosen from M, N, K by
        `launch_blocks`) and per specialisation of integer arguments (M == 1, M % 16 == 0), so
        two row counts with the same key share a binary; from the device's `unpack_min_rows` on,
        the unpacked path's kernel instead (one key). The smallest of each key is returned.
        """
        try:
            from bitdelta_kernels.triton_linear import launch_blocks
        except ImportError:  # no Triton: nothing compiles
            return [1]
        unpack_from = config_for(self.device)["unpack_min_rows"]
        shapes = [tuple(w.shape) for w in self.base.layers[0].values()] + [tuple(self.base.head.shape)]
        seen: dict[tuple, int] = {}
        for M in range(1, max_rows + 1):
            if M >= unpack_from:
                seen.setdefault(("unpacked",), M)
                continue
            key = (M == 1, M % 16 == 0) + tuple(
                tuple(sorted(launch_blocks(M, n, k, self.dtype, self.device).items())) for n, k in shapes
            )
            seen.setdefault(key, M)
        return sorted(seen.values())

    @torch.inference_mode()
    def warmup(self, max_rows: int, max_seqs: int) -> list[tuple[int, str]]:
        """Launch every kernel binary a request can need once, so no request pays a JIT compile.

        The fused kernel (from `unpack_min_rows` on the unpacked path) at each of
        `warm_sizes(max_rows)` (decode-shaped, one token per sequence, up to max_seqs sequences;
        prefill-shaped beyond), also on the LM head's
        shape (a variant's sign planes on the base's head: `_sign_heads`); the batched delta as BGMV (few rows
        per variant) and SGMV (≥ sgmv_min_rows rows of one variant). Slot 0 is read with
        whatever it holds (α = 0 before any load); the KV blocks written are overwritten by
        their next owner before it reads them. Returns the (rows, path) pairs run.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        if self.slots.n_slots == 0:
            return []
        bs, nb = self.kv.block_size, self.kv.n_blocks
        done = []
        head, dim = self.base.head, self.base.head.shape[1]
        signs = torch.zeros(1, head.shape[0], (dim + 7) // 8, dtype=torch.uint8, device=self.device)
        alpha = torch.zeros(1, head.shape[0], dtype=torch.float32, device=self.device)
        signed = {0: SlotExtras(head=BigTensor(signs=signs, alpha=alpha))}  # a head of one zero plane
        unpack_from = config_for(self.device)["unpack_min_rows"]
        for M in self.warm_sizes(max_rows):
            path = "unpacked" if M >= unpack_from else "fused"
            if M <= max_seqs:  # M decodes of slot 0 in one step, all at position 0 of block 0
                self.forward([SeqWork([0], 0, 0, [0], True) for _ in range(M)])
                h = torch.zeros(M, dim, dtype=self.dtype, device=self.device)
                self._sign_heads(h, self._sign_head_rows({0: list(range(M))}, M, signed), signed)
                done.append((M, path + "/decode"))
            elif -(-M // bs) <= nb:  # one prefill chunk of M tokens
                self.forward([SeqWork([0] * M, 0, 0, list(range(-(-M // bs))), True)])
                done.append((M, path + "/prefill"))
        for rows, path in ((2, "bgmv"), (8, "sgmv")):  # mixed: half the rows base, half slot 0
            if rows <= max_seqs:
                self.forward([SeqWork([0], 0, -1 if r % 2 else 0, [0], True) for r in range(rows)])
                done.append((rows, "mixed/" + path))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return done


__all__ = ["ModelRunner", "BaseWeights", "KVPool", "SeqWork", "StepMeta"]
