"""Tensor-parallel split rules: which part of every base and delta tensor rank r of N holds.

Megatron-style, the same split for the base and for every delta (as DeltaZip and vLLM's LoRA
layers do), so a rank's delta term always lines up with its slice of the base:

    column-parallel  q, k, v, gate, up (fused qkv / gate_up too): rank r holds its rows of W
                     [d_out, d_in] and the SAME rows of the packed signs [d_out, ceil(d_in/8)],
                     of α [d_out] (a per-matrix α [1] is replicated) and of the bias
    row-parallel     o, down: rank r holds its input columns of W and the same columns of the
                     packed signs, on whole-byte boundaries (every rank's first column is a
                     multiple of 8); α and the bias are replicated (the bias is added once, after
                     the all-reduce of the partial sums)
    vocab-parallel   the embedding and the LM head (a variant's dense or sign tables too): rank r
                     holds its rows of the vocabulary; α per row: the same rows
    replicated       every norm (q/k norms included)

Format v3 parts follow the same split (docs/tensor-parallel.md): plane p's signs and α like plane
1's; a per-column α [d_in] split with the input columns of a row-parallel matrix, whole on a
column-parallel one; the low-rank factors of y += (x·Vᵀ)·Uᵀ as the matrix's own rows and columns
go: U [d_out, r] by rows and V [r, d_in] whole on a column-parallel matrix (and on the embedding /
head: U by vocabulary rows), V by input columns and U whole on a row-parallel one, so that each
rank's (x_r·V_rᵀ)·Uᵀ is a partial sum the layer's one all-reduce completes.

Units, balanced over the ranks (rank r gets units [⌈r·U/N⌉, ⌈(r+1)·U/N⌉): rank 0 the most):
    attention  GQA groups (one KV head and its n_heads/n_kv_heads query heads) when
               n_kv_heads ≥ N; when N > n_kv_heads (N a multiple of it) each KV head is
               REPLICATED on N/n_kv_heads ranks, which split its query heads
    MLP        blocks of 8 intermediate columns (down's packed sign bytes)
    vocab      rows

The split needs no divisibility beyond that: SmolLM2-135M's 9 heads and 3 KV heads over 2 ranks
are 2 + 1 GQA groups. Pure integer arithmetic on a `ModelArgs`, shared by the worker (its slices of
the base and of each delta), the capacity planner (bytes per rank) and the tests.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from bitdelta.arch import SPARSE_GROUPS, ModelArgs
from bitdelta.rpc.wire.delta_store import slice_runs

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
HEAD_BIAS = "lm_head.bias"  # Phi's (Family.head_bias)
COLUMN_GROUPS = ("qkv", "gate_up")
ROW_GROUPS = ("o", "down")


def group_kind(group: str) -> str:
    """A projection group's kind: an expert's groups ("gate_up.3", "down.3"; the shared expert's
    "gate_up.shared", "down.shared") split like the dense MLP's (COLUMN_GROUPS, ROW_GROUPS); a sparse
    layer's SPARSE_GROUPS (the router [n_experts, dim], the shared expert's gate [1, dim]) are whole
    on every rank."""
    return group.split(".", 1)[0]


class Split(enum.Enum):
    """How one tensor is divided among the ranks."""

    COLUMN = "column"  # rows of d_out (column-parallel linear: its output features)
    ROW = "row"  # columns of d_in (row-parallel linear: its input features), whole sign bytes
    VOCAB = "vocab"  # rows of the vocabulary
    REPLICATED = "replicated"


class ShardError(ValueError):
    """This model cannot be split over this many ranks (the message says why)."""


@dataclass(frozen=True)
class TensorShard:
    """Rank r's part of one tensor: `rows` (runs of the first dim) and `cols` (one run of the
    second dim, in the tensor's own elements: bytes for packed signs). None: all of that dim.

    take(t) = t[rows concatenated][:, cols]"""

    split: Split
    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The slice's shape, for a tensor of shape `full`."""
        out = list(full)
        if self.rows is not None:
            out[0] = sum(b - a for a, b in self.rows)
        if self.cols is not None:
            out[1] = self.cols[1] - self.cols[0]
        return tuple(out)

    def take(self, t):
        """Rank r's slice of the full tensor `t` (a torch.Tensor; contiguous, a copy unless nothing is cut)."""
        import torch

        if self.rows is not None:
            parts = [t[a:b] for a, b in self.rows]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.cols is not None:
            t = t[:, self.cols[0] : self.cols[1]]
        return t.contiguous()

    def leading_bytes(self, runs: int, full: tuple[int, ...], itemsize: int) -> int:
        """Bytes of the slice's first `runs` row runs, where the rest begins in its row-major bytes."""
        row = itemsize
        for d in self.shape(full)[1:]:
            row *= d
        return sum(b - a for a, b in (self.rows or ())[:runs]) * row

    def byte_runs(self, full: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
        """(offset, length) runs of the full tensor's row-major bytes that make up the slice, in
        order (what the delta store streams for this rank)."""
        return slice_runs(full, itemsize, list(self.rows) if self.rows is not None else None, self.cols)


def _balanced(units: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's units of `units` split over `size` ranks, the larger parts first: rank 0 always holds
    the most of everything, so its byte accounting bounds every rank's."""
    return -(-rank * units // size), -(-(rank + 1) * units // size)


@dataclass(frozen=True)
class TPLayout:
    """The split of one model over `size` ranks, seen from rank `rank`."""

    args: ModelArgs
    size: int
    rank: int

    def __post_init__(self):
        a, n = self.args, self.size
        if n < 1 or not 0 <= self.rank < n:
            raise ShardError(f"rank {self.rank} of {n}: the tensor-parallel size must be ≥ 1 and 0 ≤ rank < size")
        kv, group = a.n_kv_heads, a.n_heads // a.n_kv_heads
        if n > kv:
            if n % kv:
                raise ShardError(
                    f"{n} ranks cannot share {kv} KV heads: with more ranks than KV heads the ranks must be "
                    f"a multiple of the KV heads (each KV head replicated on the same number of ranks)"
                )
            if group < n // kv:
                raise ShardError(f"{n} ranks: each of the {a.n_heads} query heads would be split; at most {a.n_heads}")
        if n > -(-a.intermediate_size // 8):
            raise ShardError(f"{n} ranks: the MLP's {a.intermediate_size} columns give fewer 8-column blocks")
        if a.shared_intermediate_size and n > -(-a.shared_intermediate_size // 8):
            raise ShardError(
                f"{n} ranks: the shared expert's {a.shared_intermediate_size} columns give fewer 8-column blocks"
            )
        if n > a.vocab_size:
            raise ShardError(f"{n} ranks for a vocabulary of {a.vocab_size}")
        for r in range(n):
            q0, _ = TPLayout._heads(a, n, r)
            if q0 * a.head_dim % 8:
                raise ShardError(
                    f"rank {r}'s first o_proj column {q0 * a.head_dim} is not on a whole sign byte "
                    f"(head_dim {a.head_dim}); use a size that splits at whole bytes"
                )

    # -- the units -------------------------------------------------------------------------------
    @staticmethod
    def _heads(a: ModelArgs, n: int, r: int) -> tuple[int, int]:
        kv, group = a.n_kv_heads, a.n_heads // a.n_kv_heads
        if n <= kv:
            g0, g1 = _balanced(kv, n, r)
            return g0 * group, g1 * group
        per = n // kv  # ranks per KV head
        h, sub = divmod(r, per)
        s0, s1 = _balanced(group, per, sub)
        return h * group + s0, h * group + s1

    def heads(self, rank: int | None = None) -> tuple[int, int]:
        """Query heads [q0, q1) of a rank (default: this one)."""
        return self._heads(self.args, self.size, self.rank if rank is None else rank)

    def kv_heads(self, rank: int | None = None) -> tuple[int, int]:
        """KV heads [k0, k1) of a rank: its groups' (n_kv_heads ≥ N), else the one it replicates."""
        a, r = self.args, self.rank if rank is None else rank
        q0, q1 = self.heads(r)
        group = a.n_heads // a.n_kv_heads
        return q0 // group, -(-q1 // group)

    def kv_owner(self) -> bool:
        """Whether this rank is the first of the ranks that hold its KV heads (with more ranks than KV heads,
        a KV head is replicated on several): the one whose k counts in a sum over every head."""
        mine = self.kv_heads()
        return next(r for r in range(self.size) if self.kv_heads(r) == mine) == self.rank

    def ffn(self, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
        """Intermediate columns [f0, f1) of a rank (8-column blocks, the last one cut at the size) of
        an MLP of `size` columns (default: intermediate_size, the MLP's or each expert's)."""
        f = self.args.intermediate_size if size is None else size
        b0, b1 = _balanced(-(-f // 8), self.size, self.rank if rank is None else rank)
        return 8 * b0, min(8 * b1, f)

    def _group_ffn(self, group: str) -> tuple[int, int, int]:
        """(columns of the MLP a gate_up/down group belongs to, this rank's [f0, f1) of them)."""
        f = self.args.shared_intermediate_size if group.endswith(".shared") else self.args.intermediate_size
        return (f, *self.ffn(size=f))

    def vocab(self, rank: int | None = None) -> tuple[int, int]:
        """Vocabulary rows [v0, v1) of a rank."""
        return _balanced(self.args.vocab_size, self.size, self.rank if rank is None else rank)

    @property
    def vocab_max(self) -> int:
        """The most vocabulary rows any rank holds (the head's gather pads to it)."""
        return max(b - a for a, b in (self.vocab(r) for r in range(self.size)))

    def local_args(self) -> ModelArgs:
        """The model as this rank computes it: its heads, KV heads, MLP columns and vocabulary rows
        (head_dim, dim and everything else unchanged). Its `matrices()`, `group_shapes()` and layout
        string describe exactly this rank's slices."""
        a = self.args
        q0, q1 = self.heads()
        k0, k1 = self.kv_heads()
        f0, f1 = self.ffn()
        s0, s1 = self.ffn(size=a.shared_intermediate_size)
        v0, v1 = self.vocab()
        return dataclasses.replace(
            a,
            n_heads=q1 - q0,
            n_kv_heads=k1 - k0,
            intermediate_size=f1 - f0,
            shared_intermediate_size=s1 - s0,
            vocab_size=v1 - v0,
            head_dim=a.head_dim,
        )

    # -- per group / tensor ------------------------------------------------------------------------
    def group_rows(self, group: str) -> tuple[tuple[int, int], ...]:
        """Rank's rows of a column-parallel group's d_out (q ‖ k ‖ v, gate ‖ up)."""
        a, hd = self.args, self.args.head_dim
        if group == "qkv":
            q, kv = a.n_heads * hd, a.n_kv_heads * hd
            q0, q1 = self.heads()
            k0, k1 = self.kv_heads()
            return ((q0 * hd, q1 * hd), (q + k0 * hd, q + k1 * hd), (q + kv + k0 * hd, q + kv + k1 * hd))
        if group_kind(group) == "gate_up":
            f, f0, f1 = self._group_ffn(group)
            if self.args.family.ungated_mlp is not None:  # StarCoder2: up alone
                return ((f0, f1),)
            return ((f0, f1), (f + f0, f + f1))
        raise ValueError(f"{group} is not a column-parallel group")

    def group_cols(self, group: str) -> tuple[int, int]:
        """Rank's input columns [c0, c1) of a row-parallel group (o, down), in elements of W."""
        if group == "o":
            q0, q1 = self.heads()
            return q0 * self.args.head_dim, q1 * self.args.head_dim
        if group_kind(group) == "down":
            return self._group_ffn(group)[1:]
        raise ValueError(f"{group} is not a row-parallel group")

    def _matrices(self) -> dict[str, tuple[str, int, int]]:
        """matrix module path -> (group, first row in its group, d_out)."""
        out, rows = {}, {}
        for m in self.args.matrices():
            r0 = rows.get(m.group, 0)
            out[m.name] = (m.group, r0, m.d_out)
            rows[m.group] = r0 + m.d_out
        return out

    def matrix_rows(self, group: str, r0: int, d_out: int) -> tuple[tuple[int, int], ...]:
        """Rank's rows of one matrix that sits at rows [r0, r0 + d_out) of its column-parallel group."""
        out = []
        for a, b in self.group_rows(group):
            lo, hi = max(a, r0), min(b, r0 + d_out)
            if hi > lo:
                out.append((lo - r0, hi - r0))
        return tuple(out) or ((0, 0),)

    def shard_of(self, param: str, role: str, shape: tuple[int, ...], axis: str = "row") -> TensorShard:
        """Rank's part of one tensor of a base or a delta: `param` a full parameter name
        ("model.layers.3.self_attn.o_proj.weight", "...bias"), `role` "weight" for the base or a
        delta file's role ("sign", "alpha", "dense"; format v3's "sign2", "alpha3", "lowrank_u",
        "lowrank_v"), `shape` the tensor's full shape, `axis` an α's axis ("row", "matrix" or "col":
        the header's parts; a column α of a square matrix has a row α's shape)."""
        kind = role.rstrip("0123456789")  # plane p's "signP" / "alphaP" split like plane 1's
        col_alpha = kind == "alpha" and axis == "col"
        if param == HEAD_BIAS:  # Phi's: the head's rows
            return TensorShard(Split.VOCAB, rows=(self.vocab(),))
        if param in (EMBED, HEAD):
            if (kind == "alpha" and tuple(shape) == (1,)) or kind == "lowrank_v":
                return TensorShard(Split.REPLICATED)  # per-matrix α; V [r, dim] (dim is not split)
            return TensorShard(Split.VOCAB, rows=(self.vocab(),))
        if not param.startswith("model.layers."):
            return TensorShard(Split.REPLICATED)  # the final norm
        module = param.split(".", 3)[3].rsplit(".", 1)[0]  # "self_attn.o_proj"
        mats = self._matrices()
        a = self.args
        if (a.qk_heads or a.family.qk_whole) and module in a.family.qk_norm_names:
            # Command R+'s [heads, hd] (each head its own weights), OLMo 2's [heads · hd]: this rank's heads
            h0, h1 = self.heads() if module == a.family.qk_norm_names[0] else self.kv_heads()
            unit = 1 if a.qk_heads else a.head_dim
            return TensorShard(Split.COLUMN, rows=((h0 * unit, h1 * unit),))
        if module not in mats:
            return TensorShard(Split.REPLICATED)  # a norm (the q/k norms of one head's weights included)
        group, r0, d_out = mats[module]
        if group in SPARSE_GROUPS:  # every rank routes every token: the router's tensors whole on each
            return TensorShard(Split.REPLICATED)
        is_bias = param.endswith(".bias")
        if group_kind(group) in ROW_GROUPS:
            c0, c1 = self.group_cols(group)
            if col_alpha:  # [d_in]: this rank's input columns
                return TensorShard(Split.ROW, rows=((c0, c1),))
            if is_bias or kind in ("alpha", "lowrank_u"):  # U [d_out, r]: whole, like α
                return TensorShard(Split.REPLICATED)
            if kind == "sign":  # packed: 8 columns a byte; c0 is a multiple of 8 (checked above)
                return TensorShard(Split.ROW, cols=(c0 // 8, -(-c1 // 8)))
            return TensorShard(Split.ROW, cols=(c0, c1))  # W, and V [r, d_in]
        if (kind == "alpha" and tuple(shape) == (1,)) or col_alpha or kind == "lowrank_v":
            return TensorShard(Split.REPLICATED)  # per-matrix α; α or V over d_in, which is whole
        return TensorShard(Split.COLUMN, rows=self.matrix_rows(group, r0, d_out))

    def owner(self, param: str, role: str, shape: tuple[int, ...], axis: str = "row") -> int:
        """The rank that fetches this rank's part of a delta tensor from the store: the lowest rank
        holding the same part (a replicated tensor: rank 0; a KV head several ranks share: the first
        of them). It hands the part to the others (`shared_from`), so each byte leaves the store once."""
        mine = self.shard_of(param, role, shape, axis)
        return next(
            r for r in range(self.size) if dataclasses.replace(self, rank=r).shard_of(param, role, shape, axis) == mine
        )

    def shared_from(self, param: str, role: str, shape: tuple[int, ...], axis: str = "row") -> tuple[int, int] | None:
        """(owner, j) when a lower rank holds this rank's row runs `rows[j:]` of a delta tensor at the
        same place in its own part: this rank fetches only `rows[:j]` from the store and receives the
        rest from `owner`, the lowest such rank, so each byte leaves the store once. j = 0: the whole
        part (`owner`: a replicated tensor, a KV head's k_proj several ranks share); j ≥ 1: a fused
        qkv_proj's k and v rows of a KV head several ranks share, after this rank's own query rows.
        None: this rank fetches all of its part."""
        owner = self.owner(param, role, shape, axis)
        if owner != self.rank:
            return owner, 0
        mine = self.shard_of(param, role, shape, axis)
        if mine.split is not Split.COLUMN or mine.rows is None:
            return None
        n = len(mine.rows)
        for j in range(1, n):
            for r in range(self.rank):
                other = dataclasses.replace(self, rank=r).shard_of(param, role, shape, axis).rows
                if other is not None and len(other) == n and other[j:] == mine.rows[j:]:
                    return r, j
        return None

    def shared_to(self, param: str, role: str, shape: tuple[int, ...], axis: str = "row") -> list[tuple[int, int]]:
        """(rank, j) of every other rank whose `shared_from` is this one: this rank hands it its
        part's row runs from j on."""
        out = []
        for r in range(self.size):
            if r != self.rank:
                got = dataclasses.replace(self, rank=r).shared_from(param, role, shape, axis)
                if got is not None and got[0] == self.rank:
                    out.append((r, got[1]))
        return out

    def group_shard(self, group: str) -> TensorShard:
        """Rank's part of a projection group's concatenated base weight [d_out_g, d_in_g] (and of
        its bias [d_out_g] when column-parallel)."""
        if group in SPARSE_GROUPS:
            return TensorShard(Split.REPLICATED)
        if group_kind(group) in ROW_GROUPS:
            return TensorShard(Split.ROW, cols=self.group_cols(group))
        return TensorShard(Split.COLUMN, rows=self.group_rows(group))


__all__ = ["TPLayout", "TensorShard", "Split", "ShardError", "COLUMN_GROUPS", "ROW_GROUPS", "group_kind"]
