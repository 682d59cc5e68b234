"""n choices of one request: the scheduler forks a sequence after its prompt onto shared,
refcounted KV blocks; every block comes back once the last choice leaves."""

from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState

BS = 4


def test_a_fork_shares_the_full_prompt_blocks_and_owns_a_copy_of_the_partial_one():
    alloc = BlockAllocator(32)
    sched = Scheduler(alloc, BS, max_running=8, max_batch_tokens=64)
    prompt = list(range(10))  # two full blocks and a partial one of 2 rows
    parent = SeqState(0, prompt, max_new=6, slot=-1, forks=2)
    sched.add(parent)
    (w,) = sched.schedule()
    # the prompt's 3 blocks, and per fork its copy of the partial one (the rest comes as they grow)
    assert len(parent.blocks) == 3 and len(parent.reserved) == 2 and alloc.n_free == 32 - 5
    parent.computed += w.n_tokens
    kids = [SeqState(i, prompt, max_new=6, slot=-1) for i in (1, 2)]
    copies = [sched.fork(parent, k) for k in kids]
    for k, copy in zip(kids, copies):
        assert k.blocks[:2] == parent.blocks[:2] and k.computed == len(prompt)
        assert copy == (parent.blocks[2], k.blocks[2], 2)
        assert len(k.blocks) == 3 and k.blocks[2] not in parent.blocks
    assert parent.reserved == [] and alloc.n_free == 32 - 5
    assert len(sched.running) == 3
    for sid in (0, 1):  # the shared blocks stay while any choice holds them
        sched.remove(sid)
        assert alloc.n_free < 32
    sched.remove(2)
    assert alloc.n_free == 32 and sorted(alloc.allocate(32)) == list(range(32))


def test_a_prompt_on_a_block_boundary_needs_no_copy_and_admission_counts_the_forks():
    alloc = BlockAllocator(6)
    sched = Scheduler(alloc, BS, max_running=2, max_batch_tokens=64)
    s = SeqState(0, list(range(8)), max_new=4, slot=-1, forks=2)  # 3 choices > max_running
    sched.add(s)
    assert sched.schedule() == [] and sched.waiting, "waits: three running sequences would be too many"
    sched.max_running = 3
    sched.schedule()
    s.computed = 8
    kid = SeqState(1, s.prompt, max_new=4, slot=-1)
    assert sched.fork(s, kid) is None and kid.blocks[:2] == s.blocks[:2]
    cancelled = sched.remove(0)  # a parent that leaves returns its forks' reserve with its own
    assert cancelled is s and alloc.n_free == 6 - 2, "the child's hold on the two prompt blocks stays"
