"""Fetch throughput of the delta store, as ratios of what the hardware gives in the same run.

    python bench/delta_store.py --size-gb 1                 # local backend, then Swift (started here)
    python bench/delta_store.py --size-gb 1 --backends local

For one generated delta of --size-gb (kept in --dir between runs):
- baselines: raw sequential read of the file (8 MiB `readinto`s into one
  buffer), cold and warm; memcpy; for Swift, one streaming GET of the object;
- "store": the service's fetch path in-process (backend -> verify -> cache ->
  chunks with crc32), cache miss and cache hit, with and without sha256
  verification of backend reads;
- "gRPC": the same through a server process on loopback, counting bytes
  (the transport's share), and `fetch_into` (the client's checks as well).

Cold vs warm: dropping the page cache needs privileges, so "cold" evicts
this one file with posix_fadvise(POSIX_FADV_DONTNEED), which any user may do
for a file they can open; the kernel honours it for clean pages. Each cold
number is measured right after such an eviction, each warm one right after a
full read. Swift keeps its objects on the same disk, so its reads are warm
or cold in the same sense; the script evicts Swift's object files too when it
started Swift itself (it knows where they are).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from pagecache import evict  # noqa: E402  (bench/pagecache.py)

from bitdelta.cache_policy import WeightedLRUPolicy  # noqa: E402
from bitdelta.format import V1_LAYOUT, DeltaMeta, write_delta  # noqa: E402
from services.delta_store.backends import SUFFIX  # noqa: E402
from services.delta_store.backends.local import LocalBackend  # noqa: E402
from services.delta_store.cache import HostCache  # noqa: E402
from services.delta_store.store import DeltaStore  # noqa: E402

GB = 1e9
BLOCK = 8 << 20


def generate(path: Path, size_gb: float) -> None:
    """A delta of about size_gb laid out like a Llama-7B BitDelta (random bytes, valid format).

    Per layer: q/k/v/o signs of 2 MiB and gate/up/down signs of 5.4 MiB, row scales;
    plus two dense tensors (embeddings, LM head) of 20% each, as in the published 7B delta.
    """
    target = int(size_gb * GB)
    g = torch.Generator().manual_seed(0)
    tensors, shapes = {}, {}
    dense = target // 5
    for p in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[p + ".dense"] = torch.randint(0, 256, (dense // 4096, 4096), dtype=torch.uint8, generator=g).view(
            torch.bfloat16
        )
    left, layer = target - 2 * dense, 0
    proj = [
        ("self_attn.q_proj", 4096, 4096),
        ("self_attn.k_proj", 4096, 4096),
        ("self_attn.v_proj", 4096, 4096),
        ("self_attn.o_proj", 4096, 4096),
        ("mlp.gate_proj", 11008, 4096),
        ("mlp.up_proj", 11008, 4096),
        ("mlp.down_proj", 4096, 11008),
    ]
    while left > 0:
        for name, d_out, d_in in proj:
            p = f"model.layers.{layer}.{name}.weight"
            tensors[p + ".sign"] = torch.randint(0, 256, (d_out, (d_in + 7) // 8), dtype=torch.uint8, generator=g)
            tensors[p + ".alpha"] = torch.rand(d_out, generator=g)
            shapes[p] = [d_out, d_in]
            left -= d_out * ((d_in + 7) // 8) + 4 * d_out
        layer += 1
    meta = DeltaMeta(
        variant=path.stem,
        base_model="bench-7b-like",
        base_fingerprint="0" * 64,
        alpha_mode="row",
        architecture="llama",
        layout=V1_LAYOUT,
        shapes=shapes,
    )
    write_delta(path, tensors, meta)


def raw_read(path: Path) -> float:
    buf = memoryview(bytearray(BLOCK))
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n / (time.perf_counter() - t)


def memcpy_speed(path: Path, piece: int = 1 << 20) -> float:
    """Copy the delta's bytes (in memory) piece by piece into one reused buffer: what a cache hit must at least do."""
    src = memoryview(bytearray(path.read_bytes()))
    dst = bytearray(piece)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        for o in range(0, len(src) - piece + 1, piece):
            dst[:] = src[o : o + piece]
        best = max(best, (len(src) // piece * piece) / (time.perf_counter() - t))
    return best


class Speed(float):
    """GB/s, with the CPU seconds this process spent per GB (all its threads)."""

    cpu_per_gb: float | None = None


async def store_fetch(store: DeltaStore, name: str) -> Speed:
    t, c = time.perf_counter(), time.process_time()
    n = 0
    async with await store.fetch(name) as stream:
        async for chunk in stream:
            n += len(chunk.data)
    speed = Speed(n / (time.perf_counter() - t))
    speed.cpu_per_gb = (time.process_time() - c) / (n / GB)
    return speed


async def drop(store: DeltaStore, name: str) -> None:
    """Evict `name` once its load has finished, so the next miss can reuse its buffer."""
    e = store.cache.entries.get(name)
    if e is not None and e.loader is not None:
        await asyncio.gather(e.loader, return_exceptions=True)
    store.cache.drop(name)


def new_store(backend, size: int, verify: bool) -> DeltaStore:
    return DeltaStore(backend, HostCache(WeightedLRUPolicy(size + (64 << 20))), verify_reads=verify)


async def grpc_fetch(target: str, name: str) -> float:
    import grpc

    from bitdelta.delta_store.v1 import delta_store_pb2 as pb
    from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
    from bitdelta.rpc.wire.delta_store import MAX_MESSAGE_BYTES

    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    ) as ch:
        t = time.perf_counter()
        n = 0
        async for m in pb_grpc.DeltaStoreServiceStub(ch).Fetch(pb.FetchRequest(name=name), timeout=600):
            n += len(m.chunk.data)
    return n / (time.perf_counter() - t)


async def client_fetch(target: str, name: str) -> float:
    from bitdelta.rpc.clients.delta_store import DeltaStoreClient

    async with DeltaStoreClient(target) as c:
        n = 0

        def on_tensor(i, t, buf):
            nonlocal n
            n += t.nbytes

        t = time.perf_counter()
        await c.fetch_into(name, on_tensor)
    return n / (time.perf_counter() - t)


def start_server(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.delta_store", "--address", "127.0.0.1:0", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    for line in proc.stdout:
        if "listening on port" in line:
            return proc, f"127.0.0.1:{int(line.split('listening on port')[1].split()[0])}"
    raise SystemExit(f"the delta store did not start (exit {proc.wait()})")


def row(label: str, speed: float, base: float | None = None, base_label: str = "") -> None:
    ratio = f"{speed / base:5.2f} × {base_label}" if base else ""
    cpu = getattr(speed, "cpu_per_gb", None)
    cpu = f"cpu {cpu:4.2f} s/GB" if cpu is not None else ""
    print(f"  {label:<58} {speed / GB:6.2f} GB/s  {cpu:<15} {ratio}", flush=True)


async def bench_local(path: Path, size: int) -> None:
    name = path.name[: -len(SUFFIX)]
    backend = LocalBackend(path.parent)
    print(f"\nlocal backend: {path} ({size / GB:.2f} GB)")
    evict(path)
    raw_cold = raw_read(path)
    raw_warm = max(raw_read(path), raw_read(path))
    mem = memcpy_speed(path)
    row("raw sequential read, cold file (fadvise DONTNEED)", raw_cold)
    row("raw sequential read, warm file (page cache)", raw_warm)
    row("memcpy of the delta in 1 MiB pieces (in memory)", mem)

    # first sight of the file: every tensor's sha256 (the chunk crc32s are recorded for later reads)
    store = new_store(backend, size, True)
    evict(path)
    raw_cold = raw_read(path)
    evict(path)
    row(
        "store fetch, cold file, first sight (sha256 of every tensor)",
        await store_fetch(store, name),
        raw_cold,
        "raw cold just before",
    )
    await drop(store, name)
    for verify in (True, False):
        tag = "verified (crc32s recorded at first sight)" if verify else "no verify"
        store = new_store(backend, size, verify)
        raw_read(path)
        first = await store_fetch(store, name)  # the cache's memory is allocated (and faulted in) here
        if verify:
            row("store fetch, cache miss into fresh memory, warm file", first, raw_warm, "raw warm")
        await drop(store, name)  # from here on, misses reuse the dropped entry's buffer, as under churn
        evict(path)
        raw_cold = raw_read(path)  # the disk's speed varies: compare with a read right before
        evict(path)
        row(
            f"store fetch, cache miss, cold file, {tag}",
            await store_fetch(store, name),
            raw_cold,
            "raw cold just before",
        )
        await drop(store, name)
        raw_read(path)
        row(f"store fetch, cache miss, warm file, {tag}", await store_fetch(store, name), raw_warm, "raw warm")
        if verify:
            hit = max([await store_fetch(store, name) for _ in range(2)], key=float)
            row("store fetch, cache hit", hit, mem, "memcpy")
        await drop(store, name)

    proc, target = start_server(["--root", str(path.parent), "--cache-bytes", str(size + (64 << 20))])
    try:
        raw_read(path)
        row(
            "gRPC loopback fetch (bytes counted), cache miss, warm file",
            await grpc_fetch(target, name),
            raw_warm,
            "raw warm",
        )
        row("gRPC loopback fetch (bytes counted), cache hit", await grpc_fetch(target, name), mem, "memcpy")
        row("client fetch_into (crc32 + sha256 checks), cache hit", await client_fetch(target, name), mem, "memcpy")
    finally:
        proc.terminate()
        proc.wait()


async def bench_s3(path: Path, size: int, endpoint: str | None, swift_dir: Path | None) -> None:
    import boto3
    from botocore.config import Config as BotoConfig

    from services.delta_store.backends.s3 import S3Backend

    name = path.name[: -len(SUFFIX)]
    creds = dict(aws_access_key_id="test:tester", aws_secret_access_key="testing")
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=BotoConfig(s3={"addressing_style": "path"}),
        **creds,
    )
    bucket = "bench-deltas"
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    print(f"\nS3 backend (Swift {endpoint}): uploading {size / GB:.2f} GB …", flush=True)
    t = time.perf_counter()
    from boto3.s3.transfer import TransferConfig

    s3.upload_file(str(path), bucket, name + SUFFIX, Config=TransferConfig(multipart_chunksize=64 << 20))
    print(
        f"  upload (boto3 multipart, 64 MiB parts)                     {size / (time.perf_counter() - t) / GB:6.2f} GB/s"
    )
    objects = list(swift_dir.glob("srv/**/*.data")) if swift_dir else []

    def swift_evict():
        if objects:
            evict(*objects)

    def raw_get() -> float:
        buf = bytearray(BLOCK)
        t = time.perf_counter()
        n = 0
        body = s3.get_object(Bucket=bucket, Key=name + SUFFIX)["Body"]
        raw = body._raw_stream  # urllib3's response: readinto without an extra copy
        while k := raw.readinto(buf):
            n += k
        body.close()
        return n / (time.perf_counter() - t)

    swift_evict()
    get_cold = raw_get()
    get_warm = max(raw_get(), raw_get())
    mem = memcpy_speed(path)
    row("raw GET of the object, one stream, cold" + ("" if objects else " (not evicted)"), get_cold)
    row("raw GET of the object, one stream, warm", get_warm)
    backend = S3Backend(
        bucket,
        endpoint=endpoint,
        access_key=creds["aws_access_key_id"],
        secret_key=creds["aws_secret_access_key"],
        timeout_s=30,
    )
    for verify in (True, False):
        tag = "sha256 verify" if verify else "no verify"
        store = new_store(backend, size, verify)
        await store_fetch(store, name)  # allocates the cache's memory
        await drop(store, name)
        swift_evict()
        row(f"store fetch, cache miss, cold, {tag}", await store_fetch(store, name), get_cold, "raw GET cold")
        await drop(store, name)
        row(f"store fetch, cache miss, warm, {tag}", await store_fetch(store, name), get_warm, "raw GET warm")
        if verify:
            row(
                "store fetch, cache hit",
                max([await store_fetch(store, name) for _ in range(2)], key=float),
                mem,
                "memcpy",
            )
        await drop(store, name)
    await backend.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="size of the generated delta (default 1)")
    ap.add_argument("--dir", type=Path, default=ROOT / ".tmp" / "bench-delta-store", help="where the delta is kept")
    ap.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument(
        "--s3-endpoint", help="use this S3 endpoint (key test:tester / secret testing) instead of starting Swift"
    )
    args = ap.parse_args()

    store_dir = args.dir / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    path = store_dir / f"bench-{args.size_gb:g}gb{SUFFIX}"
    if not path.exists():
        print(f"generating a {args.size_gb:g} GB delta at {path} …", flush=True)
        generate(path, args.size_gb)
    size = path.stat().st_size
    print(f"delta {path.name}: {size / GB:.3f} GB; CPUs: {os.cpu_count()} (shared machines give noisy numbers)")

    backends = args.backends.split(",")
    if "local" in backends:
        await bench_local(path, size)
    if "s3" in backends:
        if args.s3_endpoint:
            await bench_s3(path, size, args.s3_endpoint, None)
        else:
            script = ROOT / "scripts" / "swift.sh"
            subprocess.run(["bash", str(script), "install"], check=True)
            d = Path(tempfile.mkdtemp(prefix="bench-swift-"))
            subprocess.run(
                ["bash", str(script), "start", str(d)],
                check=True,
                env={
                    **os.environ,
                    "SWIFT_PROXY_PORT": "18480",
                    "SWIFT_OBJECT_PORT": "18400",
                    "SWIFT_CONTAINER_PORT": "18401",
                    "SWIFT_ACCOUNT_PORT": "18402",
                },
            )
            try:
                await bench_s3(path, size, "http://127.0.0.1:18480", d)
            finally:
                subprocess.run(["bash", str(script), "stop", str(d)], check=False)
                subprocess.run(["rm", "-rf", str(d)], check=False)


if __name__ == "__main__":
    asyncio.run(main())
