"""What the router hop costs: its added latency to first token, and throughput through it, each
against calling the workers directly, measured in one run on loopback.

Starts a delta store, two workers and the router as processes (the tiny random family with
`--variants` variants, so the hop is a visible share of the time; on a real model it is smaller),
then
1. latency: `--requests` sequential one-token requests, alternating router / direct worker call
   for the same variant (resident), p50 and p99 of the time to first token, and their ratio;
2. throughput: `--concurrency` clients, each sending requests for random variants for
   `--seconds`, through the router, then straight to the workers (each client picks a worker at
   random, as a router-less deployment would): requests/s and tokens/s, and their ratio.

    python bench/router.py [--variants 8] [--requests 200] [--concurrency 16] [--seconds 10] \
        [--out bench/results/router_cpu_<date>.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta.common.v1 import generation_pb2 as gen_pb  # noqa: E402
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb  # noqa: E402
from bitdelta.rpc.clients.router import RouterClient  # noqa: E402
from bitdelta.rpc.clients.worker import WorkerClient  # noqa: E402
from bitdelta.testing.report import save as save_report  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def ttft_router(r: RouterClient, model: str) -> float:
    t = time.perf_counter()
    async for _ in r.generate(model, "Hello world", max_new_tokens=1):
        return (time.perf_counter() - t) * 1e3
    raise RuntimeError("no token")


async def ttft_worker(w: WorkerClient, model: str) -> float:
    req = wpb.GenerateRequest(model_id=model, prompt="Hello world", sampling=gen_pb.SamplingParams(max_new_tokens=1))
    t = time.perf_counter()
    async for _ in w.generate(req):
        return (time.perf_counter() - t) * 1e3
    raise RuntimeError("no token")


async def load(send, variants: list[str], concurrency: int, seconds: float) -> tuple[float, float]:
    """(requests/s, tokens/s) of `concurrency` closed-loop clients for `seconds`."""
    done = tokens = 0
    stop = time.perf_counter() + seconds

    async def client(seed: int):
        nonlocal done, tokens
        rng = random.Random(seed)
        while time.perf_counter() < stop:
            n = await send(rng.choice(variants), rng)  # (not `tokens += await ...`: that reads before awaiting)
            tokens, done = tokens + n, done + 1

    t = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(concurrency)])
    wall = time.perf_counter() - t
    return done / wall, tokens / wall


async def run(a: argparse.Namespace) -> dict:
    from bitdelta.testing.cluster import Cluster
    from bitdelta.testing.family import make_test_family

    with tempfile.TemporaryDirectory() as tmp:
        fam = make_test_family(Path(tmp) / "family", n_variants=a.variants, merged=False)
        for bad in (fam.corrupt, fam.other_base):
            os.remove(fam.delta_path(bad))
        with Cluster(Path(tmp) / "cluster") as c:
            st = c.store(fam.deltas)
            ws = [c.worker(fam.base, st.address, name=f"worker{i}", delta_budget="64MiB") for i in range(2)]
            r = c.router([w.address for w in ws], st.address)
            c.wait_serving(st, *ws, r)
            async with RouterClient(r.address) as router:
                workers = [WorkerClient(w.address) for w in ws]
                while not all(w.up for w in await router.list_workers()):
                    await asyncio.sleep(0.1)
                models = ["", *fam.variants]
                for m in models:  # warm: every delta resident on both workers, kernels touched
                    for w in workers:
                        await ttft_worker(w, m)
                    await ttft_router(router, m)
                via, direct = [], []
                for i in range(a.requests):
                    m = models[i % len(models)]
                    home = (await anext(router.generate(m, "x", max_new_tokens=1))).worker
                    w = next(x for x in workers if x.target == home)
                    via.append(await ttft_router(router, m))
                    direct.append(await ttft_worker(w, m))

                async def send_router(m, rng):
                    stream = router.generate(m, "The quick brown fox", max_new_tokens=a.tokens)
                    return sum([len(x.tokens) async for x in stream])

                async def send_direct(m, rng):
                    req = wpb.GenerateRequest(
                        model_id=m,
                        prompt="The quick brown fox",
                        sampling=gen_pb.SamplingParams(max_new_tokens=a.tokens),
                    )
                    return len([x async for x in rng.choice(workers).generate(req)])

                thr_router = await load(send_router, models, a.concurrency, a.seconds)
                thr_direct = await load(send_direct, models, a.concurrency, a.seconds)
                for w in workers:
                    await w.close()
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "variants": a.variants,
        "requests": a.requests,
        "concurrency": a.concurrency,
        "seconds": a.seconds,
        "tokens_per_request": a.tokens,
        "ttft_ms": {
            "router_p50": statistics.median(via),
            "router_p99": pct(via, 0.99),
            "direct_p50": statistics.median(direct),
            "direct_p99": pct(direct, 0.99),
        },
        "throughput": {
            "router_req_s": thr_router[0],
            "router_tok_s": thr_router[1],
            "direct_req_s": thr_direct[0],
            "direct_tok_s": thr_direct[1],
        },
    }


def report(res: dict) -> str:
    t, h = res["ttft_ms"], res["throughput"]
    return "\n".join(
        [
            f"router benchmark, {res['date']}, {res['machine']}, tiny random family with {res['variants']} variants, "
            "store + 2 workers + router as processes on loopback",
            f"time to first token, {res['requests']} sequential requests (resident variants):",
            f"  p50: router {t['router_p50']:.2f} ms vs direct {t['direct_p50']:.2f} ms -> "
            f"ratio {t['router_p50'] / t['direct_p50']:.2f} (+{t['router_p50'] - t['direct_p50']:.2f} ms)",
            f"  p99: router {t['router_p99']:.2f} ms vs direct {t['direct_p99']:.2f} ms -> "
            f"ratio {t['router_p99'] / t['direct_p99']:.2f} (+{t['router_p99'] - t['direct_p99']:.2f} ms)",
            f"throughput, {res['concurrency']} concurrent clients x {res['seconds']:.0f} s, random variants, "
            f"{res['tokens_per_request']} tokens each:",
            f"  router {h['router_req_s']:.1f} req/s ({h['router_tok_s']:.0f} tok/s) vs direct {h['direct_req_s']:.1f} req/s "
            f"({h['direct_tok_s']:.0f} tok/s) -> ratio {h['router_tok_s'] / h['direct_tok_s']:.2f}",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, help="write the report here (and the numbers as .json beside it)")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    save_report(a.out, text, res)


if __name__ == "__main__":
    main()
