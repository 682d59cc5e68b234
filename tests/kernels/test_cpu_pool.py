"""The C library's thread pool (pool_run in csrc/pool.h): any thread count gives every row the
numbers of one thread, concurrent callers and a forked child get theirs, and a call never waits for a
helper that is not there. Real threads and a real fork; nothing is mocked."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

from bitdelta_kernels import bitdelta_delta_batched, cpu_build, cpu_ops
from bitdelta_kernels.settings import configured
from tests.support.kernel_cases import make_linear

# 1000 rows are 16 jobs of 64 (POOL_ROWS), the last one short: every participant gets some
D_OUT, D_IN = 1000, 264
THREADS = (1, 2, 3, 8)  # 8 on a 2-core machine: more helpers than cores, some never scheduled in time


@pytest.fixture(params=["native", "avx2"])
def isa(request):
    with configured(cpu_isa=request.param):
        lib = cpu_build.load_cpu_lib()
        if lib is None:
            pytest.fail(f"the {request.param} build is unavailable: {cpu_build.unavailable_reason}")
        yield request.param


def at_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def kernels_of(M: int, dtype: torch.dtype):
    """Each pooled kernel as a function of nothing, on one fixed input."""
    x, w, signs, alpha = make_linear(M, D_OUT, D_IN, dtype=dtype, seed=M)
    g = torch.Generator().manual_seed(7)
    stack = torch.stack([signs, torch.randint(0, 256, signs.shape, dtype=torch.uint8, generator=g)])
    alphas = torch.stack([alpha, torch.rand(D_OUT, generator=g) * 0.05])
    slots = torch.tensor([[i % 3 - 1] for i in range(M)])  # -1 (the base), 0, 1, ...
    y0 = torch.randn(M, D_OUT, generator=g)
    return {
        "base GEMV": lambda: cpu_ops.linear_gemv_cpu(x, w, None, None),
        "one-pass GEMV": lambda: cpu_ops.linear_gemv_cpu(x, w, signs, alpha),
        "GEMV then planes": lambda: cpu_ops.linear_gemv_cpu(x, w, signs, alpha, two_pass=True),
        "delta GEMV": lambda: cpu_ops.delta_gemv_cpu(x, signs, alpha, y0.clone()),
        "delta GEMV, byte tables": lambda: cpu_ops.delta_gemv_cpu(x, signs, alpha, y0.clone(), method="lut8"),
        "mixed planes": lambda: bitdelta_delta_batched(x, stack, alphas, slots, y0.clone(), backend="cpu"),
        "merge": lambda: cpu_ops.merge_cpu(w, signs, alpha, D_IN, dtype=w.dtype),
    }


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_thread_count_gives_one_threads_numbers(isa, M, dtype):
    for name, run in kernels_of(M, dtype).items():
        want = at_threads(1, run)
        for n in THREADS[1:]:
            for _ in range(3):  # helpers join at different moments each time
                got = at_threads(n, run)
                assert torch.equal(got, want), f"{name}: {n} threads differ from one"


def test_concurrent_callers_each_get_their_own_numbers():
    """Two Python threads calling at once (ctypes drops the GIL): one holds the pool, the other runs
    its call alone; neither sees the other's rows."""
    runs = [kernels_of(1, torch.float32)["GEMV then planes"], kernels_of(3, torch.float32)["mixed planes"]]
    wants = [at_threads(1, r) for r in runs]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for k in range(150):
            got = runs[i]()
            if not torch.equal(got, wants[i]):
                errors.append(f"caller {i}, call {k}")
                return

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller hung"
    finally:
        torch.set_num_threads(before)
    assert not errors, errors


def test_a_forked_child_runs_without_the_parents_helpers():
    """fork() copies the pool's state but not its threads: the child's calls start helpers of its own
    (or run alone) and give the parent's numbers."""
    run = kernels_of(3, torch.float32)["GEMV then planes"]
    want = at_threads(2, run)  # the parent's helpers exist now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            torch.set_num_threads(2)
            out = pickle.dumps([run().numpy() for _ in range(20)])
            os.write(w, out)
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 20):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = pickle.loads(b"".join(chunks))
    assert len(got) == 20
    for g in got:
        assert torch.equal(torch.from_numpy(g), want)
