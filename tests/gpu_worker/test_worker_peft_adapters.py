"""What real PEFT adapters carry besides LoRA factors, served as PEFT serves it: adapters made and
saved by PEFT itself (`get_peft_model`, `save_pretrained`) on tiny transformers bases, imported by
`bitdelta import-lora`, served by a real worker on a loopback port; the reference is PEFT's own
model (`PeftModel.from_pretrained` on the base, unmerged).

Covered: `modules_to_save` (the LM head, the embedding, norms, Qwen3's q/k norms), embedding LoRA,
LoRA on a tied LM head, `ensure_weight_tying`, trained biases (`bias="all"`, `"lora_only"`) and
`lora_bias`, Phi-3's fused projections, on bases with a tied embedding (Llama 3.2), q/k/v biases
(Qwen2.5), fused matrices (Phi-3), q/k norms (Qwen3), sparse layers (Mixtral: LoRA on attention) and a
biased head (Phi-2: its head saved whole, bias included). Each variant's logits
through `bitdelta apply`'s dense model equal PEFT's, and the worker's greedy tokens equal PEFT's,
each variant alone and all in one batch with the base. The factors are made fp16-exact (and every
scale a power of two), so the file's one fp16 rounding changes nothing and the comparison is tight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import warnings

import pytest
import pytest_asyncio
import torch

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.compress import apply
from bitdelta.format import read_header
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.lora_import import import_lora
from bitdelta.shard import EMBED, HEAD
from services.gpu_worker.config import WorkerConfig
from tests.support.archs import EOS, hf_model, make_hf_base
from tests.support.worker import running_worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")

N = 12
T = 60
SUFFIX = ".bitdelta.safetensors"
PROMPT = "The adapter says"
BASES = (
    "llama-3.2",
    "qwen2.5",
    "phi3-mini",
    "qwen3",
    "gemma3-mm",
    "mixtral",
    "qwen2-moe",
    "ministral3-mm",
    "starcoder2",
    "cohere2",
    "phi",
    "gpt-neox",
    "falcon-7b",
    "gptj",
)


def each_layer(*params: str) -> set[str]:
    """`params` of both layers of the tiny bases."""
    return {f"model.layers.{i}.{p}" for i in range(2) for p in params}


# name -> (base, LoraConfig's arguments beyond r = 4 and lora_alpha = 8, what the file must hold densely)
ADAPTERS = {
    "embed_lora": ("llama-3.2", dict(target_modules=["q_proj", "v_proj", "embed_tokens"]), {EMBED, HEAD}),
    "norms_saved": (
        "llama-3.2",
        dict(target_modules=["k_proj"], modules_to_save=["model.norm", "post_attention_layernorm"]),
        {"model.norm.weight", *each_layer("post_attention_layernorm.weight")},
    ),
    "head_saved": ("llama-3.2", dict(target_modules=["gate_proj"], modules_to_save=["lm_head"]), {HEAD}),
    "head_lora": ("llama-3.2", dict(target_modules=["o_proj", "lm_head"]), {HEAD}),
    "embed_saved": ("llama-3.2", dict(target_modules=["up_proj"], modules_to_save=["embed_tokens"]), {EMBED, HEAD}),
    "tied_saved": (
        "llama-3.2",
        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True),
        {EMBED},
    ),
    "bias_all": (
        "qwen2.5",
        dict(target_modules=["q_proj", "gate_proj"], bias="all"),
        each_layer("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "bias_lora_only": (
        "qwen2.5",
        dict(target_modules=["k_proj", "down_proj"], bias="lora_only"),
        each_layer("self_attn.k_proj.bias"),  # down_proj has none
    ),
    "lora_bias": (
        "qwen2.5",
        dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
        each_layer("self_attn.q_proj.bias", "self_attn.v_proj.bias"),
    ),
    "fused": ("phi3-mini", dict(target_modules=["qkv_proj", "gate_up_proj"]), set()),  # Phi-3's fused matrices
    # Gemma 3 as it ships (Gemma3ForConditionalGeneration): q_proj matches the vision tower's too, which
    # a text prompt never reaches; the text model's q/k norms saved
    "gemma3_mm": (
        "gemma3-mm",
        dict(target_modules=["q_proj", "down_proj"], modules_to_save=["q_norm"]),
        each_layer("self_attn.q_norm.weight"),
    ),
    # Ministral 3 as it ships (Mistral3ForConditionalGeneration): q_proj matches the Pixtral tower's too
    "mistral3_mm": ("ministral3-mm", dict(target_modules=["q_proj", "v_proj", "up_proj"]), set()),
    # a mixture of experts: LoRA on its attention (PEFT's LoRA of experts, target_parameters, is refused)
    "moe_attention": ("mixtral", dict(target_modules=["q_proj", "o_proj"]), set()),
    # Qwen2-MoE's shared expert and its gate are plain linear modules: LoRA on them (the routed experts'
    # fused tensors are not modules, so gate_proj/up_proj/down_proj match the shared expert's alone)
    "moe_shared_expert": (
        "qwen2-moe",
        dict(target_modules=["v_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"]),
        set(),
    ),
    "qk_norms_saved": (
        "qwen3",
        dict(target_modules=["o_proj"], modules_to_save=["q_norm", "k_norm"]),
        each_layer("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    ),
    # StarCoder2's ungated MLP (c_fc, c_proj) and a saved LayerNorm, its bias too
    "ungated_mlp": (
        "starcoder2",
        dict(target_modules=["q_proj", "c_fc", "c_proj"], modules_to_save=["input_layernorm"]),
        each_layer("input_layernorm.weight", "input_layernorm.bias"),
    ),
    # Cohere 2's parallel block: the attention's and the MLP's LoRA read the one input norm
    "parallel_block": ("cohere2", dict(target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]), set()),
    # Phi-2 as its LoRA recipes tune it (q, k, v, dense, fc1, fc2), its biased head saved whole
    "phi_head_saved": (
        "phi",
        dict(target_modules=["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], modules_to_save=["lm_head"]),
        {HEAD, "lm_head.bias"},
    ),
    # GPT-NeoX's fused, head-interleaved query_key_value: its B's rows split into q, k and v (one A), and the
    # trained biases (the fused one's split too)
    # Falcon-7B's multi-query query_key_value (all q heads, then one k, one v): B's rows split the same way
    "falcon_fused": ("falcon-7b", dict(target_modules=["query_key_value", "dense_h_to_4h"]), set()),
    # GPT-J under its own names (transformer.h.N.attn.q_proj, mlp.fc_in), its biased head saved whole
    "gptj_head_saved": (
        "gptj",
        dict(target_modules=["q_proj", "v_proj", "fc_in"], modules_to_save=["lm_head"]),
        {HEAD, "lm_head.bias"},
    ),
    "neox_fused": (
        "gpt-neox",
        dict(target_modules=["query_key_value", "dense", "dense_4h_to_h"], bias="lora_only"),
        each_layer(*(f"self_attn.{p}_proj.bias" for p in "qkv"), "self_attn.dense.bias", "mlp.dense_4h_to_h.bias"),
    ),
}


def make_adapter(base, out, seed: int, **config):
    """A PEFT adapter of random trained weights: LoRA factors, saved modules and biases perturbed,
    every factor exactly an fp16 value."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on tied layers and gradient checkpointing
        model = get_peft_model(hf_model(base), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
                    if "lora_" in name:
                        p.copy_(p.half().float())
        model.save_pretrained(out)
    return out


def peft_model(base, adapter):
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(hf_model(base), adapter).eval()


def greedy(model, prompt: str, n: int = N) -> list[int]:
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, pad_token_id=EOS + 1)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_family")
    bases = {name: make_hf_base(root / name, name, seed=5) for name in BASES}
    adapters = {}
    for i, (name, (arch, config, _)) in enumerate(ADAPTERS.items()):
        adapters[name] = make_adapter(bases[arch], root / "adapters" / name, 20 + i, **config)
        import_lora(bases[arch], adapters[name], root / arch / "deltas" / f"{name}{SUFFIX}")
    return root, bases, adapters


def test_the_file_holds_what_peft_changes_and_its_model_is_peft_s(family):
    root, bases, adapters = family
    ids = torch.tensor([list(PROMPT.encode())])
    for name, (arch, _, dense) in ADAPTERS.items():
        file = root / arch / "deltas" / f"{name}{SUFFIX}"
        names = {t.name.removesuffix(".dense") for t in read_header(file).tensors if t.name.endswith(".dense")}
        assert names == dense, (name, names)
        with torch.no_grad():
            want = peft_model(bases[arch], adapters[name])(ids).logits
            got = hf_model(apply(bases[arch], file, root / "dense" / name, progress=False))(ids).logits
            plain = hf_model(bases[arch])(ids).logits
        assert (want - plain).abs().max() > 0.1, f"{name} changes the model"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    """A worker per base, serving its adapters' files."""
    root, _, _ = family
    async with contextlib.AsyncExitStack() as stack:
        stubs = {}
        for arch in BASES:
            cfg = WorkerConfig(base=root / arch, delta_dir=str(root / arch / "deltas"), kv_cache=4 << 20)
            _, _, channel = await stack.enter_async_context(running_worker(cfg))
            stubs[arch] = pb_grpc.GpuWorkerServiceStub(channel)
        yield stubs


async def generate(stub, model_id: str, prompt: str) -> list[int]:
    req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=N))
    return [t.token_id async for m in stub.Generate(req, timeout=T) for t in m.tokens]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("arch", BASES)
async def test_the_worker_serves_peft_s_tokens_alone_and_in_one_batch(served, family, arch):
    _, bases, adapters = family
    names = [n for n, (a, _, _) in ADAPTERS.items() if a == arch]
    want = {n: greedy(peft_model(bases[arch], adapters[n]), PROMPT) for n in names}
    want[""] = greedy(hf_model(bases[arch]), PROMPT)
    assert len({tuple(v) for v in want.values()}) == len(want), "every variant answers its own tokens"
    stub = served[arch]
    assert {n: await generate(stub, n, PROMPT) for n in want} == want
    together = await asyncio.gather(*[generate(stub, n, PROMPT) for n in want])
    assert dict(zip(want, together)) == want


def test_what_the_base_cannot_carry_is_refused_by_name_and_merging_reads_factors_only(family, tmp_path):
    from bitdelta.merge.adapter import load_adapter

    _, bases, adapters = family
    llama = bases["llama-3.2"]

    def resized(base, out):  # the base with 8 more tokens, as a fine-tune adding special tokens makes it
        model = hf_model(base)
        model.resize_token_embeddings(model.config.vocab_size + 8)
        model.save_pretrained(out)
        return out

    cases = [
        (
            make_adapter(llama, tmp_path / "a", 1, target_modules=["q_proj"], lora_bias=True),
            "q_proj.bias, which is not",
        ),
        (make_adapter(llama, tmp_path / "b", 2, target_modules=["k_proj"], modules_to_save=["q_proj"]), "saved whole"),
        (
            make_adapter(
                resized(llama, tmp_path / "big"),
                tmp_path / "c",
                3,
                target_modules=["q_proj"],
                modules_to_save=["embed_tokens"],
            ),
            "a resized vocabulary",
        ),
        (
            make_adapter(llama, tmp_path / "d", 4, target_modules=["q_proj"], trainable_token_indices=[1, 2]),
            "trainable_token_indices",
        ),
    ]
    no_r = make_adapter(llama, tmp_path / "e", 5, target_modules=["q_proj"])
    config = json.loads((no_r / "adapter_config.json").read_text())
    (no_r / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "r"}))
    cases.append((no_r, "needs an integer r"))
    experts = make_adapter(bases["mixtral"], tmp_path / "f", 6, target_parameters=["experts.gate_up_proj"])
    cases.append((experts, "LoRA on bare parameters .target_parameters, e.g. MoE experts. is not supported"))
    for adapter, words in cases:
        out = tmp_path / f"{adapter.name}{SUFFIX}"
        with pytest.raises(ValueError, match=words):
            import_lora(bases["mixtral"] if adapter is experts else llama, adapter, out)
        assert not out.exists()
    # merging (bitdelta merge) works on factors: what is not a factor is refused there
    with pytest.raises(ValueError, match="modules_to_save"):
        load_adapter(adapters["head_saved"])
    for name in ("embed_lora", "bias_all", "lora_bias"):
        with pytest.raises(ValueError, match="is not a lora_A/lora_B weight"):
            load_adapter(adapters[name])
