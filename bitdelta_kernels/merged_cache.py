"""A byte-budgeted cache of merged weights W_eff = W_base + α·S for hot (variant, layer) keys.

When it pays (measured, docs/kernels.md): on CPU at decode it does not, since the
one-pass C GEMV reads W_base and the bits as fast as a dense GEMV reads W_eff; it
does for repeated prefill of a hot variant, where it saves the merge pass in front
of each GEMM, at the price of a full dense copy of each cached matrix.
The cache holds tensors only; which variants are hot is the caller's call. Nothing serves
through it yet: bench/kernels.py measures it (and the tests check it) for the worker's CPU path
(docs/worker.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch

from bitdelta_kernels import cpu_ops
from bitdelta_kernels.bits import unpack_signs


def merge_weights(w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """W_base + α ⊙ S in w_base's dtype (summed in fp32, rounded once).

    w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1] -> [d_out, d_in].
    """
    d_in = w_base.shape[1]
    if w_base.device.type == "cpu" and w_base.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return cpu_ops.merge_cpu(w_base, signs, alpha, d_in, dtype=w_base.dtype)
    s = unpack_signs(signs, d_in, torch.float32)
    return (w_base.float() + s * alpha.float().reshape(-1, 1)).to(w_base.dtype)


class MergedWeightCache:
    """LRU of merged matrices under `budget_bytes`; pinned keys are never evicted.

    get(key, w_base, signs, alpha) -> W_eff [d_out, d_in] (merged on a miss);
    linear(key, x, ...) -> x · W_effᵀ. Keys name a (variant, layer), e.g. ("coder", "layers.3.mlp.up").
    A matrix larger than the budget is merged for the call and not kept.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._pinned: set[Hashable] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        with self._lock:
            w = self._entries.get(key)
            if w is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return w
            self.misses += 1
        w = merge_weights(w_base, signs, alpha)  # outside the lock: merging takes milliseconds
        nbytes = w.numel() * w.element_size()
        with self._lock:
            if key in self._entries or not self._make_room(nbytes):
                return w
            self._entries[key] = w
            self.bytes_used += nbytes
        return w

    def linear(
        self, key: Hashable, x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """x: [..., d_in] -> x · W_effᵀ: [..., d_out] in x.dtype."""
        w = self.get(key, w_base, signs, alpha)
        return (x.to(w.dtype) @ w.t()).to(x.dtype)

    def pin(self, key: Hashable) -> None:
        with self._lock:
            self._pinned.add(key)

    def evict(self, key: Hashable) -> bool:
        with self._lock:
            w = self._entries.pop(key, None)
            if w is None:
                return False
            self.bytes_used -= w.numel() * w.element_size()
            self._pinned.discard(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pinned.clear()
            self.bytes_used = 0

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned entries, least recently used first, until nbytes fit. Lock held."""
        if nbytes > self.budget_bytes:
            return False
        for k in list(self._entries):
            if self.bytes_used + nbytes <= self.budget_bytes:
                break
            if k in self._pinned:
                continue
            w = self._entries.pop(k)
            self.bytes_used -= w.numel() * w.element_size()
        return self.bytes_used + nbytes <= self.budget_bytes
