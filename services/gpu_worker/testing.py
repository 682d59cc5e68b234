"""Helpers for the worker's tests and benchmark: a tiny family whose greedy
outputs vary (so "same tokens" is a meaningful assertion), its delta files
(good, for another base, corrupted), the offline dense references, and a
worker running on a loopback port.

Nothing here is a mock: real checkpoints, real delta files, a real gRPC server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from bitdelta.checkpoint import save_checkpoint
from bitdelta.compress import apply, compress
from bitdelta.format import DELTA_SUFFIX as SUFFIX  # the delta store's object suffix; the local source reads it too
from bitdelta.format import read_header
from bitdelta.model import ModelArgs, init_random, state_dict_for_save
from bitdelta.testing import make_finetune, tiny_args, write_byte_tokenizer

# std 0.02 (bitdelta.testing's default) makes a tiny random model repeat one
# token under greedy decoding; at 0.2 its outputs vary from token to token.
TEST_STD = 0.2
FT_SCALE = 0.02


@dataclass
class WorkerFamily:
    base: Path
    deltas: Path  # directory of <name>.safetensors
    variants: list[str]  # names of good deltas
    merged: dict[str, Path]  # name -> dense checkpoint W_base + α·S (bitdelta.compress.apply)
    other_base: str  # a delta built against a different base
    corrupt: str  # a delta with one flipped data byte

    def delta_path(self, name: str) -> Path:
        return self.deltas / f"{name}{SUFFIX}"


def make_base(out: Path, args: ModelArgs, seed: int) -> Path:
    model = init_random(args, seed=seed, std=TEST_STD)
    save_checkpoint(state_dict_for_save(model), out, args.to_hf())
    write_byte_tokenizer(out)
    return out


def make_test_family(
    root: Path, n_variants: int = 3, args: ModelArgs | None = None, merged: bool = True, seed: int = 1
) -> WorkerFamily:
    root = Path(root)
    args = args or tiny_args()
    base = make_base(root / "base", args, seed)
    deltas = root / "deltas"
    names, dense = [], {}
    for i in range(n_variants):
        name = f"v{i}"
        ft = make_finetune(base, root / f"ft{i}", seed=100 + i, scale=FT_SCALE)
        # one variant with a per-matrix α, the others per row: both paths are served
        compress(
            base, ft, deltas / f"{name}{SUFFIX}", alpha_mode="matrix" if i == 2 else "row", variant=name, progress=False
        )
        shutil.rmtree(ft)
        if merged:
            dense[name] = apply(base, deltas / f"{name}{SUFFIX}", root / f"merged{i}", progress=False)
        names.append(name)
    other = make_base(root / "other_base", args, seed + 1000)
    oft = make_finetune(other, root / "other_ft", seed=7, scale=FT_SCALE)
    compress(other, oft, deltas / f"otherbase{SUFFIX}", variant="otherbase", progress=False)
    shutil.rmtree(oft)
    # corrupt: a copy of v0 with one byte of a sign tensor flipped (header and size intact)
    bad = deltas / f"corrupt{SUFFIX}"
    shutil.copy(deltas / f"v0{SUFFIX}", bad)
    header = read_header(bad)
    t = next(t for t in header.tensors if t.name.endswith(".sign"))
    with open(bad, "r+b") as f:
        f.seek(t.start + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.start + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    return WorkerFamily(base, deltas, names, dense, "otherbase", "corrupt")


def offline_generate(ckpt: Path, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """Greedy tokens of a dense checkpoint through `bitdelta.model` (the reference for variants)."""
    from bitdelta.model import load_model

    return load_model(ckpt).generate(prompt, n, stop_ids=(eos,) if eos is not None else ())


@contextlib.asynccontextmanager
async def running_worker(config):
    """A started worker behind a gRPC server on a free loopback port; yields (worker, server, channel)."""
    from services.gpu_worker.server import create_server, start_worker
    from services.gpu_worker.worker import Worker

    config = dataclasses.replace(config, address="127.0.0.1:0")
    worker = Worker(config)
    server = create_server(worker, config.address)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await start_worker(worker, server)
        yield worker, server, channel
    finally:
        await channel.close()
        await server.stop(0)
        await worker.close()
