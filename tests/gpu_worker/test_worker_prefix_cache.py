"""Prefix caching: full KV blocks keyed by a hash chain of their tokens rooted in the weights that
computed them. The allocator's LRU of cached blocks, and a real worker: requests that share a
prefix across the base and variants never share blocks between different weights (their tokens
equal a worker's without the cache), a variant uploaded again with new contents never reads its old
blocks, a hit skips the prefix's prefill, and the cache salt separates requests."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from bitdelta.generation import Request, Sampling
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState, block_hashes, cache_root
from services.gpu_worker.worker import Worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_cached_blocks_stay_until_needed_least_recently_released_first():
    a = BlockAllocator(4)
    b0, b1, b2 = a.allocate(3)
    a.register(b0, b"h0")
    a.register(b1, b"h1")
    a.register(b2, b"h0")  # the same contents as b0: b0 keeps them
    assert a.lookup([b"h0", b"h1", b"h2"]) == [b0, b1]
    a.free([b1])
    a.free([b0])  # released after b1
    a.free([b2])  # not registered: plainly free
    assert a.n_free == 4 and a.n_cached == 2
    a.share([b0])  # a hit takes it back
    assert a.n_free == 3 and a.free_besides([b1]) == 2
    (x,) = a.allocate(1)
    assert x not in (b0, b1), "never-cached blocks go first"
    (y,) = a.allocate(1)
    assert y not in (b0, b1)
    (z,) = a.allocate(1)
    assert z == b1 and a.lookup([b"h0", b"h1"]) == [b0], "then the least recently released cached one"
    assert a.allocate(1) is None


def test_the_hash_chain_covers_the_weights_and_every_token_before():
    base, variant = cache_root("fp"), cache_root("fp/abc")
    toks = list(range(12))
    h = block_hashes(base, toks, 4, [], 3)
    assert len(h) == 3 and len(set(h)) == 3
    assert block_hashes(variant, toks, 4, [], 3)[0] != h[0]
    assert block_hashes(cache_root("fp", "salt"), toks, 4, [], 1)[0] != h[0]
    changed = block_hashes(base, [99] + toks[1:], 4, [], 3)
    assert all(x != y for x, y in zip(changed, h)), "a change in block 0 changes every later hash"
    assert block_hashes(base, toks, 4, h[:1], 3) == h


def test_a_second_sequence_starts_from_the_first_ones_blocks():
    sched = Scheduler(BlockAllocator(16), 4, max_running=8, max_batch_tokens=64, prefix_caching=True)
    root = cache_root("fp")
    first = SeqState(1, list(range(10)), 4, -1, cache_root=root)
    sched.add(first)
    (w,) = sched.schedule()
    sched.advance(first, w.n_tokens)  # blocks 0 and 1 are full: cached
    same = SeqState(2, list(range(10)) + [50, 51], 4, -1, cache_root=root)
    other = SeqState(3, list(range(10)), 4, -1, cache_root=cache_root("fp/v"))
    sched.add(same)
    sched.add(other)
    work = {w.seq.seq_id: w.n_tokens for w in sched.schedule()}
    assert same.blocks[:2] == first.blocks[:2] and same.computed == 8 and work[2] == 4
    assert other.computed == 0 and not set(other.blocks) & set(first.blocks) and work[3] == 10
    assert (sched.prefix_queries, sched.prefix_hits) == (10 + 12 + 10, 8)
    prefix = first.blocks[:2]
    sched.remove(1)
    sched.remove(2)  # the shared blocks are free now, and still cached
    again = SeqState(4, list(range(9)), 4, -1, cache_root=root)
    sched.add(again)
    sched.schedule()
    assert again.computed == 8 and again.blocks[:2] == prefix
    whole = SeqState(5, list(range(8)), 4, -1, cache_root=root)  # both blocks cached: its last one is computed
    sched.add(whole)
    sched.schedule()
    assert whole.computed == 4


# -- through a real worker ----------------------------------------------------------------------
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, please! "  # 66 byte tokens: 4 blocks
N = 8


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fam = make_test_family(tmp_path_factory.mktemp("prefix"), n_variants=2, merged=False)
    shutil.copy(fam.delta_path("v0"), fam.delta_path("w"))  # "w" is uploaded again below
    return fam


async def _worker(family, **kw) -> Worker:
    w = Worker(WorkerConfig(base=family.base, delta_dir=str(family.deltas), kv_cache=4 << 20, **kw))
    await w.start()
    return w


async def _gen(w: Worker, model: str, prompt: str, **kw) -> list[int]:
    sp = Sampling(max_new_tokens=N, ignore_eos=True)
    return [e.token_id async for e in w.generate(Request(model, prompt, sp, **kw))]


JOBS = [("", "Q1"), ("v0", "Q1"), ("v1", "Q1"), ("v0", "Q2"), ("", "Q2"), ("v1", "Q1")]


def test_shared_prefixes_across_variants_never_share_blocks_of_other_weights(family):
    async def run(prefix_caching: bool):
        w = await _worker(family, prefix_caching=prefix_caching)
        try:
            out, hits = [], []
            for m, q in JOBS:  # one at a time: each request's hits are its own
                before = w.scheduler.prefix_hits
                out.append(await _gen(w, m, SYSTEM + q))
                hits.append(w.scheduler.prefix_hits - before)
            return out, hits, w.status()
        finally:
            await w.close()

    off, off_hits, off_status = asyncio.run(run(False))
    on, hits, status = asyncio.run(run(True))
    assert on == off, "the cache changes no token"
    assert off_hits == [0] * len(JOBS) and off_status.prefix_queries == 0
    # the first request of each weights misses; later ones of the same weights hit the system prompt
    assert hits[:3] == [0, 0, 0] and all(h >= 64 for h in hits[3:]), hits
    assert status.prefix_hits == sum(hits) and status.prefix_queries >= sum(hits)
    assert status.kv_tokens_used == 0, "cached blocks nobody holds are free"


def test_a_variant_uploaded_again_never_reads_its_old_blocks(family):
    async def run():
        w = await _worker(family)
        try:
            old = await _gen(w, "w", SYSTEM + "Q")
            await w.evict_delta("w")
            shutil.copy(family.delta_path("v1"), family.delta_path("w"))  # same name, new contents
            before = w.scheduler.prefix_hits
            new = await _gen(w, "w", SYSTEM + "Q")
            missed = w.scheduler.prefix_hits - before
            want = await _gen(w, "v1", SYSTEM + "Q")  # the same contents under their own name
            return old, new, missed, want
        finally:
            await w.close()

    old, new, missed, want = asyncio.run(run())
    assert missed == 0, "the new contents' KV is computed afresh"
    assert new == want and new != old


def test_a_hit_skips_the_prefix_prefill_and_the_salt_separates(family):
    async def run():
        w = await _worker(family, block_size=4)
        try:
            await _gen(w, "v0", SYSTEM + "first")
            counts = {}
            for tag, q, salt in [
                ("hit", "second", ""),
                ("salted", "third", "tenant-b"),
                ("salted again", "x", "tenant-b"),
            ]:
                p0 = w.engine.prefill_tokens
                await _gen(w, "v0", SYSTEM + q, cache_salt=salt)
                counts[tag] = w.engine.prefill_tokens - p0
            return counts
        finally:
            await w.close()

    c = asyncio.run(run())
    assert c["hit"] <= len("second") + 4, c
    assert c["salted"] >= len(SYSTEM), "another salt: nothing shared"
    assert c["salted again"] <= len("x") + 4, "the same salt shares"


def test_a_deltas_content_id_changes_with_its_tensors_or_the_stores_version():
    from services.gpu_worker.sources import DeltaInfo, TensorSpec

    t = [TensorSpec("a.sign", "U8", (4, 1), 4, "aa"), TensorSpec("a.alpha", "F32", (4,), 16, "bb")]
    one = DeltaInfo("v", t).content_id
    assert DeltaInfo("v", list(reversed(t))).content_id == one, "the order tensors arrive in does not matter"
    assert DeltaInfo("v", [t[0], TensorSpec("a.alpha", "F32", (4,), 16, "cc")]).content_id != one
    # a tensor-parallel rank's slices come without sha256s: the store's version of the delta tells
    sliced = [TensorSpec("a.sign", "U8", (2, 1), 2, ""), TensorSpec("a.alpha", "F32", (2,), 8, "")]
    a = DeltaInfo("v", sliced, sliced=True, version="etag-1").content_id
    assert a != DeltaInfo("v", sliced, sliced=True, version="etag-2").content_id
