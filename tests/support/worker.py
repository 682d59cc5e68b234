"""The worker's test helpers: the offline dense reference of a variant, and a worker running
on a loopback port (a real gRPC server; the families are `bitdelta.testing.family`'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import grpc


def offline_generate(ckpt: Path, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """Greedy tokens of a dense checkpoint through `bitdelta.model` (the reference for variants)."""
    from bitdelta.model import load_model

    return load_model(ckpt).generate(prompt, n, stop_ids=(eos,) if eos is not None else ())


async def start_worker(worker, server) -> None:
    """Load the base, then report SERVING (what `serve` does at start-up)."""
    await worker.start()
    await server.set_serving(True)


async def drain_and_stop(worker, server, grace_s: float) -> None:
    """What `serve` does on SIGTERM: health NOT_SERVING, new requests refused (UNAVAILABLE),
    running streams finish for up to `grace_s`, then stop."""
    worker.begin_drain()
    await server.drain(grace_s)
    await worker.close()


@contextlib.asynccontextmanager
async def running_worker(config):
    """A started worker behind a gRPC server on a free loopback port; yields (worker, server, channel)."""
    from services.gpu_worker.server import create_server
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


def delta_device_bytes(family) -> int:
    """Device bytes one of a tiny family's deltas costs a worker in fp32: its slot plus its
    embedding/head tensors (what the byte budget counts)."""
    import torch

    from bitdelta.format import read_header
    from services.gpu_worker.runner import BaseWeights
    from services.gpu_worker.slots import SlotLayout

    _, args = BaseWeights.load(family.base, torch.float32, torch.device("cpu"))
    layout = SlotLayout(args, torch.float32)
    return layout.slot_bytes + sum(
        layout.extra_bytes(t.param, t.role, t.shape)
        for t in read_header(family.delta_path("v0")).tensors
        if t.param in ("model.embed_tokens.weight", "lm_head.weight")
    )
