"""A mixed batch through the worker with the Triton kernels (in the interpreter on CPU,
compiled on CUDA): the same tokens as the C CPU path and as the offline dense model."""

from __future__ import annotations

import asyncio

import pytest

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import offline_generate, running_worker

N = 4  # the interpreter costs ~1 s per layer call: a few tokens are enough


def triton_config(fam) -> WorkerConfig:
    """A worker of `fam` forced onto the Triton kernels (the interpreter on CPU: conftest sets
    TRITON_INTERPRET=1)."""
    return WorkerConfig(
        base=fam.base,
        delta_dir=str(fam.deltas),
        delta_budget=4 << 20,
        kv_cache=4 << 20,
        dtype="float32",
        kernel_backend="triton",
    )


@pytest.mark.asyncio
async def test_mixed_batch_through_triton_kernels(tmp_path):
    fam = make_test_family(tmp_path, n_variants=2)
    cfg = triton_config(fam)
    jobs = [("", "Hello"), ("v0", "abc"), ("v1", "xyz")]
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m, p):
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=N))
            return [t.token_id async for x in stub.Generate(req, timeout=600) for t in x.tokens]

        outs = await asyncio.gather(*[gen(m, p) for m, p in jobs])
    for (m, p), got in zip(jobs, outs):
        ckpt = fam.base if m == "" else fam.merged[m]
        assert got == offline_generate(ckpt, list(p.encode()), N, 256), m


@pytest.mark.asyncio
async def test_a_prefill_chunk_beside_other_rows_takes_the_unpacked_gemms(tmp_path, monkeypatch):
    """A prompt of ≥ unpack_min_rows tokens shares its first step with two short ones: its chunk's
    planes go through the unpacked GEMMs (`plan_batch`'s unpacked slot sets), the other rows through
    the kernels, and every request's tokens are the dense model's."""
    import torch

    from bitdelta_kernels import dispatch
    from bitdelta_kernels.configs import config_for

    calls = []
    unpacked = dispatch._delta_unpacked
    monkeypatch.setattr(dispatch, "_delta_unpacked", lambda *a: calls.append(a[3]) or unpacked(*a))
    fam = make_test_family(tmp_path, n_variants=2)
    cfg = triton_config(fam)
    long = "The quick brown fox jumps over the lazy dog; " * (
        config_for(torch.device("cpu"))["unpack_min_rows"] // 40 + 1
    )
    jobs = [("", "Hello"), ("v0", long), ("v1", "xyz")]
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m, p):
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=2))
            return [t.token_id async for x in stub.Generate(req, timeout=600) for t in x.tokens]

        outs = await asyncio.gather(*[gen(m, p) for m, p in jobs])
    assert calls and all(len(s) == 1 and s[0] >= 0 for s in calls)  # the chunk's one slot, per projection
    for (m, p), got in zip(jobs, outs):
        ckpt = fam.base if m == "" else fam.merged[m]
        assert got == offline_generate(ckpt, list(p.encode()), 2, 256), m
