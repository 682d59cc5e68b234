"""The worker on the real family (SmolLM2-135M base + fine-tuned variants in data/, built by
`bitdelta.family`). Skipped where the family has not been built."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bitdelta.family import paths
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.testing import offline_generate, running_worker

FAMILY = paths()
READY = [v for v in FAMILY.variants if FAMILY.deltas[v].is_file()]
pytestmark = [pytest.mark.skipif(not (FAMILY.base / "config.json").is_file() or len(READY) < 2,
                                 reason="the real family (data/) is not built"),
              pytest.mark.asyncio]  # fmt: skip
N = 12
PROMPTS = {"": "The capital of France is", READY[0] if READY else "-": "def fibonacci(n):",
           READY[1] if len(READY) > 1 else "--": "ROMEO:"}  # fmt: skip


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    monkeypatch.setenv("BITDELTA_KERNEL_BACKEND", "cpu")


async def test_real_family_matches_references_alone_and_mixed(tmp_path):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from bitdelta.compress import apply
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

    tok = Tokenizer.from_file(str(FAMILY.base / "tokenizer.json"))
    eos = 2
    cfg = WorkerConfig(base=FAMILY.base, delta_dir=str(FAMILY.deltas[READY[0]].parent), delta_budget=1 << 30,
                       kv_cache=32 << 20)
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m, p):
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=N))
            return [x.token_id async for x in stub.Generate(req, timeout=300)]

        alone = {m: await gen(m, p) for m, p in PROMPTS.items()}
        mixed = await asyncio.gather(*[gen(m, p) for m, p in PROMPTS.items()])
    assert list(alone.values()) == mixed
    ids = tok.encode(PROMPTS[""]).ids
    hf = LlamaForCausalLM.from_pretrained(str(FAMILY.base), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist()  # fmt: skip
    del hf
    assert alone[""] == want
    v = READY[0]
    dense = apply(FAMILY.base, FAMILY.deltas[v], tmp_path / v, progress=False)
    assert alone[v] == offline_generate(dense, tok.encode(PROMPTS[v]).ids, N, eos)
    assert alone[v] != alone[""]
