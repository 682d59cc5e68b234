"""Autotune the launch configurations over the small search space recorded in configs.json.

    python -m bitdelta_kernels.tune --out tuned.json [--shapes 7b] [--dtype bfloat16]
    BITDELTA_KERNEL_CONFIGS=tuned.json python -m services.gpu_worker ...

For each bucket (`linear_decode`, `linear_mid`, `linear_prefill`, `sgmv`, `bgmv`) every candidate
of configs.json's "search" that fits this GPU (configs.fits) is timed with
triton.testing.do_bench on the given layer shapes; the candidate with the least total time wins.
The output is the whole table with this GPU's entry replaced, so it can be used as is. CUDA only.
"""

from __future__ import annotations

import argparse
import json

import torch

from bitdelta_kernels import configs as kc

# a representative M per linear bucket (configs.json: ≤ 16, ≤ 128, more)
BUCKET_M = {"linear_decode": 4, "linear_mid": 48, "linear_prefill": 1024}
SHAPES = {
    "7b": [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)],
    "70b-tp8": [(1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584)],
}


def candidates(cfg: dict, key: str, es: int, smem: int) -> list[dict]:
    """The search space of one bucket applied to the entry's blocks, keeping those that fit."""
    if key.startswith("linear"):
        base = kc.linear_bucket(cfg, BUCKET_M[key])
        base.pop("min_block_n", None)
        kind = "linear"
    else:
        base, kind = dict(cfg[key]), key
    out = [base]
    for c in kc._table()["search"].get(key, []):
        b = {**base, **c}
        if b not in out and kc.fits(kind, b, es, smem):
            out.append(b)
    return out


def time_candidate(cfg: dict, bucket: str, b: dict, shapes, dtype, dev, g) -> float:
    """ms of one candidate's blocks summed over the layer shapes (triton.testing.do_bench medians)."""
    import triton.testing

    from bitdelta_kernels.dispatch import bitdelta_delta_batched
    from bitdelta_kernels.plan import plan_batch
    from bitdelta_kernels.triton_linear import bitdelta_linear_triton

    total = 0.0
    for N, K in shapes:
        M = BUCKET_M.get(bucket, 16)
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        s = torch.randint(
            0,
            256,
            (8 if not bucket.startswith("linear") else 1, N, (K + 7) // 8),
            generator=g,
            dtype=torch.uint8,
        ).to(dev)
        a = torch.rand(s.shape[0], N, generator=g).to(dev) * 1e-3
        if bucket.startswith("linear"):
            w = torch.randn(N, K, generator=g).to(dtype).to(dev)
            over = {k: v for k, v in b.items() if k != "SPLIT_K"}
            fn = lambda: bitdelta_linear_triton(x, w, s[0], a[0], config=over)
        else:
            rv = (torch.arange(M) % (2 if bucket == "sgmv" else 8)).to(dev)
            plan = plan_batch(rv, 8, dev, sgmv_min_rows=1 if bucket == "sgmv" else 10**9, block_m=b.get("BLOCK_M"))
            y = torch.zeros(M, N, device=dev, dtype=torch.float32)
            cfg[bucket] = b  # the dispatcher reads this (cached) entry: time these blocks
            fn = lambda: bitdelta_delta_batched(x, s, a, rv, y, plan=plan)
        # 100 ms of warm-up: the candidate's compile leaves the GPU idle for a second and its clocks
        # low; with 10 ms the first candidates of a bucket read up to 2x slow (H200, 2026-12-04)
        total += triton.testing.do_bench(fn, warmup=100, rep=40, return_mode="median")
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    cfg = kc.config_for(dev)
    dtype = getattr(torch, args.dtype)
    es, smem = dtype.itemsize, kc.smem_limit(cfg, dev)
    table = kc._table()
    key = next((k for k in kc.device_names() if k in name), None) or name.split()[-1]
    entry = json.loads(json.dumps(table.get(key, {})))
    entry.setdefault("linear", json.loads(json.dumps(cfg["linear"])))
    g = torch.Generator().manual_seed(0)
    report = {}
    for bucket in ("linear_decode", "linear_mid", "linear_prefill", "sgmv", "bgmv"):
        timed = []
        for b in candidates(cfg, bucket, es, smem):
            try:
                total = time_candidate(cfg, bucket, b, SHAPES[args.shapes], dtype, dev, g)
            except Exception as e:  # a candidate this GPU cannot run (e.g. out of resources) is skipped
                print(f"{bucket}: failed {b}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            timed.append((total, b))
            print(f"{bucket}: {total:.4f} ms  {b}", flush=True)
        if not timed:
            raise SystemExit(f"{bucket}: no candidate ran")
        best = min(timed, key=lambda tb: tb[0])[1]
        report[bucket] = best
        if bucket.startswith("linear"):
            i = {"linear_decode": 0, "linear_mid": 1, "linear_prefill": 2}[bucket]
            entry["linear"][i] = {**entry["linear"][i], **best}
        else:
            entry[bucket] = best
    table = dict(table)
    table[key] = entry
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    print(json.dumps({"device": name, "best": report}, indent=1))


if __name__ == "__main__":
    main()
