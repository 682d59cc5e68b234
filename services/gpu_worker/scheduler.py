"""Continuous batching at iteration level: ids and budgets, never tensors.

Every step the scheduler picks, under a token budget per step
(`max_batch_tokens`) and a cap on running sequences (`max_running`):
1. one token for every running sequence that is decoding,
2. the next chunk of every running sequence still in prefill (chunked prefill),
3. new sequences from the FIFO waiting queue, as long as the KV pool has the
   blocks for their whole length (prompt + max_new_tokens).

Reserving a sequence's whole length at admission means a running sequence
never runs out of KV cache, so nothing is ever preempted or dropped; a
sequence that does not fit waits (the head of the queue blocks the rest, so a
long request is not starved by short ones). Finished, cancelled and expired
sequences return their blocks at once.

A request with n > 1 choices is one sequence until its prompt is in the cache; then `fork` starts
the other choices on the same prompt blocks (refcounted: a block returns to the free list when its
last holder leaves). The prompt's last, partly filled block is not shared: each choice has its own
copy (the engine copies its rows), so no choice ever writes into a block another reads. Admission
reserves the forks' blocks (their copy of that block and their outputs') with the parent's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class BlockAllocator:
    """Free list of KV blocks (ids), each with a count of the sequences holding it."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))
        self._refs = [0] * n_blocks

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (a forked sequence)."""
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer of each; a block nobody holds returns to the free list."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass
class SeqState:
    """A sequence as the scheduler sees it."""

    seq_id: int
    prompt: list[int]
    max_new: int
    slot: int  # −1: the base
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)
    forks: int = 0  # choices to fork from this one once its prompt is cached (Sampling.n - 1)
    reserved: list[int] = field(default_factory=list)  # the forks' own blocks, taken at admission

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens to feed before the next sample."""
        return len(self.prompt) + len(self.output) - self.computed

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new


@dataclass
class Scheduled:
    seq: SeqState
    n_tokens: int
    samples: bool = False  # after this step all its tokens are cached: sample the next one

    def __post_init__(self):
        self.samples = self.n_tokens == self.seq.pending


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int, max_batch_tokens: int):
        self.allocator, self.block_size = allocator, block_size
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def fork_blocks(self, prompt_len: int, max_len: int) -> int:
        """Blocks one fork holds alone: all but the prompt's full blocks (shared)."""
        return self.blocks_for(max_len) - prompt_len // self.block_size

    def blocks_needed(self, seq: SeqState) -> int:
        return self.blocks_for(seq.max_len) + seq.forks * self.fork_blocks(len(seq.prompt), seq.max_len)

    def fork(self, parent: SeqState, child: SeqState) -> tuple[int, int, int] | None:
        """Start `child` (a choice of `parent`, its prompt cached) on the parent's full prompt blocks
        and its own reserved ones. Returns (parent's block, child's block, rows) to copy: the prompt's
        partly filled last block (None: the prompt ends on a block boundary)."""
        full = len(parent.prompt) // self.block_size
        k = self.fork_blocks(len(parent.prompt), parent.max_len)
        own, parent.reserved = parent.reserved[:k], parent.reserved[k:]  # the rest: the next forks'
        self.allocator.share(parent.blocks[:full])
        child.blocks = parent.blocks[:full] + own
        child.computed = len(parent.prompt)
        self.running.append(child)
        rows = len(parent.prompt) % self.block_size
        return (parent.blocks[full], own[0], rows) if rows else None

    def capacity_tokens(self) -> int:
        return self.allocator.n_blocks * self.block_size

    def used_tokens(self) -> int:
        return (self.allocator.n_blocks - self.allocator.n_free) * self.block_size

    def occupied(self) -> int:
        """Running sequences, with the forks the running ones will start."""
        return len(self.running) + sum(s.forks for s in self.running)

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def remove(self, seq_id: int) -> SeqState | None:
        """Drop a sequence wherever it is and free its blocks."""
        for i, s in enumerate(self.running):
            if s.seq_id == seq_id:
                del self.running[i]
                self.allocator.free(s.blocks + s.reserved)
                s.blocks, s.reserved = [], []
                return s
        for s in self.waiting:
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                return s
        return None

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_batch_tokens
        out: list[Scheduled] = []
        for s in self.running:  # decodes first: one token each, latency-critical
            if s.pending == 1 and budget > 0:
                out.append(Scheduled(s, 1))
                budget -= 1
        for s in self.running:  # then the next chunk of prefills in progress
            if s.pending > 1 and budget > 0:
                n = min(s.pending, budget)
                out.append(Scheduled(s, n))
                budget -= n
        while self.waiting and self.occupied() + 1 + self.waiting[0].forks <= self.max_running and budget > 0:
            s = self.waiting[0]
            blocks = self.allocator.allocate(self.blocks_needed(s))
            if blocks is None:
                break  # waits for KV space; FIFO, so nothing overtakes it
            self.waiting.popleft()
            k = self.blocks_for(s.max_len)
            s.blocks, s.reserved = blocks[:k], blocks[k:]
            self.running.append(s)
            n = min(s.pending, budget)
            out.append(Scheduled(s, n))
            budget -= n
        return out
