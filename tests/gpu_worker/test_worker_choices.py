"""n choices and echo's prompt logprobs inside one worker, with prefill in chunks (a small
--max-batch-tokens) so the prompt's logits rows span steps and the forked block is a partial one."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from bitdelta.generation import Request, Sampling
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.worker import Worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # the C kernels (the Triton interpreter took ~37 s here)
PROMPT = "a prompt of thirty bytes, or so"  # byte tokens: three 8-token chunks and a partial KV block
N = 8


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("choices"), n_variants=1, merged=False)


async def _run(family):
    w = Worker(WorkerConfig(base=family.base, delta_dir=str(family.deltas), kv_cache=4 << 20, max_batch_tokens=8))
    await w.start()
    try:

        async def gen(sp: Sampling, model: str = "v0"):
            return [e async for e in w.generate(Request(model, PROMPT, sp))]

        out = {}
        sp = Sampling(max_new_tokens=N, temperature=0.8, seed=7, ignore_eos=True)
        before = w.engine.prefill_tokens
        out["choices"] = await gen(dataclasses.replace(sp, n=3))
        out["prefilled"] = w.engine.prefill_tokens - before
        out["alone"] = [await gen(dataclasses.replace(sp, seed=sp.choice_seed(i))) for i in range(3)]
        out["echo"] = await gen(Sampling(max_new_tokens=2, prompt_logprobs=2, logprobs=2), model="")
        agen = w.generate(Request("v0", PROMPT, dataclasses.replace(sp, n=3, max_new_tokens=200)))
        await anext(agen)
        await agen.aclose()  # cancelled mid-stream: every choice leaves, every block returns
        for _ in range(100):
            if w.scheduler.allocator.n_free == w.scheduler.allocator.n_blocks:
                break
            await asyncio.sleep(0.05)
        out["free"] = (w.scheduler.allocator.n_free, w.scheduler.allocator.n_blocks)
        out["prompt_ids"] = w.tokenizer.encode(PROMPT).ids
        return out
    finally:
        await w.close()


def test_choices_share_a_chunked_prefill_and_echo_logprobs_span_the_chunks(family):
    out = asyncio.run(_run(family))
    ids = out["prompt_ids"]
    assert len(ids) > 16 and len(ids) % 16, "more than one chunk, a partial KV block"
    assert out["prefilled"] == len(ids), "three choices, one prefill"
    by_choice = {i: [e.token_id for e in out["choices"] if e.index == i] for i in range(3)}
    assert [by_choice[i] for i in range(3)] == [[e.token_id for e in a] for a in out["alone"]]
    assert len({tuple(t) for t in by_choice.values()}) > 1
    assert out["free"][0] == out["free"][1]

    from transformers import LlamaForCausalLM

    first = out["echo"][0]
    lps = first.prompt_logprobs
    assert len(lps) == len(ids) and [lp.sampled.token_id for lp in lps] == ids
    assert math.isnan(lps[0].sampled.logprob) and all(e.prompt_logprobs == () for e in out["echo"][1:])
    hf = LlamaForCausalLM.from_pretrained(str(family.base), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # row j predicts ids[j + 1]
    for j in range(1, len(ids)):
        assert abs(lps[j].sampled.logprob - float(ref[j - 1, ids[j]])) < 1e-3, j
        want = ref[j - 1].topk(2)
        assert [t.token_id for t in lps[j].top] == want.indices.tolist(), j
    assert abs(first.logprobs.sampled.logprob - float(ref[-1, first.token_id])) < 1e-3
