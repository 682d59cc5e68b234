"""Where the CPU worker's C decode layers stop paying: base-only decode tokens/s of S concurrent
greedy streams with the C decode layers (the worker's default up to `DENSE_GEMV_MAX_M` rows) and
with the torch path (the C layers capped at 8 rows, as before they took more), in one process, the
two in turns, so both see the same host.

    python bench/cpu_paths.py [--dtype float32] [--streams 16,24,32] [--reps 2] [--c-rows N] [--out FILE]

The worker is the in-process `Worker` that `python -m services.gpu_worker` serves (the real base in
data/base, one thread: `--threads`). Each cell is the decode phase's rate (after every stream has its
first token; `bench/worker.py`'s decode_rate); the last column is C ÷ torch. `DENSE_GEMV_MAX_M`
(bitdelta_kernels/cpu_ops.py) is measured with this (`--c-rows`: the C layers up to N rows instead,
to try a threshold): above 1 at its threshold, the C layers should take those rows.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from worker import decode_rate  # noqa: E402  (bench/worker.py)

from bitdelta_kernels import cpu_ops  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived"
TORCH_FROM = 8  # the torch path's C layers: up to 8 rows, as before they took more


async def measure(args) -> list[tuple[int, list[float], list[float]]]:
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    worker = Worker(
        WorkerConfig(
            base=args.base, dtype=args.dtype, device="cpu", kv_cache=256 << 20, prefix_caching=False,
            max_running=max(args.streams),
        )
    )  # fmt: skip
    await worker.start()
    default_rows = cpu_ops.DENSE_GEMV_MAX_M[dtype]
    rows = []
    try:
        await decode_rate(worker, [""], PROMPT, 4)  # warm: the C library, the first step's buffers
        for s in args.streams:
            c, t = [], []
            for _ in range(args.reps):  # in turns
                for cap, out in ((args.c_rows, c), (TORCH_FROM, t)):
                    cpu_ops.DENSE_GEMV_MAX_M[dtype] = cap
                    out.append(await decode_rate(worker, [""] * s, PROMPT, args.new_tokens))
            rows.append((s, c, t))
            print(f"{s} streams: C layers {max(c):.1f}, torch path {max(t):.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        cpu_ops.DENSE_GEMV_MAX_M[dtype] = default_rows
        await worker.close()
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=ROOT / "data" / "base")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")], default=[16, 24, 32])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--c-rows", type=int, help="the C layers up to this many rows (default: DENSE_GEMV_MAX_M's)")
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    args.c_rows = args.c_rows or cpu_ops.DENSE_GEMV_MAX_M[getattr(torch, args.dtype)]
    rows = asyncio.run(measure(args))
    lines = [
        f"base-only decode, {args.dtype}, {args.threads} thread(s), greedy streams of {args.new_tokens} tokens, "
        f"best of {args.reps} in turns; C layers up to {args.c_rows} rows, torch path from {TORCH_FROM + 1}",
        "| streams | C layers, tok/s | torch path, tok/s | C ÷ torch |",
        "|---|---|---|---|",
    ]
    for s, c, t in rows:
        lines.append(
            f"| {s} | {max(c):.1f} ({min(c):.1f}–{max(c):.1f}) | {max(t):.1f} ({min(t):.1f}–{max(t):.1f}) "
            f"| {max(c) / max(t):.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
