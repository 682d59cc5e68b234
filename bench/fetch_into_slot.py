"""A cold Fetch of a large delta into a worker's slot, as a ratio of the disk's raw sequential read.

    python bench/fetch_into_slot.py                 # a 7B-shaped delta of 24 layers (0.6 GB), 3 rounds
    python bench/fetch_into_slot.py --layers 32     # all 32 layers of a Llama-7B delta (0.8 GB)

The target (issue #12): a cold Fetch into the worker's slot at >= 0.8 x the
disk's raw sequential read of the same file, every byte verified.

What runs: a real delta store process (local backend, host cache, its cache in
shared memory under /dev/shm) and, in this process, the worker's own load path
(`DeltaStoreSource` -> `plan_delta` -> `Receiver` -> `SlotWriter` into a `SlotTensors` slot of
a Llama-7B-shaped layout on the CPU), exactly what `DeltaManager._load` runs.

"Cold" means: the store has seen the delta before (its sha256s were checked
once, at first sight, and its chunk crc32s recorded), but neither its host
cache nor the page cache holds it. Two deltas of the same size take turns in
a cache that holds one, so each fetch of one evicts the other; the file is
dropped from the page cache with posix_fadvise(DONTNEED) right before. The
disk's speed varies from minute to minute on a shared machine, so every fetch
is compared with a raw read of the same file (8 MiB `readinto`s) made cold
just before it, and the median ratio over the rounds is reported.

Rows: the same-host transport (the worker copies chunks out of the store's
shared memory, checking each chunk's crc32); the store alone on that path
(disk -> its shared cache entry, crc32s checked, a client that copies
nothing: where the time goes); the gRPC stream (chunks as messages); and the
worker reading the file itself (`--delta-dir`: sha256 of every tensor, no
store).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pagecache import evict  # noqa: E402  (bench/pagecache.py)

from bitdelta.format import DeltaMeta, write_delta  # noqa: E402
from bitdelta.model import ModelArgs  # noqa: E402
from bitdelta.rpc.clients.delta_store import DeltaStoreClient  # noqa: E402
from bitdelta.rpc.receiver import Receiver  # noqa: E402
from services.delta_store.backends import SUFFIX  # noqa: E402
from services.gpu_worker.loader import SlotWriter, plan_delta  # noqa: E402
from services.gpu_worker.slots import SlotLayout, SlotTensors  # noqa: E402
from services.gpu_worker.sources import DeltaStoreSource, LocalDeltaSource  # noqa: E402

GB = 1e9
BLOCK = 8 << 20
FP = "0" * 64


def llama7b(layers: int) -> ModelArgs:
    return ModelArgs(vocab_size=32000, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=32, intermediate_size=11008)


def generate(path: Path, layout: SlotLayout, seed: int) -> None:
    """A delta of every projection of the layout: random packed signs, row scales (as BitDelta ships them)."""
    rng = np.random.default_rng(seed)
    tensors, shapes = {}, {}
    for param, p in layout.proj.items():
        d_out = p.r1 - p.r0
        cols = (p.d_in + 7) // 8
        tensors[param + ".sign"] = torch.from_numpy(rng.integers(0, 256, (d_out, cols), dtype=np.uint8))
        tensors[param + ".alpha"] = torch.from_numpy(rng.random(d_out, dtype=np.float32) * 1e-3)
        shapes[param] = [d_out, p.d_in]
    meta = DeltaMeta(
        variant=path.stem,
        base_model="bench-llama-7b-shaped",
        base_fingerprint=FP,
        alpha_mode="row",
        architecture=layout.args.model_type,
        layout=layout.args.layout,
        shapes=shapes,
    )
    write_delta(path, tensors, meta)


def raw_cold_read(path: Path) -> float:
    evict(path)
    buf = memoryview(bytearray(BLOCK))
    t, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    speed = n / (time.perf_counter() - t)
    evict(path)
    return speed


def start_store(root: Path, cache_bytes: int, shm: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.delta_store",
            "--address",
            "127.0.0.1:0",
            "--root",
            str(root),
            "--cache-bytes",
            str(cache_bytes),
            "--pin-top-n",
            "0",
            "--shared-memory-dir",
            str(shm),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if "listening on port" in line:
            return proc, f"127.0.0.1:{int(line.split('listening on port')[1].split()[0])}"
    raise SystemExit(f"the delta store did not start (exit {proc.wait()})")


async def load(source, name: str, layout: SlotLayout, slots: SlotTensors) -> tuple[float, float, str]:
    """The worker's load path (DeltaManager._load without the bookkeeping): seconds, CPU seconds, transport."""
    t, c = time.perf_counter(), time.process_time()
    info = await source.open(name, FP)
    plan = plan_delta(layout, info)
    writer = SlotWriter(plan, slots, (0,))
    receiver = Receiver(plan.name, plan.tensors, writer, check_sha256=not info.verified)
    try:
        await source.stream(info, receiver)
        await receiver.finish()
        await writer.finish()
    except BaseException:
        receiver.abort()
        raise
    return time.perf_counter() - t, time.process_time() - c, info.transport


async def announce_only(client: DeltaStoreClient, name: str) -> tuple[float, float, str]:
    """A shared Fetch whose receiver copies nothing: how fast the store fills its entry from the disk."""
    t, c = time.perf_counter(), time.process_time()
    stream = await client.open_fetch(name, accept_shared_memory=True)
    try:
        async for _ in stream.chunks():
            pass
    finally:
        stream.cancel()
    return time.perf_counter() - t, time.process_time() - c, stream.transport


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder layers of the 7B-shaped delta (24: 0.6 GB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=ROOT / ".tmp" / "bench-fetch-into-slot")
    args = ap.parse_args()

    layout = SlotLayout(llama7b(args.layers), torch.float32)
    store_dir = args.dir / f"store-{args.layers}l"
    store_dir.mkdir(parents=True, exist_ok=True)
    paths = [store_dir / f"{n}{SUFFIX}" for n in ("a", "b")]
    for i, p in enumerate(paths):
        if not p.exists():
            print(f"generating {p} …", flush=True)
            generate(p, layout, seed=i)
    size = paths[0].stat().st_size
    print(
        f"delta: {size / GB:.3f} GB (Llama-7B-shaped signs + row scales, {args.layers} layers); "
        f"CPUs: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f} (a shared machine gives noisy numbers)"
    )

    a = layout.args
    slots = SlotTensors.allocate(
        layout,
        1,
        torch.device("cpu"),
        [{name: torch.ones(size) for name, size in a.layer_norms()}] * a.n_layers,
        torch.ones(a.dim),
    )
    for d in slots.signs:  # touch the slot's pages once, as a worker's slots are after their first load
        for t in d.values():
            t.fill_(1)
    shm = Path("/dev/shm") / f"bitdelta-bench-{os.getpid()}"
    proc, target = start_store(store_dir, size + (32 << 20), shm)
    rows: dict[str, list[tuple[float, float, float]]] = {}
    try:
        shared, stream = DeltaStoreSource(target, shared_memory=True), DeltaStoreSource(target, shared_memory=False)
        local, client = LocalDeltaSource(store_dir), DeltaStoreClient(target)
        for name in ("a", "b"):  # first sight: the store checks every sha256 and records the chunk crc32s
            secs, _, _ = await load(stream, name, layout, slots)
            print(
                f"  first sight of {name} (store: sha256 of every tensor)        {size / secs / GB:6.2f} GB/s",
                flush=True,
            )
        cases = [
            ("same-host: store's shared memory -> slot (crc32 per chunk)", lambda n: load(shared, n, layout, slots)),
            ("  the store alone: disk -> its shared entry (crc32s)", lambda n: announce_only(client, n)),
            ("gRPC stream: chunks as messages -> slot (crc32 per chunk)", lambda n: load(stream, n, layout, slots)),
            ("worker reads the file itself (--delta-dir, sha256 per tensor)", lambda n: load(local, n, layout, slots)),
        ]
        name = "a"
        for r in range(args.rounds):
            for label, run in cases:
                name, other = ("b", "a") if name == "a" else ("a", "b")
                await load(stream, other, layout, slots)  # `other` fills the store's cache: `name` is not in it
                raw = raw_cold_read(store_dir / f"{name}{SUFFIX}")
                secs, cpu, transport = await run(name)
                rows.setdefault(label, []).append((size / secs, raw, cpu / (size / GB)))
                print(
                    f"  round {r + 1}: {label:<64} {size / secs / GB:5.2f} GB/s  raw cold just before "
                    f"{raw / GB:5.2f} GB/s  ({transport})",
                    flush=True,
                )
        for c in (shared, stream, client):
            await c.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(shm, ignore_errors=True)

    print(
        f"\ncold Fetch of a {size / GB:.2f} GB delta into a worker slot, median of {args.rounds} rounds "
        "(the disk's speed swings between reads: each fetch is compared with a raw cold read just before it,"
    )
    print("and with the median of all raw cold reads of the run):")
    raws = [raw for got in rows.values() for _, raw, _ in got]
    for label, got in rows.items():
        speed = statistics.median(s for s, _, _ in got)
        print(
            f"  {label:<64} {speed / GB:5.2f} GB/s  {statistics.median(s / raw for s, raw, _ in got):5.2f} x raw just "
            f"before  {speed / statistics.median(raws):5.2f} x median raw  "
            f"cpu here {statistics.median(c for _, _, c in got):4.2f} s/GB"
        )
    print(
        f"  raw cold sequential read (8 MiB readinto), median of {len(raws)}: {statistics.median(raws) / GB:5.2f} GB/s"
    )


if __name__ == "__main__":
    asyncio.run(main())
