"""Benchmark of the worker's prefix cache: TTFT of a request whose 512-token system prompt is cached
(a hit) ÷ the same request shape whose system prompt is new (a miss), measured in one run.

    python bench/prefix_cache.py                 # CPU: bench/worker.py's 93M random model, fp32
    python bench/prefix_cache.py --preset tiny   # seconds (a smoke run)

Each request is the system prompt + a short question of its own, `--new-tokens` tokens out, on an
idle worker (one request at a time, so TTFT is the prefill, not queueing). Misses use a fresh system
prompt each time (nothing cached); hits reuse one that was served once before. Also reported: the
same miss on a worker with --prefix-caching false (the cache's bookkeeping costs a miss nothing).
Target: hit ÷ miss ≤ 0.25 (the hit prefills the question and the system prompt's last partial block).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {  # bench/worker.py's
    "cpu": dict(dim=1024, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=2752),
    "tiny": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=344),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def text(rng: random.Random, n: int) -> str:
    """n byte tokens of the random family's byte tokenizer."""
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


async def ttfts(worker, prompts: list[str], new_tokens: int) -> list[float]:
    from bitdelta.generation import Request, Sampling

    out = []
    for p in prompts:
        async for ev in worker.generate(Request("", p, Sampling(max_new_tokens=new_tokens, ignore_eos=True))):
            if ev.ttft is not None:
                out.append(ev.ttft.total_ms)
    return out


async def bench(args) -> dict:
    from bitdelta.testing.family import make_base, tiny_args
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    pre = PRESETS[args.preset]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        base = make_base(
            Path(tmp) / "base", tiny_args(**pre, max_seq_len=2048, eos_token_id=None), seed=1
        )  # no EOS: every request runs to new_tokens
        rng = random.Random(0)
        res = {"preset": args.preset, "system_tokens": args.system_tokens, "reps": args.reps}
        for caching in (True, False):
            w = Worker(WorkerConfig(base=base, kv_cache=args.kv_cache, prefix_caching=caching))
            await w.start()
            try:
                await ttfts(w, [text(rng, args.system_tokens + 16)], 2)  # warm-up
                system = text(rng, args.system_tokens)
                await ttfts(w, [system + text(rng, 16)], 2)  # caches it
                misses = [text(rng, args.system_tokens) + text(rng, 16) for _ in range(args.reps)]
                hits = [system + text(rng, 16) for _ in range(args.reps)]
                miss, hit = [], []
                for m, h in zip(misses, hits):  # interleaved: drift on a shared machine hits both alike
                    miss += await ttfts(w, [m], args.new_tokens)
                    hit += await ttfts(w, [h], args.new_tokens)
                key = "on" if caching else "off"
                res[f"miss_ms_{key}"] = statistics.median(miss)
                res[f"hit_ms_{key}"] = statistics.median(hit)
                if caching:
                    st = w.status()
                    res["prefix_hits"], res["prefix_queries"] = st.prefix_hits, st.prefix_queries
            finally:
                await w.close()
        res["hit_over_miss"] = res["hit_ms_on"] / res["miss_ms_on"]
        res["miss_on_over_off"] = res["miss_ms_on"] / res["miss_ms_off"]
        return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kv-cache", type=int, default=64 << 20)
    p.add_argument("--workdir", help="where to build the random base (default: the system temp dir)")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = asyncio.run(bench(args))
    res["seconds"] = time.perf_counter() - t0
    print(f"TTFT, {args.system_tokens}-token system prompt + 16 tokens ({args.preset}, median of {args.reps}):")
    print(f"  miss {res['miss_ms_on']:.1f} ms, hit {res['hit_ms_on']:.1f} ms")
    print(f"  hit ÷ miss                  {res['hit_over_miss']:.3f}   (target ≤ 0.25)")
    print(f"  miss, cache on ÷ cache off  {res['miss_on_over_off']:.3f}   (≈ 1)")
    print(f"  prefix cache: {res['prefix_hits']} of {res['prefix_queries']} tokens found")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
