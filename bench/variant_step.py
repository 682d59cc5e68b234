"""Where a variant's decode step goes, in one process: the worker's engine as `python -m
services.gpu_worker` builds it (CPU, the real base in data/base, the family's deltas in data/deltas),
greedy streams of the base and of variants taken in turns, each part of a step in the engine
thread's CPU time (time.thread_time around the runner's parts, which run on that thread).

    python bench/variant_step.py [--dtype float32] [--reps 7] [--tokens 16]

Rows: one stream of the base, one of a variant (`--variant`), with `--lora R` one of a LoRA
adapter of rank R on every projection (random factors, seeded, imported by `bitdelta import-lora`;
its row ends with its bytes' limit: the base's weights ÷ those + the factors), 8 streams of the
base, 8 over 4 variants; columns: ms per decode step of the engine thread (`engine`), the C decode layers, the
LM head (`_logits`: the base's head and each variant's sign planes on it), `prepare` (the step's
index tensors), the embedding, the rest (sampling, scheduling, Python glue: engine minus the
parts, so it can come out below 0 when each part's best rep is another); and the tokens/s ratio
to the base's row of the same batch size. A part's number is its best of --reps (in turns): on a
shared machine CPU time still grows with the memory traffic of other jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Once upon a time, in a small village by the sea, there lived"
PARTS = ("engine", "layers", "head", "prepare", "embed")


def timed(owner, name: str, key: str, acc: dict) -> None:
    """Accumulate the calling thread's CPU time in `owner.name` under acc[key]."""
    f = getattr(owner, name)

    def g(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.thread_time() - t

    setattr(owner, name, g)


async def measure(args) -> dict[str, list[float]]:
    import torch

    from bitdelta.generation import Request, Sampling
    from bitdelta_kernels import cpu_decode
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.runner import ModelRunner
    from services.gpu_worker.worker import Worker

    torch.set_num_threads(args.threads)
    acc: dict[str, float] = collections.defaultdict(float)
    # every C call the runner binds, then makes: a step's, and a burst's of greedy steps
    timed(cpu_decode._Bound, "__call__", "layers", acc)
    timed(cpu_decode._BoundSteps, "__call__", "layers", acc)
    timed(ModelRunner, "_logits", "head", acc)
    timed(ModelRunner, "prepare", "prepare", acc)
    timed(ModelRunner, "_embed", "embed", acc)
    cfg = WorkerConfig(  # no prefix cache: both runs of a row compute the same prefill
        base=args.base,
        delta_dir=str(args.deltas),
        dtype=args.dtype,
        device="cpu",
        kv_cache=64 << 20,
        prefix_caching=False,
    )
    w = Worker(cfg)
    await w.start()
    try:
        clock = time.pthread_getcpuclockid(w.engine._thread.ident)

        async def one(model: str, n: int) -> None:
            async for _ in w.generate(Request(model, PROMPT, Sampling(max_new_tokens=n, ignore_eos=True))):
                pass

        names = sorted(p.name.split(".")[0] for p in args.deltas.glob("*.bitdelta.safetensors"))
        four = [args.variant] + [n for n in names if n != args.variant and n != LORA][:3]
        for m in ["", *four]:  # loaded, and every lazy set-up done
            await one(m, 3)
        runs = {"base": [""], args.variant: [args.variant]}
        if args.lora:
            await one(LORA, 3)
            runs[LORA] = [LORA]
        runs |= {"8 base": [""] * 8, "8 over 4 variants": four * 2}
        res: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list) for k in runs}
        for _ in range(args.reps):
            for k, models in runs.items():
                got = {}
                for n in (1, args.tokens + 1):  # the prefill and first token apart: minus a 1-token run
                    acc.clear()
                    c0 = time.clock_gettime(clock)
                    await asyncio.gather(*[one(m, n) for m in models])
                    got[n] = dict(acc, engine=time.clock_gettime(clock) - c0)
                for p in PARTS:
                    res[k][p].append((got[args.tokens + 1].get(p, 0.0) - got[1].get(p, 0.0)) / args.tokens * 1e3)
        return res
    finally:
        await w.close()


LORA = "lora"  # the --lora variant's name


def with_lora(args, work: Path) -> Path:
    """A delta directory of `args.deltas`' files (links) and a LoRA adapter of rank `args.lora` on
    every projection of the base (`bitdelta.testing.family.make_lora`), imported."""
    from bitdelta.lora_import import import_lora
    from bitdelta.testing.family import make_lora

    out = work / "deltas"
    out.mkdir()
    for f in args.deltas.glob("*.bitdelta.safetensors"):
        (out / f.name).symlink_to(f.resolve())
    adapter = make_lora(args.base, work / "adapter", args.lora)
    import_lora(args.base, adapter, out / f"{LORA}.bitdelta.safetensors", variant=LORA)
    return out


def lora_limit(args) -> float:
    """The LoRA row's tokens/s limit ÷ the base's: the base's bytes of a decode step (every tensor
    of the checkpoint once, in the dtype: a tied embedding is read as the head) ÷ those + the factors' (fp16)."""
    from bitdelta.checkpoint import CheckpointReader
    from bitdelta.format import read_header

    es = 4 if args.dtype == "float32" else 2
    with CheckpointReader(args.base) as rb:
        n = sum(math.prod(rb.shape(k)) for k in rb.keys())
    factors = read_header(args.deltas / f"{LORA}.bitdelta.safetensors").bytes_by_role()["lowrank"]
    return n * es / (n * es + factors)


def table(res: dict, args) -> str:
    lines = [
        f"ms of the engine thread's CPU time per decode step, {args.dtype}, best of {args.reps} reps of "
        f"{args.tokens} steps (in turns)",
        f"{'':20s}" + "".join(f"{p:>9s}" for p in (*PARTS, "rest")) + "  tok/s ÷ base",
    ]
    base = {}
    for k, r in res.items():
        v = [min(r[p]) for p in PARTS]
        ref = base.setdefault(k.startswith("8"), v[0])
        limit = f" (limit {lora_limit(args):.3f})" if k == LORA else ""
        lines.append(
            f"{k:20s}" + "".join(f"{x:9.2f}" for x in v) + f"{v[0] - sum(v[1:]):9.2f}  {ref / v[0]:.3f}{limit}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "data" / "base")
    ap.add_argument("--deltas", type=Path, default=ROOT / "data" / "deltas")
    ap.add_argument("--variant", default="writer")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="also a rank-R LoRA adapter's row")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as work:
        if args.lora:
            args.deltas = with_lora(args, Path(work))
        print(table(asyncio.run(measure(args)), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
