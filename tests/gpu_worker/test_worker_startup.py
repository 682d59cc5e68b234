"""Worker start-up on a GPU: every kernel binary compiled before the first request (warm-up),
and no silent fall-back to the slow torch kernels when Triton is missing."""

from __future__ import annotations

import pytest
import torch

from bitdelta.testing.family import VARIED_STD, make_base, tiny_args
from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner, SeqWork
from services.gpu_worker.slots import SlotLayout, SlotTensors

pytestmark = pytest.mark.usefixtures("cpu_kernels")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _runner(base, slots=1):
    w, args = BaseWeights.load(base, torch.float32, DEV)
    st = SlotTensors.allocate(SlotLayout(args, torch.float32), slots, DEV, w.norms, w.final_norm, w.biases)
    return ModelRunner(w, args, st, KVPool(args, 32, 8, torch.float32, DEV)), st


def test_warm_sizes_cover_every_compiled_variant(tmp_path):
    from bitdelta_kernels.configs import config_for
    from bitdelta_kernels.triton_linear import launch_blocks

    runner, _ = _runner(make_base(tmp_path / "b", tiny_args(), seed=5, std=VARIED_STD))
    sizes = runner.warm_sizes(300)
    shapes = [tuple(w.shape) for w in runner.base.layers[0].values()] + [tuple(runner.base.head.shape)]

    unpack_from = config_for(DEV)["unpack_min_rows"]
    assert unpack_from <= 300  # the unpacked path's kernel is among the binaries below

    def key(M):
        if M >= unpack_from:  # the fused kernel is not launched: the unpack kernel, one binary
            return ("unpacked",)
        return (M == 1, M % 16 == 0) + tuple(
            tuple(sorted(launch_blocks(M, n, k, torch.float32, DEV).items())) for n, k in shapes
        )

    keys = {key(M) for M in sizes}
    assert len(keys) == len(sizes)  # one row count per binary
    assert all(key(M) in keys for M in range(1, 301))  # and every row count's binary is among them
    assert {1, 2, 16, unpack_from} <= set(sizes)


def test_warmup_runs_every_path_and_leaves_no_trace(tmp_path):
    from bitdelta.model import load_model

    base = make_base(tmp_path / "b", tiny_args(), seed=5, std=VARIED_STD)
    runner, slots = _runner(base)
    alpha0 = [t.clone() for d in slots.alpha for t in d.values()]
    done = runner.warmup(max_rows=200, max_seqs=16)
    paths = {p for _, p in done}
    assert {"fused/decode", "fused/prefill", "unpacked/prefill", "mixed/bgmv", "mixed/sgmv"} <= paths
    assert (1, "fused/decode") in done
    assert all(torch.equal(a, t) for a, t in zip(alpha0, [t for d in slots.alpha for t in d.values()]))
    # the KV blocks warm-up wrote into are overwritten before anyone reads them
    seq = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = runner.forward([SeqWork(seq, 0, -1, [0, 1, 2], True)])
    with torch.no_grad():
        want = load_model(base)(torch.tensor([seq]))[0, -1]
    torch.testing.assert_close(logits[0].cpu(), want, rtol=1e-4, atol=1e-4)


def test_no_silent_slow_kernels_on_cuda(tmp_path, monkeypatch):
    import asyncio

    import bitdelta_kernels.dispatch
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    base = make_base(tmp_path / "b", tiny_args(), seed=5, std=VARIED_STD)
    monkeypatch.setattr(bitdelta_kernels.dispatch, "HAVE_TRITON", False)
    monkeypatch.setattr(bitdelta_kernels.dispatch, "TRITON_ERROR", "ImportError: no triton")
    w = Worker(WorkerConfig(base=base, device="cuda", dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="--allow-slow-kernels"):
        asyncio.run(w.start())
    if not torch.cuda.is_available():  # with the flag it goes on (and here fails later, for want of a GPU)
        w = Worker(WorkerConfig(base=base, device="cuda", dtype="bfloat16", allow_slow_kernels=True))
        with pytest.raises(Exception) as e:
            asyncio.run(w.start())
        assert "allow-slow-kernels" not in str(e.value)
