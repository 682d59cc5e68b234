"""A fine-tune that ends its answers on its own token (its config's eos_token_id is not the base's,
as a chat fine-tune of a pretrained base often does) ends there when the worker serves it, as it
would served alone: the reference is transformers' generate on `bitdelta apply`'s dense checkpoint,
which stops on that checkpoint's own eos_token_id. The base, and a variant without its own, go on.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from bitdelta.compress import apply, compress
from bitdelta.generation import FinishReason, Request, Sampling
from bitdelta.testing.family import make_base, make_finetune
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import running_worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")
aio = pytest.mark.asyncio(loop_scope="module")

OWN_EOS = 258  # <|im_end|> of the tiny family's tokenizer; the base ends on 256
PROMPT = [256, 104, 105, 32, 116]
N = 8
# the token gets a large bias, so that each model produces it as soon as min_tokens lets it end
BIAS, MIN = 60.0, 2


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_eos")
    base = make_base(root / "base", seed=3)
    deltas = root / "deltas"
    chat = make_finetune(base, root / "chat", seed=11)
    cfg = json.loads((chat / "config.json").read_text())
    (chat / "config.json").write_text(json.dumps({**cfg, "eos_token_id": OWN_EOS}))
    compress(base, chat, deltas / "chat.bitdelta.safetensors", variant="chat", progress=False)
    plain = make_finetune(base, root / "plain", seed=12)
    compress(base, plain, deltas / "plain.bitdelta.safetensors", variant="plain", progress=False)
    return base, deltas, root


def reference(ckpt, sampling: Sampling) -> list[int]:
    """transformers' greedy tokens with the same bias and min_tokens, stopping on the checkpoint's EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_tokens,
            do_sample=False,
            sequence_bias={(OWN_EOS,): BIAS},
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


@aio
async def test_a_variant_ends_on_its_own_eos_and_the_base_does_not(family, tmp_path):
    base, deltas, root = family
    sampling = Sampling(max_new_tokens=N, logit_bias=((OWN_EOS, BIAS),), min_tokens=MIN)
    config = WorkerConfig(base=str(base), delta_dir=str(deltas), delta_budget=4 << 20, kv_cache=4 << 20)
    async with running_worker(config) as (worker, _, _):

        async def run(model: str) -> tuple[list[int], FinishReason]:
            events = [ev async for ev in worker.generate(Request(model, "", sampling, prompt_token_ids=tuple(PROMPT)))]
            return [ev.token_id for ev in events], events[-1].finish_reason

        chat, why = await run("chat")
        assert why is FinishReason.EOS and chat[-1] == OWN_EOS and len(chat) == MIN + 1
        assert chat == reference(apply(base, deltas / "chat.bitdelta.safetensors", tmp_path / "chat"), sampling)
        for model in ("", "plain"):  # their EOS is the base's: the biased token is just a token
            tokens, why = await run(model)
            assert why is FinishReason.LENGTH and len(tokens) == N and tokens.count(OWN_EOS) >= N - MIN, model
        plain_dense = apply(base, deltas / "plain.bitdelta.safetensors", tmp_path / "plain")
        assert tokens == reference(plain_dense, sampling)
        # both kinds in one batch: each row ends on its own model's EOS
        both = [worker.generate(Request(m, "", sampling, prompt_token_ids=tuple(PROMPT))) for m in ("chat", "plain")]
        outs = await asyncio.gather(*[_collect(g) for g in both])
        assert outs[0] == chat and outs[1] == tokens


async def _collect(gen) -> list[int]:
    return [ev.token_id async for ev in gen]


def test_a_delta_ending_on_a_token_outside_the_vocabulary_is_refused(family):
    """The header is checked before any byte moves (a hand-edited or foreign file)."""
    from bitdelta.arch import ModelArgs
    from bitdelta.checkpoint import read_config
    from bitdelta.format import DeltaFormatError, read_header
    from services.gpu_worker.loader import plan_delta
    from services.gpu_worker.slots import SlotLayout
    from services.gpu_worker.sources import DeltaInfo, TensorSpec

    base, deltas, _ = family
    args = ModelArgs.from_hf(read_config(base))
    h = read_header(deltas / "chat.bitdelta.safetensors")
    specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes, h.sha256[t.name], t.start) for t in h.tensors]
    meta = h.meta
    info = DeltaInfo(
        "chat", specs, architecture=meta.architecture, layout=meta.layout, eos_token_ids=(args.vocab_size,)
    )
    with pytest.raises(DeltaFormatError, match="not below the base's vocabulary size"):
        plan_delta(SlotLayout(args, torch.float32), info)
