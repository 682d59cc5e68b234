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

Prefix caching (`prefix_caching`): a block whose tokens are all computed enters the cache under a
hash chain of its tokens and every token before it, rooted in the identity of the weights that
computed its K/V (`cache_root`: the base's fingerprint, a variant's delta content, the request's
cache salt), so a variant never reads the base's blocks nor a re-uploaded variant its old ones. An
admitted sequence shares the cached blocks of its longest cached prefix (refcounted, read only: it
writes only past them) and computes from there; its last token is always computed (its logits are
needed). A cached block nobody holds stays free in LRU order until an allocation needs it.

A request with n > 1 choices is one sequence until its prompt is in the cache; then `fork` starts
the other choices on the same prompt blocks (refcounted: a block returns to the free list when its
last holder leaves). The prompt's last, partly filled block is not shared: each choice has its own
copy (the engine copies its rows), so no choice ever writes into a block another reads. Admission
takes those copies' blocks with the parent's; the rest each choice takes as it grows.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


class BlockAllocator:
    """KV blocks (ids), each with a count of the sequences holding it, and the prefix cache.

    A full block whose K/V is computed can be registered under the hash of its contents
    (`block_hashes`); a registered block nobody holds is free but keeps its contents, in LRU order
    (least recently released first), until an allocation needs it: blocks that never held cached
    contents go first. `lookup` finds the longest run of registered blocks for a chain of hashes;
    `share` takes them (one more holder each).
    """

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # holding nothing worth keeping
        self._refs = [0] * n_blocks
        self._hash: list[bytes | None] = [None] * n_blocks
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # free, registered blocks, oldest release first

    @property
    def n_free(self) -> int:
        """Blocks an allocation can take (cached ones nobody holds included)."""
        return len(self._free) + len(self._lru)

    @property
    def n_cached(self) -> int:
        return len(self._by_hash)

    def free_besides(self, blocks: list[int]) -> int:
        """`n_free` once `blocks` (cached ones about to be shared) are taken."""
        return self.n_free - sum(1 for b in blocks if self._refs[b] == 0)

    def allocate(self, n: int) -> list[int] | None:
        if n > self.n_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently released cached block loses its contents
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (a forked sequence, a prefix-cache hit)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer of each; a block nobody holds is free (keeping its cached contents)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    def register(self, block: int, h: bytes) -> None:
        """`block` (held, full, computed) holds the contents hashed `h`. Contents another block
        already holds (two sequences prefilled the same prefix at once) stay that block's."""
        if self._hash[block] is None and h not in self._by_hash:
            self._hash[block] = h
            self._by_hash[h] = block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes`."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out


def cache_root(weights: str, salt: str = "") -> bytes:
    """The start of a sequence's block-hash chain: the identity of the weights that compute its
    K/V (the base's fingerprint, and the variant's delta content) and the request's cache salt."""
    return hashlib.blake2b(f"kv\0{weights}\0{salt}".encode(), digest_size=16).digest()


def block_hashes(root: bytes, tokens: list[int], block_size: int, have: list[bytes], n_full: int) -> list[bytes]:
    """`have` (the chain's first hashes) extended to `n_full` blocks of `tokens`: each block's hash
    covers the one before it, so equal hashes mean equal weights and equal tokens up to there."""
    out = list(have)
    prev = out[-1] if out else root
    for i in range(len(out), n_full):
        chunk = array("I", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


@dataclass(eq=False)  # a sequence is itself: `in` / `remove` over the running list compare identities
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
    cache_root: bytes | None = None  # its blocks' hash chain starts here (cache_root()); None: not cached
    reuse: bool = True  # may start from cached blocks (not when each prompt row's logits are wanted)
    hashes: list[bytes] = field(default_factory=list)  # of its first full blocks (cache_root's chain)
    registered: int = 0  # its first blocks that are in the prefix cache (or were found there)

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
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_running: int,
        max_batch_tokens: int,
        prefix_caching: bool = False,
        cache_generated: bool = True,
    ):
        """cache_generated: blocks that hold generated tokens enter the prefix cache too (a later
        prompt that repeats a conversation reuses them); off, only the prompt's blocks do (a
        batch-invariant worker: a generated token's K/V comes from the decode path, a prompt
        token's from the prefill path, and a hit must give the numbers a miss would)."""
        self.allocator, self.block_size = allocator, block_size
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.prefix_caching = prefix_caching
        self.cache_generated = cache_generated
        self.waiting: list[SeqState] = []  # sorted by SeqState.key
        self.running: list[SeqState] = []
        self.preemptions = 0  # sequences preempted so far (Status, metrics)
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hits = 0  # of them, tokens found (their K/V not computed again)

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
        s.computed = s.registered = 0
        s.preemptions += 1
        self.preemptions += 1
        self.add(s)

    def advance(self, s: SeqState, n_tokens: int) -> None:
        """A step computed `n_tokens` more of `s`'s K/V: its blocks that are full now enter the
        prefix cache."""
        s.computed += n_tokens
        if not self.prefix_caching or s.cache_root is None:
            return
        full = (s.computed if self.cache_generated else min(s.computed, len(s.prompt))) // self.block_size
        if full > s.registered:
            s.hashes = block_hashes(s.cache_root, s.tokens, self.block_size, s.hashes, full)
            for i in range(s.registered, full):
                self.allocator.register(s.blocks[i], s.hashes[i])
            s.registered = full

    def _hits(self, s: SeqState) -> list[int]:
        """Cached blocks `s` can start from: full blocks of its tokens but the last token's (whose
        logits it needs)."""
        if not self.prefix_caching or s.cache_root is None or not s.reuse:
            return []
        n = (len(s.tokens) - 1) // self.block_size
        s.hashes = block_hashes(s.cache_root, s.tokens, self.block_size, s.hashes[:n], n)
        return self.allocator.lookup(s.hashes)

    def _fits(self, s: SeqState, need: int) -> bool:
        """`s` can be admitted now: a place in the batch for it and its forks, and `need` blocks
        (its tokens' and its forks' copies) of which the cached prefix brings some."""
        hits = self._hits(s)
        return self.occupied() + 1 + s.forks <= self.max_running and need - len(hits) <= self.allocator.free_besides(
            hits
        )

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

    def reserve(self, seqs: list[SeqState], ahead: int) -> bool:
        """Blocks for `ahead` more tokens of each of `seqs` from the free ones, all or none, preempting
        nobody (a burst of decode steps takes its positions' blocks before it runs); False where too
        few are free."""
        needs = [max(0, self.blocks_for(s.computed + ahead) - len(s.blocks)) for s in seqs]
        if sum(needs) > self.allocator.n_free:
            return False
        for s, need in zip(seqs, needs):
            if need:
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
            k = self.blocks_for(len(s.tokens))
            need = k + s.forks * self.fork_copies(len(s.prompt))

            while not self._fits(s, need):
                worst = max(self.running, key=lambda r: r.key, default=None)
                if worst is None or worst.priority <= s.priority:
                    break  # within a priority, nothing is preempted for admission
                gone = out.pop(worst.seq_id, None)
                budget += gone.n_tokens if gone is not None else 0
                self.preempt(worst)
            if not self._fits(s, need):
                break  # waits; nothing behind it overtakes it
            del self.waiting[0]
            hits = self._hits(s)
            self.allocator.share(hits)
            blocks = hits + self.allocator.allocate(need - len(hits))
            s.blocks, s.reserved = blocks[:k], blocks[k:]
            s.computed = len(hits) * self.block_size
            s.registered = len(hits)
            if self.prefix_caching and s.cache_root is not None and s.reuse:
                self.prefix_queries += len(s.tokens)
                self.prefix_hits += s.computed
            self.running.append(s)
            n = min(s.pending, budget)
            out[s.seq_id] = Scheduled(s, n)
            budget -= n
        return list(out.values())
