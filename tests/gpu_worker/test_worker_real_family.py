"""The worker on the real model: the SmolLM2-135M base and real deltas (the family's when
built, else short real fine-tunes; see conftest `real_deltas`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.gpu_worker.config import WorkerConfig
from tests.support.worker import offline_generate, running_worker

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("cpu_kernels")]  # kernels by device (conftest)
N = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):", "ROMEO:"]


async def test_real_family_matches_references_alone_and_mixed(tmp_path, real_base, real_deltas):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from bitdelta.compress import apply
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

    v0, v1 = sorted(real_deltas)[:2]
    prompts = {"": PROMPTS[0], v0: PROMPTS[1], v1: PROMPTS[2]}
    tok = Tokenizer.from_file(str(real_base / "tokenizer.json"))
    eos = 2
    cfg = WorkerConfig(base=real_base, delta_dir=str(real_deltas[v0].parent), delta_budget=1 << 30, kv_cache=32 << 20)
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m, p):
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=N))
            return [t.token_id async for x in stub.Generate(req, timeout=300) for t in x.tokens]

        alone = {m: await gen(m, p) for m, p in prompts.items()}
        mixed = await asyncio.gather(*[gen(m, p) for m, p in prompts.items()])
    assert list(alone.values()) == mixed
    ids = tok.encode(prompts[""]).ids
    hf = LlamaForCausalLM.from_pretrained(str(real_base), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=eos)[
            0, len(ids) :
        ].tolist()
    del hf
    assert alone[""] == want
    for v in (v0, v1):
        dense = apply(real_base, real_deltas[v], tmp_path / v, progress=False)
        assert alone[v] == offline_generate(dense, tok.encode(prompts[v]).ids, N, eos)


async def test_real_tokenizer_constrained_json_validates(real_base, real_deltas):
    """Constrained decoding with the real base's 49,152-token BPE vocabulary (the tiny family's tests
    have one byte per token): the base and a variant, greedy and sampled, in one batch, each output
    ends with EOS and validates against a bounded schema."""
    import json

    import jsonschema

    from bitdelta.generation import Constraint, ConstraintKind, FinishReason, Request, Sampling

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Lyon", "Nice"]},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": False,
    }
    c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    prompt = (
        "<|im_start|>user\nDescribe Ann, 31, from Lyon, who likes chess, as JSON.<|im_end|>\n<|im_start|>assistant\n"
    )
    v0 = sorted(real_deltas)[0]
    cfg = WorkerConfig(base=real_base, delta_dir=str(real_deltas[v0].parent), delta_budget=1 << 30, kv_cache=32 << 20)
    async with running_worker(cfg) as (worker, _, _):

        async def gen(model: str, temperature: float, seed: int | None):
            s = Sampling(max_new_tokens=200, temperature=temperature, seed=seed, constraint=c)
            evs = [ev async for ev in worker.generate(Request(model, prompt, s, templated=True))]
            return "".join(ev.text for ev in evs), evs[-1].finish_reason

        outs = await asyncio.gather(*[gen(m, t, s) for m in ("", v0) for t, s in ((0.0, None), (1.0, 1), (1.0, 2))])
    for text, finish in outs:
        assert finish is FinishReason.EOS, text
        jsonschema.validate(json.loads(text), schema)
    assert any("Ann" in text for text, _ in outs), outs  # the model's own words, within the grammar
