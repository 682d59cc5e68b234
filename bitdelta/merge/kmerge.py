"""K-Merge (arXiv:2510.13537): keep at most K LoRA adapters on a device as adapters arrive.

The paper's policy (the defaults):
  * similarity(new, slot) = mean over modules of cos(flatten(ΔBA_new), flatten(ΔBA_slot))
  * a new adapter opens a slot while fewer than K are used (K-Merge); with a
    `threshold` (K-Merge++) only if its similarity to every slot is below it
  * otherwise it is merged into the most similar slot by a running mean over
    the n tasks in the slot: Δ ← (n−1)/n · Δ_slot + 1/n · Δ_new, re-factorised
    to the slot's rank by a truncated SVD (exact when the rank suffices)
  * a task → slot map picks the adapter at inference

The brief's extension, each an option:
  * `budget_bytes`: the stored factors never exceed B bytes (instead of, or
    with, the count K)
  * `merge="opcm"`: OPCM as the merge operator (orthogonal projection, λ
    rescaling so the slot's ‖τ‖ is the mean of its tasks' ‖τ_i‖)
  * `gate`: keep a merge only if every task in the merged slot keeps at least
    `gate` × its own adapter's metric on the provided evaluation data; a
    refused merge tries the next most similar slot, then a free slot, else
    the adapter is rejected and its task falls back to the base model.

The pool handles ids, bytes and factors; evaluation is a callable it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bitdelta.merge.adapter import LoraAdapter, LoraModule, dense_to_lora, lowrank_sum, similarity
from bitdelta.merge.opcm import DEFAULT_ALPHA, check_norm, project

# evaluate(adapter or None for the base, task) -> metric, higher is better
Evaluate = Callable[[LoraAdapter | None, str], float]


@dataclass
class Slot:
    adapter: LoraAdapter
    tasks: list[str]
    # OPCM state: λ of the last merge and ‖τ_i‖ of every task merged in.
    lam: float = 1.0
    norms: list[float] = field(default_factory=list)


@dataclass
class Decision:
    """What the pool did with one arriving adapter."""

    task: str
    action: str  # "new" | "merge" | "reject"
    slot: int | None
    similarities: list[float]
    reason: str
    gate: dict[str, float] = field(default_factory=dict)  # task -> merged metric / own metric, when gated


class AdapterPool:
    def __init__(
        self,
        k: int | None = 5,
        budget_bytes: int | None = None,
        threshold: float | None = None,
        merge: str = "mean",
        merge_rank: int | None = None,
        opcm_alpha: float = DEFAULT_ALPHA,
        gate: float | None = None,
        evaluate: Evaluate | None = None,
    ):
        if k is None and budget_bytes is None:
            raise ValueError("give a slot count k, a byte budget, or both")
        if k is not None and k < 1:
            raise ValueError("k must be ≥ 1")
        if merge not in ("mean", "opcm"):
            raise ValueError(f"unknown merge {merge!r}: use 'mean' or 'opcm'")
        if gate is not None and evaluate is None:
            raise ValueError("a quality gate needs evaluation data: pass evaluate=")
        self.k, self.budget, self.threshold = k, budget_bytes, threshold
        self.merge, self.merge_rank, self.opcm_alpha = merge, merge_rank, opcm_alpha
        self.gate, self.evaluate = gate, evaluate
        self.slots: list[Slot] = []
        self.task_slot: dict[str, int | None] = {}
        self.own_metric: dict[str, float] = {}
        self.log: list[Decision] = []

    # ------------------------------------------------------------------ queries
    @property
    def nbytes(self) -> int:
        return sum(s.adapter.nbytes for s in self.slots)

    def adapter_for(self, task: str) -> LoraAdapter | None:
        """The adapter that serves `task` (None: the base model)."""
        if task not in self.task_slot:
            raise KeyError(f"task {task!r} never arrived")
        i = self.task_slot[task]
        return None if i is None else self.slots[i].adapter

    def _room_for(self, nbytes: int) -> bool:
        return (self.k is None or len(self.slots) < self.k) and (
            self.budget is None or self.nbytes + nbytes <= self.budget
        )

    # ------------------------------------------------------------------ policy
    def add(self, task: str, adapter: LoraAdapter) -> Decision:
        if task in self.task_slot:
            raise ValueError(f"task {task!r} is already in the pool")
        if self.gate is not None:
            self.own_metric[task] = self.evaluate(adapter, task)
        sims = [similarity(adapter, s.adapter) for s in self.slots]
        fits_alone = self.budget is None or adapter.nbytes <= self.budget
        room = fits_alone and self._room_for(adapter.nbytes)
        if room and (self.threshold is None or not sims or max(sims) < self.threshold):
            why = (
                "free slot"
                if self.threshold is None or not sims
                else f"free slot, max similarity {max(sims):.4f} < threshold {self.threshold}"
            )
            return self._record(self._open(task, adapter, sims, why))

        refused: dict[int, dict] = {}
        for i in sorted(range(len(self.slots)), key=lambda j: -sims[j]):
            merged_slot = self._merged(self.slots[i], task, adapter)
            if (
                self.budget is not None
                and self.nbytes - self.slots[i].adapter.nbytes + merged_slot.adapter.nbytes > self.budget
            ):
                refused[i] = {"bytes": merged_slot.adapter.nbytes}
                continue
            if self.gate is not None:
                ratios = {t: self.evaluate(merged_slot.adapter, t) / self.own_metric[t] for t in merged_slot.tasks}
                if min(ratios.values()) < self.gate:
                    refused[i] = ratios
                    continue
            else:
                ratios = {}
            self.slots[i] = merged_slot
            self.task_slot[task] = i
            why = (
                f"most similar slot ({sims[i]:.4f})"
                if not refused
                else f"slot {i} ({sims[i]:.4f}) after slots {sorted(refused)} were refused"
            )
            return self._record(Decision(task, "merge", i, sims, why, ratios))
        if room:  # only reachable with a gate or byte refusals under K-Merge++
            return self._record(self._open(task, adapter, sims, f"merges refused ({refused}); free slot"))
        self.task_slot[task] = None
        why = (
            "larger than the whole budget" if not fits_alone else f"no slot accepts it ({refused}); served by the base"
        )
        return self._record(Decision(task, "reject", None, sims, why))

    def _open(self, task: str, adapter: LoraAdapter, sims: list[float], why: str) -> Decision:
        self.slots.append(Slot(adapter, [task], 1.0, [adapter.norm()]))
        self.task_slot[task] = len(self.slots) - 1
        return Decision(task, "new", len(self.slots) - 1, sims, why)

    def _record(self, d: Decision) -> Decision:
        # The pool's two promises, checked after every arrival.
        if self.k is not None and len(self.slots) > self.k:
            raise AssertionError(f"pool holds {len(self.slots)} slots > K = {self.k}")
        if self.budget is not None and self.nbytes > self.budget:
            raise AssertionError(f"pool holds {self.nbytes} bytes > budget {self.budget}")
        self.log.append(d)
        return d

    # ------------------------------------------------------------------ merge operators
    def _merged(self, slot: Slot, task: str, new: LoraAdapter) -> Slot:
        if self.merge == "mean":
            return self._mean(slot, task, new)
        return self._opcm(slot, task, new)

    def _rank(self, old: LoraModule | None, new: LoraModule | None) -> int:
        if self.merge_rank is not None:
            return self.merge_rank
        return old.rank if old is not None else new.rank

    def _mean(self, slot: Slot, task: str, new: LoraAdapter) -> Slot:
        n = len(slot.tasks) + 1
        w_old, w_new = (n - 1) / n, 1 / n
        mods = {}
        for name in sorted(set(slot.adapter.modules) | set(new.modules)):
            a, b = slot.adapter.modules.get(name), new.modules.get(name)
            terms = [(w, m) for w, m in ((w_old, a), (w_new, b)) if m is not None]
            mods[name] = _like(lowrank_sum(terms, self._rank(a, b)), a or b)
        merged = LoraAdapter(mods, "+".join(slot.tasks + [task]))
        return Slot(merged, slot.tasks + [task], 1.0, slot.norms + [new.norm()])

    def _opcm(self, slot: Slot, task: str, new: LoraAdapter) -> Slot:
        """OPCM step on the dense Δ per module, re-factorised to the slot's rank
        BEFORE the λ rescaling, so the stored adapter meets the norm invariant."""
        combined = {}
        for name in sorted(set(slot.adapter.modules) | set(new.modules)):
            a, b = slot.adapter.modules.get(name), new.modules.get(name)
            t_merged = a.delta() if a is not None else torch.zeros(b.shape)
            t_new = b.delta() if b is not None else torch.zeros(a.shape)
            dense = slot.lam * t_merged + project(t_merged, t_new, self.opcm_alpha)
            combined[name] = _like(dense_to_lora(dense, self._rank(a, b)), a or b)
        norms = slot.norms + [new.norm()]
        target = sum(norms) / len(norms)
        got = LoraAdapter(combined).norm()
        lam_t = got / target if got > 0 else 1.0
        for m in combined.values():
            m.B = (m.B.float() / lam_t).to(m.B.dtype)
        merged = LoraAdapter(combined, "+".join(slot.tasks + [task]))
        check_norm(merged.norm(), target)
        return Slot(merged, slot.tasks + [task], lam_t, norms)


def _like(m: LoraModule, ref: LoraModule) -> LoraModule:
    """Store merged factors in the dtype of the adapters they came from (fp32 math)."""
    return LoraModule(m.A.to(ref.A.dtype), m.B.to(ref.B.dtype), m.scale)


def stream(pool: AdapterPool, adapters: list[tuple[str, LoraAdapter]]) -> list[Decision]:
    """Feed adapters in order; returns the decisions."""
    return [pool.add(task, a) for task, a in adapters]


def scores(pool: AdapterPool, own: dict[str, LoraAdapter], evaluate: Evaluate) -> dict[str, dict[str, float]]:
    """The paper's score per task: metric(pool's adapter) / metric(own adapter); plus the base's ratio."""
    out = {}
    for task, adapter in own.items():
        m_own = evaluate(adapter, task)
        m_pool = evaluate(pool.adapter_for(task), task)
        m_base = evaluate(None, task)
        out[task] = {
            "own": m_own,
            "pool": m_pool,
            "base": m_base,
            "score": m_pool / m_own,
            "base_score": m_base / m_own,
            "slot": pool.task_slot[task],
        }
    return out


def mean_score(per_task: dict[str, dict[str, float]]) -> float:
    return sum(v["score"] for v in per_task.values()) / max(1, len(per_task))


__all__ = ["AdapterPool", "Slot", "Decision", "stream", "scores", "mean_score"]
