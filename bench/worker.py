"""Benchmark of the gpu_worker: ratios against the obvious baselines, measured in one run.

    python bench/worker.py                      # CPU, a small random model (< 3 min on 2 cores)
    python bench/worker.py --preset gpu         # CUDA, a ~0.4B random model in bf16
    python bench/worker.py --preset gpu7b       # CUDA, Llama-7B layer shapes (bench/gpu.sh)
    python bench/worker.py --base DIR --deltas DIR   # a real family (e.g. bitdelta.family.paths())

1. decode: tokens/s of a batch of 8 sequences of 8 different variants ÷ the same batch on the base
   (target ≥ 0.85 on GPU); and with V ∈ --variants distinct variants ÷ the memory limit b/(b + V/8),
   b the weights' bytes per parameter (2 in bf16, 4 in fp32)
   (target ≥ 0.9);
2. prefill: TTFT without queueing (the worker is idle) of a resident variant ÷ the base (target ≤ 1.10);
3. cold load: LoadDelta time ÷ (delta bytes ÷ disk bandwidth measured in this run, both with the
   page cache dropped for the file) (target ≤ 1.25);
4. memory: peak device memory with 14 resident deltas ÷ (base + 14 × delta file size) (target ≤ 1.05).
   On CUDA: torch.cuda.max_memory_allocated minus the KV pool (a separate, configured budget, reported).
   On CPU: the bytes of the worker's tensors (base, slot stacks, per-delta extras), and the process's
   RSS growth since before the worker started, for reference.
5. (--decode-batches 1,8,64) base-only decode tok/s at each batch size as a fraction of the memory
   limit: B × read bandwidth (measured in this run) ÷ (weight bytes + the batch's KV bytes).
6. (--cuda-graphs, last) 1's limit ratios and 5 again with each decode step's layers replayed as a
   CUDA graph (the worker's --cuda-graphs); a capture that fails is reported, not raised.

The worker runs in-process through `Worker.generate` / `load_delta` (the same code the gRPC
servicer calls), so the ratios measure the engine, not the transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from pagecache import evict  # noqa: E402  (bench/pagecache.py)

from bitdelta.format import load_delta, read_header, write_delta  # noqa: E402
from bitdelta_kernels import backend_for  # noqa: E402
from services.gpu_worker.runner import KVPool  # noqa: E402

PRESETS = {
    # ~93M params (a 12 MB delta): GEMMs, not Python, dominate a CPU step, and a load is not all fixed cost
    "cpu": dict(dim=1024, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=2752),
    # ~0.4B params in bf16 on one GPU
    "gpu": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, intermediate_size=5504),
    # Llama-7B layer shapes (4 of its 32 layers, random bf16 weights, byte vocabulary): the
    # kernels' share of a step is a 7B's; the ratios do not depend on the layer count
    "gpu7b": dict(dim=4096, n_layers=4, n_heads=32, n_kv_heads=32, intermediate_size=11008),
    # bench/gpu.sh --dry-run: the whole script end to end on CPU in seconds
    "tiny": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=344),
}
N_DELTAS = 14
BATCH = 8


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- the family ---------------------------------------------------------------------------------------


def build_family(root: Path, preset: dict) -> tuple[Path, Path, list[str]]:
    """A random base, one real fine-tune compressed, and 13 more deltas with the same
    structure (fresh random signs, scaled α): real delta files the worker loads like any other."""
    from bitdelta.compress import compress
    from bitdelta.testing.family import make_base, make_finetune, tiny_args

    args = tiny_args(
        dim=preset["dim"],
        n_layers=preset["n_layers"],
        n_heads=preset["n_heads"],
        n_kv_heads=preset["n_kv_heads"],
        intermediate_size=preset["intermediate_size"],
        max_seq_len=2048,
        eos_token_id=None,
    )  # no EOS: every sequence runs to max_new_tokens
    base = make_base(root / "base", args)
    ft = make_finetune(base, root / "ft", seed=1)
    deltas = root / "deltas"
    compress(base, ft, deltas / "v00.safetensors", variant="v00", progress=False)
    import shutil

    shutil.rmtree(ft)
    d = load_delta(deltas / "v00.safetensors")
    g = torch.Generator().manual_seed(0)
    for i in range(1, N_DELTAS):
        tensors = {}
        for p, cw in d.compressed.items():
            tensors[p + ".sign"] = torch.randint(0, 256, cw.signs.shape, dtype=torch.uint8, generator=g)
            tensors[p + ".alpha"] = cw.alpha * (1 + 0.01 * i)
        for p, t in d.dense.items():
            tensors[p + ".dense"] = t.clone()
        meta = d.meta
        meta.variant = f"v{i:02d}"
        write_delta(deltas / f"v{i:02d}.safetensors", tensors, meta)
    return base, deltas, [f"v{i:02d}" for i in range(N_DELTAS)]


# -- measurements -------------------------------------------------------------------------------------


def disk_bandwidth(files: list[Path]) -> float:
    """Bytes/s of plain cold reads of whole files (the page cache dropped for each).

    Measured on delta files themselves (ones the load test does not use): same size,
    same age and place on the disk as the loaded ones. A fresh or much larger probe
    file reads faster here (I/O ramp-up, the hypervisor's cache) and would blame
    the loader for the disk.
    """
    total = elapsed = 0.0
    for path in files:
        evict(path)
        nbytes = path.stat().st_size
        buf = bytearray(nbytes)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(buf)
            while n < nbytes and (k := f.readinto(memoryview(buf)[n:])) > 0:
                n += k
        elapsed += time.perf_counter() - t
        total += n
    return total / elapsed


async def run_one(worker, model_id: str, prompt: str, n: int) -> dict:
    from bitdelta.generation import Request, Sampling

    times, first = [], None
    async for ev in worker.generate(Request(model_id, prompt, Sampling(max_new_tokens=n))):
        times.append(time.perf_counter())
        if first is None:
            first = ev.ttft
    return {"times": times, "ttft": first}


async def decode_rate(worker, models: list[str], prompt: str, n: int) -> float:
    """Tokens/s of the decode phase (after every sequence has its first token) of one batch."""
    rs = await asyncio.gather(*[run_one(worker, m, prompt, n) for m in models])
    t0 = max(r["times"][0] for r in rs)
    t1 = max(r["times"][-1] for r in rs)
    toks = sum(sum(1 for t in r["times"] if t > t0) for r in rs)
    return toks / (t1 - t0)


def read_bandwidth(device: torch.device, reps: int = 5) -> float:
    """Bytes/s the device reads: the best of `reps` sums over a tensor far beyond any cache
    (2 GiB on CUDA, 512 MiB on CPU)."""
    n = (1 << 30) if device.type == "cuda" else (128 << 20)  # fp32 elements
    a = torch.ones(n, device=device)
    best = 1e9
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        a.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    del a
    return n * 4 / best


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def graph_measures(worker, res: dict, names: list[str], args) -> dict:
    """(--cuda-graphs) the decode measures of 1b and 1c again with each decode step's layers replayed
    as a CUDA graph (services/gpu_worker/graphs.py), against the eager numbers in `res`."""
    from services.gpu_worker.graphs import DecodeGraphs

    worker.runner.graphs = graphs = DecodeGraphs(worker.runner, worker.scheduler.max_running)
    if graphs.capture:  # as the worker's start-up does: no measure below pays a capture
        graphs.warm()
    g = {"decode_vs_hbm": {}, "decode_vs_limit": {}}
    for B, eager in res.get("decode_vs_hbm", {}).items():
        rate = statistics.median(
            [await decode_rate(worker, [""] * B, "Once upon a time", args.new_tokens) for _ in range(args.reps)]
        )
        g["decode_vs_hbm"][B] = {
            "tok_s": rate,
            "fraction": rate / eager["limit_tok_s"],
            "vs_eager": rate / eager["tok_s"],
        }
        log(f"graphs: decode batch {B} (base): {rate:.0f} tok/s; {rate / eager['limit_tok_s']:.2f} of the limit")
    for V, eager in res.get("decode_vs_limit", {}).items():
        models = [names[i % V] for i in range(BATCH)]
        rb = [await decode_rate(worker, [""] * BATCH, "Once upon a time", args.new_tokens) for _ in range(args.reps)]
        rv = [await decode_rate(worker, models, "Once upon a time", args.new_tokens) for _ in range(args.reps)]
        ratio = statistics.median(rv) / statistics.median(rb)
        g["decode_vs_limit"][V] = {"ratio": ratio, "fraction_of_limit": ratio / eager["limit"]}
        log(f"graphs: decode batch {BATCH} over {V} variants: {ratio / eager['limit']:.2f} of the limit")
    g["replays"], g["shapes"] = graphs.replays, len(graphs.shapes)  # 0: no step was served (CPU: the C layers)
    worker.runner.graphs = None
    return g


async def bench(args) -> dict:
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    preset = PRESETS[args.preset]
    tmp = None
    if args.base:
        base, deltas = Path(args.base), Path(args.deltas)
        names = sorted(p.name.split(".")[0] for p in deltas.iterdir() if p.suffix in (".safetensors", ".bitdelta"))
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-worker-", dir=args.workdir)
        t = time.perf_counter()
        base, deltas, names = build_family(Path(tmp.name), preset)
        log(f"family built in {time.perf_counter() - t:.1f}s")
    paths = {n: next(deltas.glob(f"{n}.*")) for n in names}
    size = statistics.mean(p.stat().st_size for p in paths.values())
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # bitdelta.precision's rule, as the worker's --dtype auto: bf16 on CUDA and on CPUs with native bf16
    # (BITDELTA_CPU_PRECISION overrides)
    from bitdelta.precision import serving_dtype

    dtype = args.dtype or serving_dtype(device).torch_name

    # the per-delta device cost, to size the budget for exactly N_DELTAS resident
    probe = Worker(WorkerConfig(base=base, device=device, dtype=dtype, delta_budget=0, kv_cache=args.kv_cache))
    from bitdelta.checkpoint import read_config
    from bitdelta.model import ModelArgs
    from services.gpu_worker.slots import SlotLayout

    layout = SlotLayout(ModelArgs.from_hf(read_config(base)), probe.dtype)
    hdr = read_header(paths[names[0]])
    cost = layout.slot_bytes + sum(
        layout.extra_bytes(t.param, t.role, t.shape)
        for t in hdr.tensors
        if t.param in ("model.embed_tokens.weight", "lm_head.weight")
    )
    n_res = min(N_DELTAS, len(names))
    cfg = WorkerConfig(
        base=base,
        delta_dir=str(deltas),
        device=device,
        dtype=dtype,
        delta_budget=n_res * cost,
        max_slots=n_res,
        kv_cache=args.kv_cache,
        max_batch_tokens=4096,
    )

    probe = [paths[n] for n in names[3:]] or [paths[n] for n in names]
    bw = disk_bandwidth(probe)
    res_bw = {"disk_bytes_per_s": bw}
    log(f"disk: {bw / 1e9:.2f} GB/s plain cold reads of {len(probe)} delta files of {size / 1e6:.1f} MB")

    rss0 = rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    worker = Worker(cfg)
    await worker.start()
    res: dict = {
        "device": device,
        "dtype": dtype,
        "base_bytes": worker.base.nbytes,
        "delta_file_bytes": size,
        "delta_device_bytes": cost,
        "kernels": backend_for(worker.device, 1 << 30, worker.kernel_backend),  # what a model-sized call runs
        **res_bw,
    }

    # 3. cold loads (the first delta loaded also pays one-time costs: it is loaded, evicted, reloaded)
    await worker.load_delta(names[0])
    await worker.evict_delta(names[0])
    loads = []
    for n in names[:3]:
        evict(paths[n])
        t = time.perf_counter()
        await worker.load_delta(n)
        dt = time.perf_counter() - t
        loads.append(dt / (paths[n].stat().st_size / bw))
        log(f"cold load {n}: {dt * 1e3:.1f} ms ({paths[n].stat().st_size / dt / 1e9:.2f} GB/s)")
    res["cold_load_ratio"] = statistics.median(loads)
    for n in names[3:n_res]:
        await worker.load_delta(n)
    assert worker.manager.used_bytes <= worker.manager.budget_bytes

    # warm-up: every code path once (kernel library, allocator)
    prompt = ("The quick brown fox jumps over the lazy dog. " * 40)[: args.prompt_len]
    await decode_rate(worker, names[:BATCH], "warm", 4)
    await run_one(worker, names[0], prompt, 1)
    await run_one(worker, "", prompt, 1)

    # 2. prefill / TTFT, alternating base and variant
    tb, tv = [], []
    for _ in range(args.reps + 2):
        tb.append((await run_one(worker, "", prompt, 1))["ttft"].total_ms)
        tv.append((await run_one(worker, names[0], prompt, 1))["ttft"].total_ms)
    res["ttft_base_ms"], res["ttft_variant_ms"] = statistics.median(tb), statistics.median(tv)
    res["prefill_ratio"] = res["ttft_variant_ms"] / res["ttft_base_ms"]
    log(
        f"TTFT ({len(worker.tokenizer.encode(prompt).ids)} tokens): base {res['ttft_base_ms']:.1f} ms, "
        f"variant {res['ttft_variant_ms']:.1f} ms"
    )

    # 1. decode, 8 variants vs 8 x base, alternating
    rb, rv = [], []
    for _ in range(args.reps):
        rb.append(await decode_rate(worker, [""] * BATCH, "Once upon a time", args.new_tokens))
        rv.append(await decode_rate(worker, names[:BATCH], "Once upon a time", args.new_tokens))
    res["decode_base_tok_s"], res["decode_variants_tok_s"] = statistics.median(rb), statistics.median(rv)
    res["decode_ratio"] = res["decode_variants_tok_s"] / res["decode_base_tok_s"]
    log(
        f"decode batch {BATCH}: base {res['decode_base_tok_s']:.0f} tok/s, "
        f"{BATCH} variants {res['decode_variants_tok_s']:.0f} tok/s"
    )

    # 1b. decode with V distinct variants against the memory limit: the base reads b B/param
    # (2 in bf16, 4 in fp32), each distinct variant adds 1/8 B/param, so the best a step can do is
    # b/(b + V/8) of base-only speed (target ≥ 0.9 of that at V = 1, 4, 8)
    es = res["weight_bytes_per_param"] = torch.tensor([], dtype=worker.dtype).element_size()
    res["decode_vs_limit"] = {}
    for V in args.variants:
        if V > n_res:
            continue
        models = [names[i % V] for i in range(BATCH)]
        rb, rv = [], []
        for _ in range(args.reps):
            rb.append(await decode_rate(worker, [""] * BATCH, "Once upon a time", args.new_tokens))
            rv.append(await decode_rate(worker, models, "Once upon a time", args.new_tokens))
        ratio = statistics.median(rv) / statistics.median(rb)
        limit = es / (es + V / 8)
        res["decode_vs_limit"][V] = {"ratio": ratio, "limit": limit, "fraction_of_limit": ratio / limit}
        log(
            f"decode batch {BATCH} over {V} variants: {ratio:.3f} of base-only; limit {limit:.3f}; "
            f"{ratio / limit:.2f} of the limit"
        )

    # 1c. decode on the base at batch B as a fraction of the memory limit: a step reads the base's
    # weights once (and each sequence's KV), so B tokens take at least bytes ÷ the device's read
    # bandwidth (measured here); what is left is per-step overhead (where it stands on a GPU)
    peak_before_probe = 0
    if args.decode_batches:
        if device == "cuda":  # the probe's 4 GiB tensor is not the worker's: keep it out of the peak below
            peak_before_probe = torch.cuda.max_memory_allocated()
        bw_dev = read_bandwidth(worker.device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res["read_bandwidth_bytes_per_s"] = bw_dev
        res["decode_vs_hbm"] = {}
        ctx = len(worker.tokenizer.encode("Once upon a time").ids) + args.new_tokens // 2  # mean context
        per_tok_kv = KVPool.bytes_per_token(worker.args, worker.dtype)
        for B in args.decode_batches:
            if B > worker.scheduler.max_running:
                continue
            rate = statistics.median(
                [await decode_rate(worker, [""] * B, "Once upon a time", args.new_tokens) for _ in range(args.reps)]
            )
            step_bytes = worker.base.nbytes + B * ctx * per_tok_kv
            limit = B * bw_dev / step_bytes
            res["decode_vs_hbm"][B] = {"tok_s": rate, "limit_tok_s": limit, "fraction": rate / limit}
            log(f"decode batch {B} (base): {rate:.0f} tok/s; memory limit {limit:.0f} tok/s; {rate / limit:.2f} of it")

    # 4. memory with n_res resident (after a mixed batch ran)
    kv_bytes = worker.kv.k.numel() * worker.kv.k.element_size() * 2
    want = worker.base.nbytes + n_res * size
    if device == "cuda":
        peak = max(peak_before_probe, torch.cuda.max_memory_allocated()) - kv_bytes
    else:
        extras = {
            id(t): t.numel() * t.element_size()
            for ex in worker.slots.extras.values()
            for bt in (ex.embed, ex.head)
            if bt is not None
            for t in (bt.weight, bt.signs, bt.alpha)
            if t is not None
        }
        peak = worker.base.nbytes + worker.slots.stack_bytes + sum(extras.values())
        res["rss_growth_bytes"] = rss_bytes() - rss0  # now, not the peak: ru_maxrss would include building the family
    res.update(
        resident=len([s for s in worker.manager.snapshot() if s.state.name == "RESIDENT"]),
        peak_bytes=peak,
        kv_pool_bytes=kv_bytes,
        memory_ratio=peak / want,
    )
    # 1d. last: a capture that fails on this GPU leaves every number above, and says why
    if args.cuda_graphs:
        try:
            res["graphs"] = await graph_measures(worker, res, names, args)
        except Exception as e:  # reported in the results, not raised
            worker.runner.graphs = None
            res["graphs"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"graphs: failed: {res['graphs']['error']}")
    await worker.close()
    if tmp is not None:
        tmp.cleanup()
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--base", help="a real base checkpoint (with --deltas: its delta directory)")
    p.add_argument("--deltas")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-cache", type=int, default=64 << 20)
    p.add_argument(
        "--decode-batches",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="base-only decode at these batch sizes as a fraction of the memory limit (e.g. 1,8,64)",
    )
    p.add_argument("--workdir", help="where to build the random family (default: the system temp dir)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument(
        "--variants",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 4, 8],
        help="distinct variants in a decode batch for the limit comparison (comma-separated)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also the decode measures with each step's layers replayed as a CUDA graph (the worker's --cuda-graphs)",
    )
    args = p.parse_args(argv)
    if bool(args.base) != bool(args.deltas):
        p.error("--base and --deltas go together")
    res = asyncio.run(bench(args))
    targets = {
        "decode_ratio": ">= 0.85 (GPU)",
        "prefill_ratio": "<= 1.10",
        "cold_load_ratio": "<= 1.25",
        "memory_ratio": "<= 1.05",
    }
    print(
        f"gpu_worker bench on {res['device']} ({res['dtype']}, kernels: {res['kernels']}), "
        f"base {res['base_bytes'] / 1e6:.1f} MB, delta {res['delta_file_bytes'] / 1e6:.2f} MB on disk"
    )
    print(f"{'metric':<18}{'ratio':>8}   target        detail")
    print(
        f"{'decode_ratio':<18}{res['decode_ratio']:>8.3f}   {targets['decode_ratio']:<13} "
        f"{res['decode_variants_tok_s']:.0f} vs {res['decode_base_tok_s']:.0f} tok/s, batch {BATCH}"
    )
    print(
        f"{'prefill_ratio':<18}{res['prefill_ratio']:>8.3f}   {targets['prefill_ratio']:<13} "
        f"TTFT {res['ttft_variant_ms']:.1f} vs {res['ttft_base_ms']:.1f} ms"
    )
    print(
        f"{'cold_load_ratio':<18}{res['cold_load_ratio']:>8.3f}   {targets['cold_load_ratio']:<13} "
        f"load time / (delta bytes / {res['disk_bytes_per_s'] / 1e9:.2f} GB/s plain cold read)"
    )
    print(
        f"{'memory_ratio':<18}{res['memory_ratio']:>8.3f}   {targets['memory_ratio']:<13} "
        f"{res['peak_bytes'] / 1e6:.1f} MB with {res['resident']} deltas (KV pool {res['kv_pool_bytes'] / 1e6:.0f} MB apart)"
    )
    b = res.get("weight_bytes_per_param")
    for V, r in res.get("decode_vs_limit", {}).items():
        print(
            f"{'decode V=' + str(V):<18}{r['fraction_of_limit']:>8.3f}   {'>= 0.9':<13} "
            f"{r['ratio']:.3f} of base-only; memory limit {b}/({b}+V/8) = {r['limit']:.3f}"
        )
    for B, r in res.get("decode_vs_hbm", {}).items():
        print(
            f"{'decode B=' + str(B):<18}{r['fraction']:>8.3f}   {'of the limit':<13} "
            f"{r['tok_s']:.0f} tok/s; weights + KV ÷ {res['read_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
            f"read bandwidth = {r['limit_tok_s']:.0f} tok/s"
        )
    if "error" in res.get("graphs", {}):
        print(f"{'graphs':<18}{'failed':>8}   {res['graphs']['error']}")
    for B, r in res.get("graphs", {}).get("decode_vs_hbm", {}).items():
        print(
            f"{'graphs B=' + str(B):<18}{r['fraction']:>8.3f}   {'of the limit':<13} {r['tok_s']:.0f} tok/s, {r['vs_eager']:.2f} x eager"
        )
    for V, r in res.get("graphs", {}).get("decode_vs_limit", {}).items():
        print(
            f"{'graphs V=' + str(V):<18}{r['fraction_of_limit']:>8.3f}   {'>= 0.9':<13} {r['ratio']:.3f} of base-only"
        )
    if "replays" in res.get("graphs", {}):
        print(
            f"{'':<18}{'':>8}   {'':<13} CUDA graphs: {res['graphs']['replays']} steps replayed over {res['graphs']['shapes']} shapes"
        )
    if "rss_growth_bytes" in res:
        print(
            f"{'':<18}{'':>8}   {'':<13} process RSS growth since start {res['rss_growth_bytes'] / 1e6:.0f} MB "
            "(incl. KV pool, activations, allocator caches)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
