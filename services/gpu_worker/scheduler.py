"""Continuous batching at iteration level: ids and budgets, never tensors.

Every step the scheduler picks, under a token budget per step (`max_batch_tokens`) and a cap on
running sequences (`max_running`):
1. one token for every running sequence that is decoding,
2. the next chunk of every running sequence still in prefill (chunked prefill),
3. new sequences from the waiting queue, best first: ordered by (priority, arrival), lower
   priority values first (vLLM's rule), FIFO within a priority. The head of the queue blocks the
   rest, so a long request is not starved by short ones of its priority.

KV on demand: an admitted sequence holds the blocks of the tokens it has (its prompt, or prompt and
output when it is recomputed), not of `max_new_tokens`; a decode takes one more block when it
crosses a block boundary. When the pool has no free block for it, the running sequence that comes
last by (priority, arrival) is preempted (possibly the one asking): its blocks are freed and it
goes back to the waiting queue with its arrival, to be recomputed (prompt + the tokens it already
produced, in prefill chunks; nothing is sampled again, so the tokens it streamed are not re-sent and
its sampler's state, a seeded generator included, carries on). A waiting sequence of a better
priority than a running one preempts it too, for blocks or for a place in the batch; within one
priority nothing is preempted for admission. The best running sequence can always preempt all the
others, and the worker refuses a request whose one choice would not fit the whole pool, so the
batch always makes progress.

A request with n > 1 choices is one sequence until its prompt is in the cache; then `fork` starts
the other choices on the same prompt blocks (refcounted: a block returns to the free list when its
last holder leaves). The prompt's last, partly filled block is not shared: each choice has its own
copy (the engine copies its rows), so no choice ever writes into a block another reads. Admission
takes those copies' blocks with the parent's; the rest each choice takes as it grows.
"""

from __future__ import annotations

import bisect
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

    seq_id: int  # also its arrival order (ids are handed out in order; a request's choices are consecutive)
    prompt: list[int]
    max_new: int
    slot: int  # −1: the base
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)
    forks: int = 0  # choices to fork from this one once its prompt is cached (Sampling.n - 1)
    reserved: list[int] = field(default_factory=list)  # the forks' copies of the partial prompt block
    priority: int = 0  # lower first (vLLM's rule)
    preemptions: int = 0  # times its blocks were taken back (it was recomputed after each)

    @property
    def key(self) -> tuple[int, int]:
        """Order of service: better priority first, then earlier arrival."""
        return (self.priority, self.seq_id)

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
        self.waiting: list[SeqState] = []  # sorted by SeqState.key
        self.running: list[SeqState] = []
        self.preemptions = 0  # sequences preempted so far (Status, metrics)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def fork_copies(self, prompt_len: int) -> int:
        """Blocks one fork needs when it starts: its copy of the prompt's partial last block."""
        return 1 if prompt_len % self.block_size else 0

    def blocks_needed(self, seq: SeqState) -> int:
        """The most blocks `seq` ever holds at once alone: its whole length, and its forks' copies.
        More than the pool can never run."""
        return self.blocks_for(seq.max_len) + seq.forks * self.fork_copies(len(seq.prompt))

    def fork(self, parent: SeqState, child: SeqState) -> tuple[int, int, int] | None:
        """Start `child` (a choice of `parent`, its prompt cached) on the parent's full prompt blocks
        and its own copy of the partial one. Returns (parent's block, child's block, rows) to copy:
        the prompt's partly filled last block (None: the prompt ends on a block boundary)."""
        full = len(parent.prompt) // self.block_size
        own = [parent.reserved.pop()] if self.fork_copies(len(parent.prompt)) else []
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
        bisect.insort(self.waiting, seq, key=lambda s: s.key)

    def remove(self, seq_id: int) -> SeqState | None:
        """Drop a sequence wherever it is and free its blocks."""
        for i, s in enumerate(self.running):
            if s.seq_id == seq_id:
                del self.running[i]
                self._release(s)
                return s
        for i, s in enumerate(self.waiting):
            if s.seq_id == seq_id:
                del self.waiting[i]
                return s
        return None

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def _release(self, s: SeqState) -> None:
        self.allocator.free(s.blocks + s.reserved)
        s.blocks, s.reserved = [], []

    def preempt(self, s: SeqState) -> None:
        """Take `s`'s blocks back and queue it again, to be recomputed (its output stays)."""
        self.running.remove(s)
        self._release(s)
        s.computed = 0
        s.preemptions += 1
        self.preemptions += 1
        self.add(s)

    def _grow(self, s: SeqState, n_tokens: int, scheduled: dict[int, Scheduled]) -> bool:
        """Blocks for `s`'s first `n_tokens` tokens, preempting the last running sequences by key
        that this step has not scheduled yet. False: `s` itself was the last, and is preempted."""
        need = self.blocks_for(n_tokens) - len(s.blocks)
        while need > self.allocator.n_free:
            victim = max((r for r in self.running if r.seq_id not in scheduled), key=lambda r: r.key)
            self.preempt(victim)
            if victim is s:
                return False
        if need > 0:
            s.blocks += self.allocator.allocate(need)
        return True

    def schedule(self) -> list[Scheduled]:
        budget = self.max_batch_tokens
        out: dict[int, Scheduled] = {}  # seq_id -> its part of this step, in scheduling order
        for s in sorted(self.running, key=lambda r: r.key):  # decodes first: one token each, latency-critical
            if s.pending == 1 and budget > 0 and s in self.running and self._grow(s, s.computed + 1, out):
                out[s.seq_id] = Scheduled(s, 1)
                budget -= 1
        for s in sorted(self.running, key=lambda r: r.key):  # then the next chunk of prefills (blocks held)
            if s.pending > 1 and budget > 0:
                n = min(s.pending, budget)
                out[s.seq_id] = Scheduled(s, n)
                budget -= n
        while self.waiting and budget > 0:
            s = self.waiting[0]
            need = self.blocks_for(len(s.tokens)) + s.forks * self.fork_copies(len(s.prompt))
            while self.occupied() + 1 + s.forks > self.max_running or need > self.allocator.n_free:
                worst = max(self.running, key=lambda r: r.key, default=None)
                if worst is None or worst.priority <= s.priority:
                    break  # within a priority, nothing is preempted for admission
                gone = out.pop(worst.seq_id, None)
                budget += gone.n_tokens if gone is not None else 0
                self.preempt(worst)
            if self.occupied() + 1 + s.forks > self.max_running or need > self.allocator.n_free:
                break  # waits; nothing behind it overtakes it
            del self.waiting[0]
            blocks = self.allocator.allocate(need)
            k = self.blocks_for(len(s.tokens))
            s.blocks, s.reserved = blocks[:k], blocks[k:]
            self.running.append(s)
            n = min(s.pending, budget)
            out[s.seq_id] = Scheduled(s, n)
            budget -= n
        return list(out.values())
