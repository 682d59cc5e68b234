"""Benchmark of the 1-bit delta kernels: ratios against the obvious baseline, and roofline fractions.

    python bench/kernels.py [--quick] [--out bench/results] [--device cpu|cuda] [--cpu-sweep] [--dry-run]

On CUDA (without --quick): the cost per extra sign plane at decode (8192², first), the fused kernel at
M = 1…2048 (from M = 32 also the signs unpacked to ±1 and multiplied by cuBLAS, the path
`bitdelta_linear` takes from the device's `unpack_min_rows` on) and the batched delta at V = 1, 4, 8, 16 (BGMV and SGMV each) on Llama-2-7B and
Llama-2-70B/8 shard shapes, in bf16. --dry-run runs those
sections on CPU in the Triton interpreter with tiny shapes (bench/gpu.sh --dry-run).

Every number is a ratio measured in this one run (time ÷ time of the baseline on the
same shapes), plus the fraction of the memory roofline: bytes the kernel must read and
write ÷ time ÷ the device's bandwidth measured here (CUDA: copy; CPU: read-only sum).
On CUDA the timer is triton.testing.do_bench (median, L2 flushed between runs); on CPU
the minimum of several runs (other processes only ever add time). On a shared CPU host
use --threads 1: with every core busy, multi-threaded timings measure the scheduler; --cpu-time
(with --threads 1) times the calling thread's CPU time instead of wall time, which the other jobs'
time slices do not add to (their contention for memory and caches still does).
Not a test: it asserts nothing.
Targets (docs/kernels.md): fused decode ≤ 1.15× base GEMV (limit 1.0625 in bf16),
fused prefill ≤ 1.10× base GEMM, batched delta ≥ 70% of roofline, CPU delta GEMV
within 2× of a dense fp32 GEMV, each sign plane beyond the first ≤ its bytes: 1/16 of a bf16
base GEMV, 1/32 of an fp32 one (--planes: that section alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch reads this once, at the first tensor: host tensors of 2 MB or more on 2 MB pages, as the
# worker's process puts its weights (services/gpu_worker/__main__.py)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch

from bitdelta.precision import cpu_precision, precision_for, serving_dtype
from bitdelta_kernels import MergedWeightCache, cpu_ops, plan_batch
from bitdelta_kernels.bits import pack_signs, packed_cols, unpack_signs
from bitdelta_kernels.cpu_build import cpu_isa


# ---------------------------------------------------------------- timing
def timer(dev: torch.device, reps: int, cpu_time: bool = False):
    """fn -> ms: CUDA's do_bench median; CPU the minimum of `reps` runs, of wall time or (cpu_time)
    of the calling thread's CPU time, which a shared host's other jobs do not add to (valid with one
    thread: every kernel then runs on the calling thread)."""
    if dev.type == "cuda":
        import triton.testing

        def run(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        return run

    clock = time.thread_time if cpu_time else time.perf_counter

    def run(fn):
        fn()  # warm-up (first call may build/allocate)
        best = float("inf")
        for _ in range(reps):
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
        return best * 1e3

    return run


def copy_bandwidth(dev: torch.device, t) -> float:
    """Bytes/s the device moves, the roofline's denominator.

    CUDA: a 1 GiB device copy (read + write). CPU: a read-only sum over 256 MiB, since
    a CPU copy also pays write-allocate traffic and would understate what a GEMV can read.
    """
    if dev.type == "cuda":
        src = torch.empty(1 << 28, dtype=torch.float32, device=dev).fill_(1.0)
        dst = torch.empty_like(src)
        return 2 * src.numel() * 4 / (t(lambda: dst.copy_(src)) * 1e-3)
    src = torch.ones(1 << 26, dtype=torch.float32)
    return src.numel() * 4 / (t(lambda: src.sum()) * 1e-3)


# ---------------------------------------------------------------- data
def linear_inputs(M, d_out, d_in, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g).to(dtype).to(dev)
    w = (torch.randn(d_out, d_in, generator=g) * 0.02).to(dtype).to(dev)
    signs = pack_signs(torch.randn(d_out, d_in, generator=g)).to(dev)
    alpha = (torch.rand(d_out, generator=g) * 0.01).to(dev)
    return x, w, signs, alpha


def linear_bytes(M, d_out, d_in, es, with_delta=True):
    b = d_out * d_in * es + M * d_in * es + M * d_out * es
    if with_delta:
        b += d_out * packed_cols(d_in) + 4 * d_out
    return b


# ---------------------------------------------------------------- implementations per device
def impls(dev: torch.device):
    """The fused kernel, the batched delta, and the two alternatives a user would try."""
    if dev.type == "cuda":
        from bitdelta_kernels.dispatch import bitdelta_delta_batched
        from bitdelta_kernels.triton_linear import bitdelta_linear_triton as fused
    else:
        fused = cpu_ops.bitdelta_linear_cpu
        bitdelta_delta_batched = None

    def batched(x, s, a, rv, y, plan):
        if dev.type == "cuda":
            return bitdelta_delta_batched(x, s, a, rv, y, plan=plan)
        return cpu_ops.bitdelta_delta_batched_cpu(x, s, a, rv, y)

    def materialise(x, w, s, a):  # W_eff = W + α·S for every call, then one GEMM
        if dev.type == "cpu":
            w_eff = cpu_ops.merge_cpu(w, s, a, w.shape[1], dtype=w.dtype)
        else:
            w_eff = (w.float() + unpack_signs(s, w.shape[1], torch.float32) * a[:, None]).to(w.dtype)
        return x @ w_eff.t()

    def unpack_matmul(x, w, s, a):  # what a user writes in torch
        return x @ w.t() + ((x @ unpack_signs(s, w.shape[1], x.dtype).t()).float() * a).to(x.dtype)

    return fused, batched, materialise, unpack_matmul


# ---------------------------------------------------------------- sections
def bench_fused(dev, t, bw, dtype, cases, rows, section):
    fused, _, materialise, unpack_matmul = impls(dev)
    es = torch.finfo(dtype).bits // 8
    for d, M in cases:
        x, w, s, a = linear_inputs(M, d, d, dtype, dev)
        t_base = t(lambda: x @ w.t())
        t_fused = t(lambda: fused(x, w, s, a))
        row = {
            "section": section,
            "d": d,
            "M": M,
            "dtype": str(dtype).removeprefix("torch."),
            "base_ms": t_base,
            "fused_ms": t_fused,
            "fused/base": t_fused / t_base,
            "fused_roofline": linear_bytes(M, d, d, es) / (t_fused * 1e-3) / bw,
            "base_roofline": linear_bytes(M, d, d, es, False) / (t_base * 1e-3) / bw,
        }
        if section == "fused decode" or M <= 512:
            row["materialise/base"] = t(lambda: materialise(x, w, s, a)) / t_base
            row["unpack_matmul/base"] = t(lambda: unpack_matmul(x, w, s, a)) / t_base
        if dev.type == "cpu":
            row["path"] = cpu_ops.linear_path_cpu(M, dtype)
        rows.append(row)
        print_row(row)
        del x, w, s, a


def bench_batched(dev, t, bw, dtype, d, n_variants_list, rows, M=16):
    _, batched, _, _ = impls(dev)
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, d, generator=g).to(dtype).to(dev)
    w = (torch.randn(d, d, generator=g) * 0.02).to(dtype).to(dev)
    V = max(n_variants_list)
    signs = torch.randint(0, 256, (V, d, packed_cols(d)), generator=g, dtype=torch.uint8).to(dev)
    alpha = (torch.rand(V, d, generator=g) * 0.01).to(dev)
    for n in n_variants_list:
        rv = (torch.arange(M) % n).to(dev)  # 16 rows spread over n variants, interleaved
        plan = plan_batch(rv, V, dev) if dev.type == "cuda" else None  # once per step, as a worker does
        y = x @ w.t()
        t_base = t(lambda: x @ w.t())  # re-measured next to each ratio: load on a shared host drifts
        t_delta = t(lambda: batched(x, signs, alpha, rv, y, plan))
        t_both = t(lambda: batched(x, signs, alpha, rv, x @ w.t(), plan))
        delta_bytes = n * (d * packed_cols(d) + 4 * d) + M * d * es + 2 * M * d * es
        row = {
            "section": "batched decode",
            "d": d,
            "M": M,
            "variants": n,
            "dtype": str(dtype).removeprefix("torch."),
            "base_ms": t_base,
            "delta_ms": t_delta,
            "(base+delta)/base": t_both / t_base,
            "delta_roofline": delta_bytes / (t_delta * 1e-3) / bw,
            "kernel": (plan.kind if plan is not None else "cpu"),
        }
        rows.append(row)
        print_row(row)


def bench_cpu_gemv(t, bw, d, Ms, rows):
    """The CPU delta GEMV (both methods) against a dense fp32 GEMV of the same shape."""
    for M in Ms:
        x, w, s, a = linear_inputs(M, d, d, torch.float32, torch.device("cpu"))
        y = torch.zeros(M, d)
        t_dense = t(lambda: x @ w.t())
        row = {"section": "cpu delta gemv", "d": d, "M": M, "dense_fp32_ms": t_dense}
        for method in ("mask", "lut8"):
            t_m = t(lambda: cpu_ops.delta_gemv_cpu(x, s, a, y, method=method))
            row[f"{method}/dense"] = t_m / t_dense
        row["unpack_torch/dense"] = t(lambda: x @ unpack_signs(s, d).t()) / t_dense
        cache = MergedWeightCache(budget_bytes=1 << 34)
        cache.get("v", w, s, a)
        row["merged_cache_hit/dense"] = t(lambda: cache.linear("v", x, w, s, a)) / t_dense
        row["merge_once_ms"] = t(lambda: cpu_ops.merge_cpu(w, s, a, d))
        rows.append(row)
        print_row(row)


def bench_cpu_gemm(t, rows):
    """The prefill paths' fp32 GEMM (`cpu_ops.mm_nt`: oneDNN where torch has it) against torch's own
    (MKL's), at SmolLM2-135M's and a 7B model's prefill shapes: GFLOPS and the time ratio."""
    for M, K, N in [(559, 576, 1536), (559, 1536, 576), (512, 4096, 4096)]:
        x, w = torch.randn(M, K), torch.randn(N, K)
        t_torch = t(lambda: x @ w.t())
        t_mm = t(lambda: cpu_ops.mm_nt(x, w))
        flop = 2 * M * K * N
        row = {"section": "cpu fp32 gemm", "M": M, "K": K, "N": N, "torch_GFLOPS": flop / t_torch / 1e6}
        row |= {"mm_nt_GFLOPS": flop / t_mm / 1e6, "mm_nt/torch time": t_mm / t_torch}
        rows.append(row)
        print_row(row)


def bench_planes(dev, t, dtypes, d, rows):
    """Each sign plane beyond the first at decode, as the worker runs it: the base GEMV once for
    the batch (`dense_linear`, fp32 out), then ONE batched-delta launch over every row's planes
    (row_slots [M, P]). A plane's cost = (delta with 3 planes − delta with 1) / 2, ÷ the base
    GEMV measured in the same run. M = 1 (one row of a 1/2/3-plane variant) and a mixed batch of
    4 rows (a 3-plane, a 2-plane and a 1-plane variant and a base row; "k planes" gives each of
    the delta rows k planes). Target: a plane costs at most its bytes: 1/16 of a bf16 base GEMV,
    1/32 of an fp32 one (its bits are 1/16 and 1/32 of W's bytes). Also a rank-64 low-rank residual
    per delta row (`lowrank_delta`, once per variant as the worker runs it) and the fused call with a plane stack."""
    from bitdelta_kernels import bitdelta_delta_batched, bitdelta_linear, dense_linear, lowrank_delta

    g = torch.Generator().manual_seed(0)
    P = 3
    signs = torch.randint(0, 256, (3 * P, d, packed_cols(d)), generator=g, dtype=torch.uint8).to(dev)
    alpha = (torch.rand(3 * P, d, generator=g) * 1e-3).to(dev)
    for dtype in dtypes:
        w = (torch.randn(d, d, generator=g) * 0.02).to(dtype).to(dev)
        for M, batch in ((1, "1 row"), (4, "mixed 4 rows")):
            x = torch.randn(M, d, generator=g).to(dtype).to(dev)
            y = torch.zeros(M, d, dtype=torch.float32, device=dev)
            t_base = t(lambda x=x: dense_linear(x, w, out_fp32=True))
            t_k = []
            for k in (1, 2, 3):
                rs = torch.full((M, P), -1, dtype=torch.int64)
                for r in range(min(M, 3)):  # rows of variants 0, 1, 2 (slots 3v … 3v + k − 1); row 4: base
                    rs[r, :k] = torch.arange(3 * r, 3 * r + k)
                rs = rs.to(dev)
                plan = plan_batch(rs, 3 * P, dev)
                t_k.append(t(lambda x=x, rs=rs, plan=plan: bitdelta_delta_batched(x, signs, alpha, rs, y, plan=plan)))
            mixed = torch.tensor([[0, 1, 2], [3, 4, -1], [6, -1, -1], [-1, -1, -1]])[:M].to(dev)
            t_mix = t(lambda x=x, rs=mixed: bitdelta_delta_batched(x, signs, alpha, rs, y)) if M > 1 else 0.0
            u = (torch.randn(3, d, 64, generator=g) * 1e-3).to(torch.float16).to(dev)  # rank 64, fp16 as stored
            v = (torch.randn(3, 64, d, generator=g) * 1e-3).to(torch.float16).to(dev)
            lr_rows = [None] if M == 1 else [torch.tensor([r], device=dev) for r in range(3)]  # delta rows

            def lowrank_all(x=x, u=u, v=v, lr_rows=lr_rows):
                for s, rows in enumerate(lr_rows):
                    lowrank_delta(x, v[s], [(0, 0, u[s])], y, rows)

            t_lr = t(lowrank_all)
            t_f1 = t(lambda x=x: bitdelta_linear(x, w, signs[0], alpha[0]))
            t_f3 = t(lambda x=x: bitdelta_linear(x, w, signs[:P], alpha[:P]))
            target = 1 / 16 if dtype.itemsize == 2 else 1 / 32
            row = {
                "section": "planes",
                "dtype": str(dtype).removeprefix("torch."),
                "d": d,
                "batch": batch,
                "base_gemv_ms": t_base,
                "1 plane/base": t_k[0] / t_base,
                "2 planes/base": t_k[1] / t_base,
                "3 planes/base": t_k[2] / t_base,
                "per extra plane/base": (t_k[2] - t_k[0]) / 2 / t_base,
                "target": target,
                "rank 64/base": t_lr / t_base,
                "fused 1 plane/base": t_f1 / t_base,
                "fused 3 planes/base": t_f3 / t_base,
            }
            if M > 1:
                row["mixed 3+2+1/base"] = t_mix / t_base
            rows.append(row)
            print_row(row)


# ---------------------------------------------------------------- C decode layers (a whole step)
# SmolLM2-135M's layer shapes: dim, heads, KV heads, head dim, intermediate, layers.
SMOLLM2_135M = {
    "dim": 576,
    "n_heads": 9,
    "n_kv_heads": 3,
    "head_dim": 64,
    "intermediate": 1536,
    "n_layers": 30,
    "vocab": 49152,
}


LORA_RANK = 16  # the low-rank case of bench_decode_layers: a common LoRA rank, on every projection


def lowrank_bytes_per_weight() -> float:
    """Bytes of rank-LORA_RANK fp16 factors (U and V of every matrix) per weight of SmolLM2-135M's
    projections: r · (d_in + d_out) · 2 over d_in · d_out, summed over the matrices."""
    c = SMOLLM2_135M
    D, H, KV, hd, F = c["dim"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["intermediate"]
    shapes = [(H * hd, D), (KV * hd, D), (KV * hd, D), (D, H * hd), (F, D), (F, D), (D, F)]
    return sum(LORA_RANK * (o + i) * 2 for o, i in shapes) / sum(o * i for o, i in shapes)


def decode_layers_model(dtype: torch.dtype, libs, n_slots: int = 4, ctx: int = 64, block: int = 16, seed: int = 0):
    """The C decode layers over random SmolLM2-135M-shaped weights and n_slots random one-plane
    deltas, with a KV pool of 8 sequences of ctx tokens, the final norm and the tied head, each
    variant's head the base's + one sign plane of its own (as the family's variants, whose embedding
    is compressed to signs), one DecodeLayers per library of `libs` (None: the process's) ->
    run(lib index, row_slot [B], fuse, row_planes, lowrank) -> the logits [B, vocab], as the worker's
    step (lowrank: slot 0 also has a rank-LORA_RANK residual on every projection, as an imported
    LoRA adapter's or a low-rank mode's, in the layers' `LowRankTable`); and each library's
    DecodeLayers."""
    from bitdelta_kernels.cpu_decode import (
        GROUPS,
        DecodeLayer,
        DecodeLayers,
        DecodeShape,
        HeadPlanes,
        LowRankTable,
        shape_of_groups,
    )

    c = SMOLLM2_135M
    D, H, KV, hd, F = c["dim"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["intermediate"]
    dims = ((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F)
    g = torch.Generator().manual_seed(seed)
    n_blocks = 8 * (ctx // block)
    # the weights one after another in one buffer, in the order a step reads them, as the worker's
    # HostArena lays them out: as separate tensors a bf16 step took ~1.12x the time (the prefetchers
    # restart at every matrix; one Zen 4 core, 2026-12-05)
    arena = torch.empty(c["n_layers"] * sum(o * i for o, i in dims) + c["vocab"] * D, dtype=dtype)
    used = 0

    def place(o: int, i: int) -> torch.Tensor:
        nonlocal used
        w = arena[used : used + o * i].view(o, i)
        w.copy_(torch.randn(o, i, generator=g) * 0.02)
        used += o * i
        return w

    layers = [
        DecodeLayer(
            weights=tuple(place(o, i) for o, i in dims),
            signs=tuple(
                torch.randint(0, 256, (n_slots, o, packed_cols(i)), generator=g, dtype=torch.uint8) for o, i in dims
            ),
            alpha=tuple(torch.rand(n_slots, o, generator=g) * 1e-3 for o, _ in dims),
            biases=(None,) * 4,
            norms=(torch.ones(n_slots + 1, D, dtype=dtype), torch.ones(n_slots + 1, D, dtype=dtype)),
            k=(torch.randn(n_blocks * block, KV, hd, generator=g) * 0.5).to(dtype),
            v=torch.randn(n_blocks * block, KV, hd, generator=g).to(dtype),
            window=None,
        )
        for _ in range(c["n_layers"])
    ]
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    head = place(c["vocab"], D)
    head_planes = tuple(
        (
            torch.randint(0, 256, (c["vocab"], packed_cols(D)), generator=g, dtype=torch.uint8),
            torch.rand(c["vocab"]) * 1e-3,
        )
        for _ in range(n_slots)
    )
    final_norm = torch.ones(n_slots + 1, D, dtype=dtype)
    models = [DecodeLayers(layers, shape, dtype, lib=lib, final_norm=final_norm, head=head) for lib in libs]
    per_seq = ctx // block
    tables = torch.arange(n_blocks, dtype=torch.int32).view(8, per_seq)
    x = torch.randn(8, D, generator=g).to(dtype)
    cos, sin = torch.ones(8, hd), torch.zeros(8, hd)

    terms = {}  # slot 0's rank-LORA_RANK factors of every matrix of every group (q, k, v; gate, up: theirs)
    mats = {"qkv": (H * hd, KV * hd, KV * hd), "o": (D,), "gate_up": (F, F), "down": (D,)}
    for layer in range(c["n_layers"]):
        for group in GROUPS:
            d_in = shape_of_groups(shape)[group][1]
            rows = mats[group]
            v = (torch.randn(LORA_RANK * len(rows), d_in, generator=g) * 0.01).half()
            starts = [sum(rows[:j]) for j in range(len(rows))]
            us = [
                (r0, j * LORA_RANK, (torch.randn(LORA_RANK, n, generator=g) * 0.01).half().t())
                for j, (r0, n) in enumerate(zip(starts, rows))
            ]
            terms[(0, layer, group)] = (v, us)
    lowrank_table = LowRankTable(terms, n_slots, c["n_layers"], shape)

    def run(
        i: int,
        row_slot: torch.Tensor,
        fuse: bool = False,
        row_planes: torch.Tensor | None = None,
        lowrank: bool = False,
    ) -> torch.Tensor:
        B = row_slot.shape[0]
        model = models[i]
        return model.run(
            x[:B],
            row_slot,
            cos[:B],
            sin[:B],
            torch.arange(B, dtype=torch.int64) * ctx + ctx - 1,  # each sequence's last position
            tables[:B],
            torch.full((B,), ctx, dtype=torch.int32),
            block,
            logits=True,
            head_planes=HeadPlanes(head_planes, row_slot.to(torch.int64)) if bool((row_slot >= 0).any()) else None,
            fuse=fuse,
            row_planes=row_planes,
            lowrank=lowrank_table if lowrank else None,
        )

    return run, models


def bench_decode_layers(t, dtypes, rows, against: Path | None = None, rounds: int = 2):
    """A variant's decode step against the base's, the whole step of the C layers
    (`bitdelta_kernels.cpu_decode`, what the worker runs on CPU) on SmolLM2-135M's shapes with random
    weights and deltas: one row of the base ÷ one row of a one-plane variant (tokens/s ratio;
    limit 1/(1 + 1/32) fp32, 1/(1 + 1/16) bf16), the same with the layers' `fuse` (the worker's
    single-variant form: one pass over the weights and the bits where the build has it), the cost
    of each plane past the first of a 3-plane variant's row ÷ the base's step (`row_planes`; limit
    1/32 fp32, 1/16 bf16) by the table loop and `fuse`d, steps of 2, 3 and 4 rows of one variant ÷ as
    many base rows, by the table loop and `fuse`d (limit as one row's), and 8 rows over 4 variants
    ÷ 8 base rows (limit 4/(4 + 4/8) fp32, 2/(2 + 4/8) bf16). All are measured in turns (`t`'s best of N each,
    repeated `rounds` times), so other jobs' load falls on all of them alike. against: another
    source of the C library (another csrc/bitdelta_cpu.c with its parts beside it, e.g. from
    `git archive main bitdelta_kernels/csrc | tar -x -C DIR`), built with the
    same flags and measured interleaved with this one in the same process: before ÷ after."""
    from bitdelta_kernels import cpu_build

    libs = {"this": None}
    if against is not None:
        libs["against"] = cpu_build.load_source(against)
    cases = {  # name: (row slots, fuse, row planes[, low-rank])
        "B1 base": (torch.tensor([-1]), False, None),
        "B1 variant": (torch.tensor([0]), False, None),
        "B1 variant fused": (torch.tensor([0]), True, None),
        "B1 variant + rank 16 fused": (torch.tensor([0]), True, None, True),
        "B1 3-plane variant": (torch.tensor([0]), False, torch.tensor([[0, 1, 2]])),
        "B1 3-plane variant fused": (torch.tensor([0]), True, torch.tensor([[0, 1, 2]])),
        "B2 base": (torch.full((2,), -1), False, None),
        "B2 variant": (torch.zeros(2, dtype=torch.int64), False, None),
        "B2 variant fused": (torch.zeros(2, dtype=torch.int64), True, None),
        "B3 base": (torch.full((3,), -1), False, None),
        "B3 variant": (torch.zeros(3, dtype=torch.int64), False, None),
        "B3 variant fused": (torch.zeros(3, dtype=torch.int64), True, None),
        "B4 base": (torch.full((4,), -1), False, None),
        "B4 variant": (torch.zeros(4, dtype=torch.int64), False, None),
        "B4 variant fused": (torch.zeros(4, dtype=torch.int64), True, None),
        "B8 base": (torch.full((8,), -1), False, None),
        "B8 4 variants": (torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), False, None),
    }
    for dtype in dtypes:
        run, models = decode_layers_model(dtype, list(libs.values()))
        if against is not None:
            mixed = cases["B8 4 variants"][0]
            diff = (run(0, mixed).float() - run(1, mixed).float()).abs().max()
            print(f"  {dtype}: max |this - against| of the logits, 8 rows over 4 variants: {diff:.2e}")
        best = {(lib, c): float("inf") for lib in libs for c in cases}
        for _ in range(rounds):  # both libraries and all cases in turns
            for i, lib_name in enumerate(libs):
                for case, (rs, fuse, rp, *low) in cases.items():
                    best[lib_name, case] = min(
                        best[lib_name, case], t(lambda i=i, rs=rs, f=fuse, rp=rp, lr=bool(low): run(i, rs, f, rp, lr))
                    )
        es = dtype.itemsize
        for model, lib_name in zip(models, libs):
            b = {c: best[lib_name, c] for c in cases}
            # fused: a 3-plane row in one pass where the library sums 3 planes there (else the table loop)
            fused_planes = model.one_pass_planes() >= 3
            row = {
                "section": "decode layers",
                "library": lib_name,
                "dtype": str(dtype).removeprefix("torch."),
                **{f"{c} ms": v for c, v in b.items()},
                "variant/base tok/s": b["B1 base"] / b["B1 variant"],
                "fused variant/base tok/s": b["B1 base"] / b["B1 variant fused"],
                # a plane and rank-16 factors on every projection (its limit: the bytes of both)
                "fused variant + rank 16/base tok/s": b["B1 base"] / b["B1 variant + rank 16 fused"],
                "limit + rank 16": es / (es + 1 / 8 + lowrank_bytes_per_weight()),
                # each plane past the first, of the whole step's (limit: its bytes, 1/32 fp32, 1/16 bf16)
                "extra plane/base": (b["B1 3-plane variant"] - b["B1 variant"]) / 2 / b["B1 base"],
                "extra plane fused/base": (b["B1 3-plane variant fused"] - b["B1 variant fused"]) / 2 / b["B1 base"]
                if fused_planes
                else "table loop",
                "plane limit": 1 / 8 / es,
                "limit": es / (es + 1 / 8),  # bytes per weight: the base's, + 1/8 for a sign
                # a step of 2 or 4 rows of one variant (the table loop; fused: one pass where the build has it)
                **{
                    f"B{n} variant{f}/base tok/s": b[f"B{n} base"] / b[f"B{n} variant{f}"]
                    for n in (2, 3, 4)
                    for f in ("", " fused")
                },
                "4 variants/base (B8)": b["B8 base"] / b["B8 4 variants"],
                "limit B8": es / (es + 4 / 8),
            }
            rows.append(row)
            print_row(row)


def cpu_sweep(t, rows):
    """Crossovers behind MERGE_MIN_M / UNPACK_MIN_M / FUSED_GEMV_MAX_M (docs/kernels.md)."""
    # bf16 only where bitdelta.precision finds it native: emulated bf16 is ~60x slower, not a path
    for dtype in (torch.float32, *([torch.bfloat16] if cpu_precision().name == "bf16" else [])):
        for d in (2048, 4096):
            for M in (1, 2, 4, 8, 16, 32, 64, 128):
                x, w, s, a = linear_inputs(M, d, d, dtype, torch.device("cpu"))
                t_base = t(lambda: x @ w.t())
                row = {"section": "cpu sweep", "dtype": str(dtype).removeprefix("torch."), "d": d, "M": M}
                for path in ("fused_gemv", "blas_delta", "merge_gemm"):
                    row[path] = t(lambda: cpu_ops.bitdelta_linear_cpu(x, w, s, a, path=path)) / t_base
                if dtype == torch.float32:
                    y = torch.zeros(M, d)
                    for path in ("delta_gemv", "unpack_gemm"):
                        row["delta:" + path] = t(lambda: cpu_ops.delta_rows_cpu(x, s, a, y, path=path)) / t_base
                rows.append(row)
                print_row(row)


# ---------------------------------------------------------------- GPU (and its CPU dry run)
# (name, d_out, d_in) of the projection groups the worker runs (q‖k‖v and gate‖up fused):
# Llama-2-7B whole, Llama-2-70B as one of 8 tensor-parallel shards (heads and the MLP split).
LLAMA_SHAPES = {
    "7b": [("7b.qkv", 12288, 4096), ("7b.o", 4096, 4096), ("7b.gate_up", 22016, 4096), ("7b.down", 4096, 11008)],
    "70b-tp8": [
        ("70b/8.qkv", 1280, 8192),
        ("70b/8.o", 8192, 1024),
        ("70b/8.gate_up", 7168, 8192),
        ("70b/8.down", 8192, 3584),
    ],
}
DRY_SHAPES = [("dry.a", 264, 257), ("dry.b", 136, 520)]


def gpu_sections(dev, t, bw, dtype, dry, rows):
    """Fused decode / mid / prefill ÷ the base GEMM (cuBLAS), and the batched delta at V variants
    with BGMV and SGMV each forced, on the real shard shapes (tiny ones in a dry run)."""
    from bitdelta_kernels.configs import config_for
    from bitdelta_kernels.dispatch import _linear_unpacked, bitdelta_delta_batched
    from bitdelta_kernels.triton_linear import bitdelta_linear_triton, launch_blocks

    es = torch.finfo(dtype).bits // 8
    shapes = DRY_SHAPES if dry else LLAMA_SHAPES["7b"] + LLAMA_SHAPES["70b-tp8"]
    print("fused linear (÷ base GEMM; bytes limit 1.0625 at small M; targets ≤ 1.15 decode, ≤ 1.10 prefill):")
    for name, N, K in shapes:
        for M in (1, 16, 40) if dry else (1, 4, 16, 32, 64, 512, 2048):
            if M >= 512 and not (name.endswith("gate_up") or name.endswith("qkv")):
                continue  # prefill: two shapes per model show the trend
            x, w, s, a = linear_inputs(M, N, K, dtype, dev)
            t_base = t(lambda: x @ w.t())
            t_fused = t(lambda: bitdelta_linear_triton(x, w, s, a))
            b = launch_blocks(M, N, K, dtype, dev)
            row = {
                "section": "fused",
                "shape": name,
                "M": M,
                "base_ms": t_base,
                "fused/base": t_fused / t_base,
                "fused_roofline": linear_bytes(M, N, K, es) / (t_fused * 1e-3) / bw,
                "base_roofline": linear_bytes(M, N, K, es, False) / (t_base * 1e-3) / bw,
                "blocks": f"{b['BLOCK_M']}x{b['BLOCK_N']}x{b['BLOCK_K']}/s{b['SPLIT_K']}/st{b['num_stages']}",
            }
            if M >= 32:  # the signs unpacked to ±1 and two cuBLAS GEMMs: the worker's path from unpack_min_rows on
                planes, alphas = s[None], a.float().reshape(1, -1)
                row["unpacked/base"] = t(lambda: _linear_unpacked(x, w, planes, alphas)) / t_base
                row["path"] = "unpacked" if M >= config_for(dev)["unpack_min_rows"] else "fused"
            rows.append(row)
            print_row(row)
            del x, w, s, a
    print("batched delta, 16 rows over V variants (roofline: its own bytes ÷ time ÷ bandwidth; target ≥ 0.7):")
    g = torch.Generator().manual_seed(0)
    for name, N, K in shapes if dry else [LLAMA_SHAPES["7b"][0], LLAMA_SHAPES["7b"][3], LLAMA_SHAPES["70b-tp8"][2]]:
        M, Vmax = 16, 16
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        w = (torch.randn(N, K, generator=g) * 0.02).to(dtype).to(dev)
        signs = torch.randint(0, 256, (Vmax, N, packed_cols(K)), generator=g, dtype=torch.uint8).to(dev)
        alpha = (torch.rand(Vmax, N, generator=g) * 1e-3).to(dev)
        t_base = t(lambda: x @ w.t())
        for V in (1, 4, 8, 16):
            rv = (torch.arange(M) % V).to(dev)
            y = torch.empty(M, N, dtype=torch.float32, device=dev)  # the worker adds into fp32
            for kind in ("bgmv", "sgmv"):
                plan = plan_batch(rv, Vmax, dev, sgmv_min_rows=1 if kind == "sgmv" else 10**9)
                t_d = t(lambda: bitdelta_delta_batched(x, signs, alpha, rv, y, plan=plan))
                own = V * (N * packed_cols(K) + 4 * N) + M * K * es + 2 * M * N * 4
                row = {
                    "section": "batched",
                    "shape": name,
                    "M": M,
                    "V": V,
                    "kind": kind,
                    "delta_ms": t_d,
                    "delta/base_gemm": t_d / t_base,
                    "delta_roofline": own / (t_d * 1e-3) / bw,
                    "(base+delta)/base": (t_base + t_d) / t_base,
                    "limit": (2 + V / 8) / 2,
                }
                rows.append(row)
                print_row(row)
        del x, w, signs, alpha
    chunk = config_for(dev)["unpack_min_rows"] if dry else 512
    print(
        f"mixed prefill: a {chunk}-row chunk of one variant beside 16 decode rows of 8 (÷ the base GEMM of all rows):"
    )
    for name, N, K in shapes if dry else [LLAMA_SHAPES["7b"][0], LLAMA_SHAPES["7b"][2]]:
        M = chunk + 16
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        w = (torch.randn(N, K, generator=g) * 0.02).to(dtype).to(dev)
        signs = torch.randint(0, 256, (9, N, packed_cols(K)), generator=g, dtype=torch.uint8).to(dev)
        alpha = (torch.rand(9, N, generator=g) * 1e-3).to(dev)
        rv = torch.cat([torch.zeros(chunk, dtype=torch.int64), 1 + torch.arange(16) % 8]).to(dev)
        y = torch.empty(M, N, dtype=torch.float32, device=dev)
        t_base = t(lambda: x @ w.t())
        row = {"section": "mixed prefill", "shape": name, "M": M, "base_ms": t_base}
        for label, unpack in (("kernels", False), ("unpacked", True)):
            plan = plan_batch(rv, 9, dev, unpack=unpack)
            row[f"{label} delta/base"] = t(lambda: bitdelta_delta_batched(x, signs, alpha, rv, y, plan=plan)) / t_base
        rows.append(row)
        print_row(row)
        del x, w, signs, alpha


# ---------------------------------------------------------------- output
def fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_row(row):
    print("  " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items() if k != "section"), flush=True)


def markdown(meta, rows) -> str:
    out = [f"# Kernel benchmark — {meta['device']}", ""]
    out += [f"- {k}: {fmt(v)}" for k, v in meta.items()]
    sections = []
    for r in rows:
        if r["section"] not in sections:
            sections.append(r["section"])
    for sec in sections:
        rs = [r for r in rows if r["section"] == sec]
        keys = [k for k in rs[0] if k != "section"]
        for r in rs:
            keys += [k for k in r if k not in keys and k != "section"]
        out += ["", f"## {sec}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        out += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rs]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer and smaller shapes")
    ap.add_argument("--out", type=Path, help="write results.json and results.md here (e.g. bench/results)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--cpu-sweep", action="store_true", help="also sweep the CPU paths over M (slow)")
    ap.add_argument("--reps", type=int, default=None, help="CPU repetitions per timing")
    ap.add_argument(
        "--threads", type=int, default=None, help="CPU threads, torch's and the C library's (default: torch's)"
    )
    ap.add_argument("--only-sweep", action="store_true", help="with --cpu-sweep: skip the other sections")
    ap.add_argument("--planes", action="store_true", help="only the sign-plane section (cost per extra plane)")
    ap.add_argument("--gemm", action="store_true", help="CPU: only the prefill paths' fp32 GEMM against torch's")
    ap.add_argument(
        "--decode-layers",
        action="store_true",
        help="CPU: only a variant's whole decode step ÷ the base's (the C layers, SmolLM2-135M's shapes)",
    )
    ap.add_argument(
        "--against",
        type=Path,
        metavar="SOURCE",
        help="with --decode-layers: also another source of the C library, interleaved (before ÷ after)",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU: time the calling thread's CPU time, not wall time (a shared host; needs --threads 1)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the GPU sections on CPU with tiny shapes (Triton interpreter): checks bench/gpu.sh end to end",
    )
    args = ap.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time measures the calling thread only: use it with --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    cuda = torch.cuda.is_available() and args.device != "cpu"
    dev = torch.device("cuda" if cuda else "cpu")
    t = timer(dev, args.reps or (5 if args.quick else 10), args.cpu_time and not cuda)
    bw = copy_bandwidth(dev, t)
    name = torch.cuda.get_device_name(dev) if cuda else (platform.processor() or platform.machine())
    meta = {
        "device": name,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "quick": args.quick,
        "bandwidth_GBps": bw / 1e9,
        "threads": torch.get_num_threads(),
        "clock": "thread CPU time" if args.cpu_time and not cuda else "wall",
    }
    if not cuda:
        meta["cpu_kernels"] = cpu_isa()
        meta["cpu_precision"] = cpu_precision().describe()
        # a shared host: with every core busy, a task's helpers are descheduled and multi-threaded
        # timings mostly measure the scheduler (try --threads 1)
        meta["load_average_1min"] = os.getloadavg()[0]
    print(f"device: {name}; measured bandwidth {bw / 1e9:.1f} GB/s")
    rows: list[dict] = []

    if args.decode_layers and not cuda:
        print("C decode layers, SmolLM2-135M shapes (variant ÷ base tokens/s; limits: its bytes):")
        bench_decode_layers(t, (torch.float32, torch.bfloat16), rows, args.against)
    elif args.planes:
        dtypes = (
            (precision_for(dev).dtype,)
            if cuda
            else tuple(dict.fromkeys((serving_dtype(dev).dtype, torch.bfloat16, torch.float32)))
        )
        print("sign planes at decode (÷ base GEMV; target per extra plane ≤ 1/16 of a bf16 base, 1/32 of fp32):")
        bench_planes(dev, t, dtypes, 4096, rows)
    elif args.dry_run and not cuda:
        import triton

        meta["triton"] = triton.__version__
        gpu_sections(dev, t, bw, torch.bfloat16, True, rows)
    elif cuda and not args.quick:
        import triton

        meta["triton"] = triton.__version__
        dtype = precision_for(dev).dtype  # bf16 on CUDA (bitdelta.precision)
        print("sign planes at decode (÷ base GEMV; target per extra plane ≤ 1/16 of a bf16 base):")
        bench_planes(dev, t, (dtype,), 8192, rows)  # 128 MB of weights: far past the L2, as a real layer
        gpu_sections(dev, t, bw, dtype, False, rows)
    elif cuda:
        import triton

        meta["triton"] = triton.__version__
        dtype = precision_for(dev).dtype  # bf16 on CUDA (bitdelta.precision)
        dec_d = (4096,) if args.quick else (4096, 8192)
        print("fused decode (÷ base GEMV, cuBLAS):")
        bench_fused(dev, t, bw, dtype, [(d, M) for d in dec_d for M in (1, 4, 16)], rows, "fused decode")
        print("fused prefill (÷ base GEMM):")
        pre = [(4096, 512)] if args.quick else [(4096, 512), (4096, 2048), (8192, 2048)]
        bench_fused(dev, t, bw, dtype, pre, rows, "fused prefill")
        print("batched decode, 16 rows:")
        for d in dec_d:
            bench_batched(dev, t, bw, dtype, d, (1, 4, 8, 16), rows)
        print("sign planes at decode (÷ base GEMV; target per extra plane ≤ 1/16 of a bf16 base):")
        bench_planes(dev, t, (dtype,), 4096, rows)
    elif args.only_sweep:
        cpu_sweep(t, rows)
    elif args.gemm and not cuda:
        print("CPU fp32 GEMM of the prefill paths (mm_nt: oneDNN) ÷ torch's (MKL):")
        bench_cpu_gemm(t, rows)
    else:
        dtype = serving_dtype(dev).dtype  # the worker's CPU dtype (bitdelta.precision: bf16 where native)
        dec_d = (4096,) if args.quick else (4096, 8192)
        print("CPU fused decode (÷ torch base GEMV):")
        bench_fused(dev, t, bw, dtype, [(d, M) for d in dec_d for M in (1, 4, 16)], rows, "fused decode")
        print("CPU fused prefill (÷ torch base GEMM):")
        pre = [(2048, 512)] if args.quick else [(4096, 512), (4096, 2048)]
        bench_fused(dev, t, bw, dtype, pre, rows, "fused prefill")
        print("CPU batched decode, 16 rows:")
        bench_batched(dev, t, bw, dtype, 4096, (1, 4, 16) if args.quick else (1, 4, 8, 16), rows)
        print("CPU delta GEMV vs dense fp32 GEMV:")
        bench_cpu_gemv(t, bw, 4096, (1, 4, 16), rows)
        print("CPU sign planes at decode (÷ base GEMV; target per extra plane ≤ 1/16 of a bf16 base, 1/32 of fp32):")
        bench_planes(dev, t, tuple(dict.fromkeys((dtype, torch.bfloat16, torch.float32))), 4096, rows)
        print("CPU fp32 GEMM of the prefill paths (mm_nt: oneDNN) ÷ torch's (MKL):")
        bench_cpu_gemm(t, rows)
        if args.cpu_sweep:
            print("CPU path sweep (÷ torch base):")
            cpu_sweep(t, rows)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = (
            "kernels_"
            + ("cuda" if cuda else "cpu")
            + ("_quick" if args.quick else "")
            + ("_dry" if args.dry_run else "")
        )
        stem += "_planes" if args.planes else ""
        stem += "_gemm" if args.gemm else ""
        stem += "_decode_layers" if args.decode_layers else ""
        stem += f"_t{args.threads}" if args.threads else ""
        (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(meta, rows))
        print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main()
