"""What an idle worker may hold resident (issue #23), part by part, computed as the worker sizes
its tensors (worker.py):

    account = weights + KV pool + slot rows + the runtime's fixed cost

- weights: the base's parameters at the serving dtype (a tied head is the embedding, counted once);
- KV pool: the blocks `--kv-cache` buys (k and v, allocated and zeroed at start);
- slot rows: every slot's α, norm and bias rows under the delta budget, resident from start
  (zeroed); a slot's sign planes are allocated empty and become resident only as a delta is
  written into them, so an idle worker holds none (docs/worker.md, "Memory");
- the runtime's fixed cost (python, torch, gRPC and its threads, the kernels, the tokenizer),
  measured: `with_fixed` takes the idle RSS of the same worker serving a model of the same
  tokenizer with one layer of width 8 (`bitdelta.testing.memory.empty_base`).

`bench/peer_cpu.py` prints measured ÷ account; `tests/gpu_worker/test_worker_memory.py` fails when
an idle worker's RSS exceeds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from bitdelta.checkpoint import CheckpointReader, read_config
from bitdelta.model import ModelArgs
from bitdelta.shard import HEAD
from bitdelta_kernels.bits import packed_cols
from services.gpu_worker.runner import KVPool
from services.gpu_worker.slots import SlotLayout


@dataclass(frozen=True)
class Account:
    """What an idle worker may hold resident, in bytes."""

    weights: int
    kv: int
    slot_rows: int
    fixed: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.slot_rows + self.fixed


def account(base: Path, dtype: torch.dtype, kv_cache: int, delta_budget: int = 1 << 30, max_slots: int = 0) -> Account:
    """The weights, KV pool and slot rows of a worker on `base` (fixed cost 0: see `with_fixed`)."""
    args = ModelArgs.from_hf(read_config(base))
    with CheckpointReader(base) as r:
        n = sum(r.shape(k)[0] * (r.shape(k)[1] if len(r.shape(k)) > 1 else 1) for k in r.keys())
        if args.tie_embeddings and HEAD in r:
            n -= args.vocab_size * args.dim
    layout = SlotLayout(args, dtype)
    signs = args.n_layers * sum(d_out * packed_cols(d_in) for d_out, d_in in layout.group_shape.values())
    alpha = args.n_layers * sum(d_out * 4 for d_out, _ in layout.group_shape.values())
    n_slots = max_slots or delta_budget // layout.slot_bytes
    per_token = KVPool.bytes_per_token(args, dtype)
    kv = kv_cache // per_token // 16 * 16 * per_token
    # each slot's α, norm and bias rows, and the norm and bias stacks' row 0 (the base's)
    rows = n_slots * (layout.slot_bytes - signs) + layout.slot_bytes - signs - alpha
    return Account(n * dtype.itemsize, kv, rows)


def with_fixed(acc: Account, empty_rss: int, empty: Account) -> Account:
    """`acc` with the runtime's fixed cost: `empty_rss`, the idle RSS of the worker serving the
    empty model, less that model's own account `empty`."""
    return dataclasses.replace(acc, fixed=empty_rss - empty.total)
