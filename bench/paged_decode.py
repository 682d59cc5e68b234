"""Decode attention over the paged KV pool: the kernel that reads each sequence's blocks in place
(`bitdelta_kernels.paged_attention.paged_decode`: C on CPU, Triton on CUDA) ÷ the gather it replaces (every
context copied into a padded tensor, then SDPA: `paged_decode_ref`), measured in one run, per
layer call and for a whole decode step of the worker's runner.

    python bench/paged_decode.py                 # CPU: bench/worker.py's 93M model shapes, fp32
    python bench/paged_decode.py --context 4096 --batch 8

The step times run the same `ModelRunner.forward` twice, once with the runner's attention as it
serves and once with the decode attention swapped for the reference gather (the only difference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PRESET = dict(dim=1024, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=2752)  # bench/worker.py's "cpu"


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch (and the C kernel's) threads; 0: torch's default")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import bitdelta_kernels.paged_attention as pa
    from bitdelta.testing.family import make_base, tiny_args
    from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner, SeqWork
    from services.gpu_worker.slots import SlotLayout, SlotTensors

    torch.set_grad_enabled(False)
    B, L, bs = args.batch, args.context, args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        base = make_base(Path(tmp) / "base", tiny_args(**PRESET, max_seq_len=L + 8), seed=1)
        w, margs = BaseWeights.load(base, torch.float32, torch.device("cpu"))
    slots = SlotTensors.allocate(
        SlotLayout(margs, torch.float32), 1, torch.device("cpu"), w.norms, w.final_norm, w.biases
    )
    per_seq = -(-(L + 1) // bs)
    runner = ModelRunner(w, margs, slots, KVPool(margs, B * per_seq, bs, torch.float32, torch.device("cpu")))
    # interleaved block tables, as sequences that grew together get them
    tables = [[j * B + b for j in range(per_seq)] for b in range(B)]
    kv_rows = runner.kv.k.shape[1]
    runner.kv.k.copy_(torch.randn_like(runner.kv.k) * 0.5)  # a filled context: the step reads it all
    runner.kv.v.copy_(torch.randn_like(runner.kv.v))
    step = [SeqWork([1], L, -1, tables[b], True) for b in range(B)]

    H, KV, D = margs.n_heads, margs.n_kv_heads, margs.head_dim
    q = torch.randn(B, H, D)
    t32 = torch.tensor(tables, dtype=torch.int32)
    lens = torch.full((B,), L + 1, dtype=torch.int32)
    k, v = runner.kv.k[0], runner.kv.v[0]
    paged = timed(lambda: pa.paged_decode(q, k, v, t32, lens, bs), args.reps * 4)
    gather = timed(lambda: pa.paged_decode_ref(q, k, v, t32, lens, bs), args.reps * 4)
    step_paged = timed(lambda: runner.forward(step), args.reps)
    import services.gpu_worker.runner as runner_mod

    runner_mod.paged_decode = lambda *a, backend=None, **kw: pa.paged_decode_ref(*a, **kw)
    try:
        step_gather = timed(lambda: runner.forward(step), args.reps)
    finally:
        runner_mod.paged_decode = pa.paged_decode
    kv_bytes = 2 * B * (L + 1) * KV * D * 4
    print(f"decode attention, {B} sequences × {L + 1} tokens, H {H}, KV {KV}, D {D}, fp32, pool {kv_rows} rows:")
    print(
        f"  one layer: paged {paged * 1e3:.2f} ms ({kv_bytes / paged / 1e9:.1f} GB/s of K/V), gather {gather * 1e3:.2f} ms"
    )
    print(f"  paged ÷ gather, one layer   {paged / gather:.3f}")
    print(
        f"  decode step ({margs.n_layers} layers): paged {step_paged * 1e3:.1f} ms, gather {step_gather * 1e3:.1f} ms"
    )
    print(f"  paged ÷ gather, whole step  {step_paged / step_gather:.3f}")


if __name__ == "__main__":
    main()
