"""Decode attention over the paged KV pool: the kernel that reads each sequence's blocks in place
(`bitdelta_kernels.paged_attention.paged_decode`: C on CPU, Triton on CUDA) ÷ the gather it replaces (every
context copied into a padded tensor, then SDPA: `paged_decode_ref`), measured in one run, per
layer call and for a whole decode step of the worker's runner.

    python bench/paged_decode.py                 # CPU: bench/worker.py's 93M model shapes, fp32
    python bench/paged_decode.py --context 4096 --batch 8

The step times run the same `ModelRunner.forward` twice, layer by layer (the runner's own layers,
as on a GPU; the C decode layers call the C kernel directly), once with the runner's attention as it
serves and once with the decode attention swapped for the reference gather (the only difference).

Then the long-context read (`--cold-context`): one sequence's attention over every layer's own
pool (SmolLM2-135M's 30 layers, 9 query and 3 KV heads of 64; its blocks scattered), as a decode
step meets it: cold, the weights' stream having passed through the caches since the layer last
ran. Its K/V bytes ÷ time, as a fraction of a plain sum over as many bytes in the same run.
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
    p.add_argument("--cold-context", type=int, nargs="*", default=[1024, 4096], help="tokens of the long-context read")
    p.add_argument(
        "--against",
        type=Path,
        help="another csrc/bitdelta_cpu.c (its parts beside it): its long-context read, in turns",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_against_gather(args)
    from bitdelta_kernels import cpu_build

    libs = {"this": cpu_build.load_cpu_lib()}
    if libs["this"] is None:
        print(f"long context: no C library ({cpu_build.unavailable_reason})")
        return
    if args.against:
        libs[args.against.name] = cpu_build.load_source(args.against)
    for ctx in args.cold_context:
        for dtype in (torch.float32, torch.bfloat16):
            cold_read(libs, ctx, dtype, args.block_size, args.reps * 3)


def cold_read(
    libs: dict, ctx: int, dtype: torch.dtype, bs: int, reps: int, layers: int = 30, H: int = 9, KV: int = 3, D: int = 64
):
    """One sequence of ctx tokens over `layers` pools in turn by each library's bd_paged_decode,
    against a sum over as many bytes."""
    import random

    from bitdelta_kernels.paged_attention import _paged_decode_cpu

    g = torch.Generator().manual_seed(0)
    nb = -(-ctx // bs)
    rows = 2 * nb * bs  # the pool twice the sequence: its blocks scattered over it
    pools = [
        ((torch.randn(rows, KV, D, generator=g) * 0.5).to(dtype), torch.randn(rows, KV, D, generator=g).to(dtype))
        for _ in range(layers)
    ]
    tables = torch.randperm(2 * nb, generator=g)[:nb].to(torch.int32).view(1, nb)
    lens = torch.tensor([ctx], dtype=torch.int32)
    q = torch.randn(1, H, D, generator=g)
    flat = torch.randn(layers * 2 * ctx * KV * D * dtype.itemsize // 4, generator=g)  # as many bytes, fp32

    def step(lib) -> None:
        for k, v in pools:
            _paged_decode_cpu(q, k, v, tables, lens, bs, None, D**-0.5, lib=lib)

    runs = {name: (lambda lib=lib: step(lib)) for name, lib in libs.items()} | {"sum": lambda: flat.sum()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(reps):  # in turns, in a random order
        for name in random.sample(list(runs), len(runs)):
            t = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t)
    plain, kv = statistics.median(times.pop("sum")), flat.numel() * 4
    print(
        f"long context, cold: 1 sequence × {ctx} tokens, {layers} layers, H {H}, KV {KV}, D {D}, {str(dtype)[6:]}, "
        f"{kv / 1e6:.0f} MB of K/V (a plain sum {kv / plain / 1e9:.1f} GB/s):"
    )
    for name, ts in times.items():
        att = statistics.median(ts)
        print(f"  {name}: {att * 1e3:.1f} ms, {kv / att / 1e9:.1f} GB/s = {plain / att:.2f} of the sum")


def batch_against_gather(args) -> None:

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
    runner._c_decode_serves = lambda rows: False  # layer by layer: the runner's paged_decode call serves

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
