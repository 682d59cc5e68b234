"""The model description of every supported family (bitdelta.arch) and the one forward pass
(bitdelta.model) against transformers itself: tiny random bases built with transformers' own
config classes, logits compared in fp32 at a context past the rope's original length; every
config field that changes the forward pass is honoured or refused by name."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch

from bitdelta.arch import ModelArgs, UnsupportedModel, implied_tensors
from bitdelta.checkpoint import read_config
from bitdelta.model import load_model
from tests.support.archs import (
    COMMON,
    FAMILY_MEMBERS,
    LONG,
    ORIGINAL,
    ROPE_MEMBERS,
    VOCAB,
    hf_greedy,
    hf_model,
    make_hf_base,
)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch_bases")
    return {name: make_hf_base(root / name, name, seed=i) for i, name in enumerate(FAMILY_MEMBERS + ROPE_MEMBERS)}


@pytest.mark.parametrize("name", FAMILY_MEMBERS + ROPE_MEMBERS)
def test_logits_equal_transformers(bases, name):
    """fp32 logits of the compact model == transformers' AutoModelForCausalLM on the same weights,
    over LONG tokens (past the original context of llama3/yarn/longrope/dynamic, past the windows)."""
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(bases[name])(ids).logits
        got = load_model(bases[name])(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 1  # the logits are not trivially small


@pytest.mark.parametrize("name", FAMILY_MEMBERS + ("llama-dynamic",))
def test_greedy_with_kv_cache_equals_transformers(bases, name):
    """Incremental decoding (the KV cache, LongRoPE/dynamic switching with the sequence's length
    at each step) gives transformers' greedy tokens, from a prompt shorter than the original
    context into a continuation past it."""
    prompt = torch.randint(0, 256, (ORIGINAL - 4,), generator=torch.Generator().manual_seed(2)).tolist()
    n = LONG - len(prompt)
    want = hf_greedy(bases[name], prompt, n, stop_at_eos=False)
    # Falcon's new architecture repeats a few words in every tiny random model tried (1–5 distinct over seeds,
    # MLP widths, KV heads and weight scales); its logits above are the strong check
    assert len(want) == n and len(set(want)) > (2 if name == "falcon-40b" else 5)
    assert load_model(bases[name]).generate(prompt, n) == want


def test_descriptions_of_the_families(bases):
    """Each family's layout, biases, norms and rope as the config describes them."""
    args = {n: ModelArgs.from_hf(read_config(bases[n])) for n in FAMILY_MEMBERS}
    assert args["llama-3.1"].layout == "q,k,v,o,gate,up,down" and args["llama-3.1"].rope.kind == "llama3"
    assert args["llama-3.1"].rope.theta == 500000.0 and args["llama-3.1"].rope.original_max == ORIGINAL
    assert args["llama-3.2"].tie_embeddings
    assert args["qwen2.5"].layout == "q,k,v,o,gate,up,down;bias=q,k,v" and args["qwen2.5"].rope.theta == 1e6
    assert args["qwen3"].layout == "q,k,v,o,gate,up,down;qk_norm" and args["qwen3"].head_dim == 16
    assert dict(args["qwen3"].layer_norms())["self_attn.q_norm"] == 16
    assert args["mistral"].windows == (8, 8)
    assert args["phi3-mini"].layout == "qkv,o,gate_up,down"
    assert args["phi3-mini"].group_shapes() == {"qkv": (64, 32), "o": (32, 32), "gate_up": (96, 32), "down": (32, 48)}
    long = args["phi3-longrope"].rope
    assert (long.kind, long.dim, long.original_max) == ("longrope", 4, ORIGINAL)
    assert long.attention_factor > 1  # sqrt(1 + ln(64/16) / ln 16)
    assert ModelArgs.from_hf(read_config(bases["qwen2-swa"])).windows == (None, 8)
    for a in args.values():  # the compact model's own less a tied head and OLMo 1's implied norm weights
        implied = implied_tensors(read_config(bases[_name(args, a)])).values()
        assert a.param_count() == sum(p.numel() for p in load_model(bases[_name(args, a)]).state_dict().values()) - (
            a.vocab_size * a.dim if a.tie_embeddings else 0
        ) - sum(math.prod(s) for s in implied)


def _name(args: dict, a: ModelArgs) -> str:
    return next(n for n, x in args.items() if x is a)


def test_both_key_spellings_give_one_description(bases):
    """transformers v5 writes rope_parameters (with rope_theta inside); v4 wrote rope_scaling and
    a top-level rope_theta, and older files 'type' for 'rope_type': the same model either way."""
    v5 = read_config(bases["llama-3.1"])
    assert "rope_parameters" in v5 and "rope_scaling" not in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    params = dict(v5["rope_parameters"])
    v4["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    v4["rope_scaling"] = params
    assert ModelArgs.from_hf(v4) == ModelArgs.from_hf(v5)
    # the Llama-3.1 config the issue found served with the default rope: now llama3
    assert ModelArgs.from_hf(v5).rope.kind == "llama3"


def test_fields_that_would_change_the_model_are_refused(bases):
    """Anything the build does not implement is refused at start-up, naming the field."""
    llama = read_config(bases["llama-3.1"])
    cases = {
        "'num_local_experts'": {"num_local_experts": 8},
        "'quantization_config'": {"quantization_config": {"quant_method": "awq"}},
        "'final_logit_softcapping'": {"final_logit_softcapping": 30.0},
        "hidden_act 'quick_gelu'": {"hidden_act": "quick_gelu"},
        "partial_rotary_factor": {"partial_rotary_factor": 0.5},  # Llama does not read it
        "rope type 'mrope'": {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
        "mrope_section": {"rope_parameters": {**llama["rope_parameters"], "mrope_section": [2, 1, 1]}},
        "needs rope_parameters.low_freq_factor": {
            "rope_parameters": {k: v for k, v in llama["rope_parameters"].items() if k != "low_freq_factor"}
        },
        "'sliding_window'": {"sliding_window": 8},  # Llama has no sliding window: not silently ignored
        "disagree": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    }
    for why, change in cases.items():
        with pytest.raises(UnsupportedModel, match=why.replace("(", r"\(")):
            ModelArgs.from_hf({**copy.deepcopy(llama), **change})
    for model_type, what in (
        ("deepseek_v2", "mixture-of-experts"),
        ("paligemma", "multimodal"),
        ("llava", "multimodal"),
    ):
        with pytest.raises(
            UnsupportedModel, match=f"{model_type}.*{what}.*llama, mistral, ministral, ministral3, qwen2, qwen3, phi3"
        ):
            ModelArgs.from_hf({**llama, "model_type": model_type})
    with pytest.raises(UnsupportedModel, match="multimodal"):
        ModelArgs.from_hf({**llama, "vision_config": {"hidden_size": 8}})


@pytest.mark.parametrize(
    "model_type, config_class",
    [
        ("llama", "LlamaConfig"),
        ("mistral", "MistralConfig"),
        ("ministral3", "Ministral3Config"),
        ("qwen2", "Qwen2Config"),
        ("qwen3", "Qwen3Config"),
        ("phi3", "Phi3Config"),
        ("gemma", "GemmaConfig"),
        ("gemma2", "Gemma2Config"),
        ("gemma3_text", "Gemma3TextConfig"),
        ("granite", "GraniteConfig"),
        ("seed_oss", "SeedOssConfig"),
        ("ernie4_5", "Ernie4_5Config"),
        ("glm", "GlmConfig"),
        ("glm4", "Glm4Config"),
        ("olmo2", "Olmo2Config"),
        ("olmo3", "Olmo3Config"),
        ("smollm3", "SmolLM3Config"),
        ("mixtral", "MixtralConfig"),
        ("qwen3_moe", "Qwen3MoeConfig"),
        ("qwen2_moe", "Qwen2MoeConfig"),
        ("olmoe", "OlmoeConfig"),
        ("cohere", "CohereConfig"),
        ("cohere2", "Cohere2Config"),
        ("exaone4", "Exaone4Config"),
        ("ministral", "MinistralConfig"),
        ("internlm3", "InternLM3Config"),
        ("stablelm", "StableLmConfig"),
        ("starcoder2", "Starcoder2Config"),
        ("nemotron", "NemotronConfig"),
        ("arcee", "ArceeConfig"),
        ("hunyuan_v1_dense", "HunYuanDenseV1Config"),
    ],
)
def test_a_field_left_out_means_what_it_means_to_transformers(model_type, config_class):
    """A config of nothing but its model_type reads as transformers' config class of the family reads
    it (every default the forward depends on: Mistral's window of 4096, Qwen3's head_dim of 128,
    Gemma 2's soft-caps, ...), and the defaults are those of the class."""
    import dataclasses

    import transformers as tf

    from bitdelta.arch import FAMILY_DEFAULTS

    full = getattr(tf, config_class)().to_dict()
    assert {k: full.get(k) for k in FAMILY_DEFAULTS[model_type]} == FAMILY_DEFAULTS[model_type]
    bare, theirs = ModelArgs.from_hf({"model_type": model_type}), ModelArgs.from_hf(full)
    no_ids = dict(bos_token_id=None, eos_token_id=None)  # token ids: the tokenizer's business
    assert dataclasses.replace(bare, **no_ids) == dataclasses.replace(theirs, **no_ids)


def test_mixture_of_experts_configs_as_transformers_reads_them(bases):
    """Both spellings of the expert count; the expert's intermediate size of each family; what
    would make some layers dense, or route otherwise, refused by name; published sizes counted."""
    mixtral, qwen = read_config(bases["mixtral"]), read_config(bases["qwen3-moe"])
    m, q = ModelArgs.from_hf(mixtral), ModelArgs.from_hf(qwen)
    assert (m.n_experts, m.experts_per_token, m.intermediate_size, m.norm_topk, m.windows) == (4, 2, 48, True, (8, 8))
    assert (q.n_experts, q.experts_per_token, q.intermediate_size, q.norm_topk, q.windows) == (4, 2, 24, False, ())
    assert m.layout == "q,k,v,o,router,experts=4x(w1,w3,w2)"
    assert q.layout == "q,k,v,o,router,experts=4x(gate,up,down);qk_norm"
    groups = m.group_shapes()
    assert groups["router"] == (4, 32) and groups["gate_up.3"] == (96, 32) and groups["down.0"] == (32, 48)
    spelled = {k: v for k, v in qwen.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert ModelArgs.from_hf(spelled) == q
    cases = {
        "disagree": {"num_experts": 8},
        "dense MLP among sparse": {"mlp_only_layers": [1]},
        "dense MLP among sparse ones": {"decoder_sparse_step": 2},
        "more than the 4 experts": {"num_experts_per_tok": 5},
        "positive integer": {"num_experts_per_tok": 0},
    }
    for why, change in cases.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**qwen, **change})
    on = ModelArgs.from_hf({**qwen, "use_sliding_window": True, "sliding_window": 8})
    assert on.windows == (8, 8)  # transformers' Qwen3-MoE windows every layer
    # the class's defaults are Mixtral-8x7B's shapes (the published configs: test_plans_of_published_configs)
    assert ModelArgs.from_hf({"model_type": "mixtral"}).param_count() == 46_702_792_704


def test_qwen2_moe_configs_as_transformers_reads_them(bases):
    """Qwen2-MoE's shared expert and its gate are compressed matrices of their own groups; qkv_bias
    and the sliding windows read as transformers' Qwen2-MoE reads them; a shared expert of no
    columns is refused."""
    cfg = read_config(bases["qwen2-moe"])
    a = ModelArgs.from_hf(cfg)
    assert (a.n_experts, a.experts_per_token, a.intermediate_size, a.shared_intermediate_size) == (4, 2, 24, 40)
    assert (a.norm_topk, a.qkv_bias, a.o_bias, a.windows) == (False, True, False, ())
    assert a.layout == "q,k,v,o,router,experts=4x(gate,up,down),shared_expert=(gate,up,down)+gate;bias=q,k,v"
    groups = a.group_shapes()
    assert groups["gate_up.shared"] == (80, 32) and groups["down.shared"] == (32, 40)
    assert groups["shared_gate"] == (1, 32) and groups["gate_up.3"] == (48, 32)
    assert "model.layers.1.mlp.shared_expert_gate.weight" in a.compressed_names()
    assert not ModelArgs.from_hf({**cfg, "qkv_bias": False}).qkv_bias
    # transformers' rule without layer_types: the even layers below max_window_layers slide
    on = {**cfg, "use_sliding_window": True, "sliding_window": 8, "layer_types": None, "num_hidden_layers": 4}
    assert ModelArgs.from_hf({**on, "max_window_layers": 3}).windows == (8, None, 8, None)
    assert ModelArgs.from_hf({**on, "max_window_layers": 1}).windows == (8, None, None, None)
    assert ModelArgs.from_hf({k: v for k, v in on.items() if k != "sliding_window"}).windows[0] == 4096
    for why, change in {
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 0},
        "use_sliding_window is off": {"layer_types": ["sliding_attention", "full_attention"]},
        "dense MLP among sparse": {"mlp_only_layers": [0]},
    }.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**cfg, **change})


def test_mistral3_configs_as_transformers_reads_them(bases, tmp_path):
    """Mistral 3's wrapper (Mistral3ForConditionalGeneration) reads as its text model, a Ministral 3
    or a Mistral (Mistral Small 3.x); Ministral 3's attention temperature is 1 below its original
    context and changes the logits past it; what the wrapper or the temperature cannot be is refused."""
    import math

    import transformers as tf

    from bitdelta.model import load_model

    cfg = read_config(bases["ministral3-mm"])
    a = ModelArgs.from_hf(cfg)
    assert (a.model_type, a.rope.kind, a.rope.factor, a.rope.original_max) == ("ministral3", "yarn", 4.0, ORIGINAL)
    assert (a.temperature_beta, a.temperature_original, a.tie_embeddings, a.windows) == (0.1, ORIGINAL, False, ())
    got = a.q_temperature(torch.tensor([0, ORIGINAL - 1, ORIGINAL, 2 * ORIGINAL - 1, 2 * ORIGINAL]))
    want = torch.tensor([1, 1, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)])
    torch.testing.assert_close(got, want)
    assert ModelArgs.from_hf(cfg["text_config"]) == a  # the text model alone (Ministral3ForCausalLM) is the same
    # the temperature matters past the original context: without it the logits there differ
    ids = torch.randint(0, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(3))
    model = load_model(bases["ministral3-mm"])
    with torch.no_grad():
        want = model(ids)
        for layer in model.model.layers:
            layer.self_attn.args = dataclasses.replace(a, temperature_beta=0.0)
        plain = model(ids)
    assert torch.equal(plain[:, :ORIGINAL], want[:, :ORIGINAL])
    assert (plain[:, ORIGINAL:] - want[:, ORIGINAL:]).abs().max() > 1e-3
    # Mistral Small 3.x: the wrapper around a Mistral reads as that Mistral
    mistral = read_config(bases["mistral"])
    small = tf.Mistral3Config(text_config=mistral, tie_word_embeddings=False).to_dict()
    assert ModelArgs.from_hf(small) == ModelArgs.from_hf(mistral)
    for why, change in {
        "must be a mistral or ministral3 config, not 'llama'": {"text_config": {**mistral, "model_type": "llama"}},
        "'spatial_merge_sizes'": {"spatial_merge_sizes": 2},
        "tie_word_embeddings is True": {"tie_word_embeddings": True},
    }.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**small, **change})
    text = cfg["text_config"]
    rope = {k: v for k, v in text["rope_parameters"].items() if k != "llama_4_scaling_beta"}
    with pytest.raises(UnsupportedModel, match="llama_4_scaling_beta"):
        ModelArgs.from_hf({**text, "rope_parameters": rope})


def test_smollm3_configs_as_transformers_reads_them(bases):
    """SmolLM3's NoPE layers (no_rope_layers, or every no_rope_layer_interval-th) and its windows
    (where use_sliding_window: on the NoPE layers unless layer_types says otherwise); the NoPE layer
    really takes no rope (with one the logits differ); malformed lists refused."""
    cfg = read_config(bases["smollm3"])
    a = ModelArgs.from_hf(cfg)
    assert (a.nope, a.windows, a.rope.theta) == ((False, True), (None, 8), 2e6)
    assert a.rotates(0) and not a.rotates(1)
    bare = {k: v for k, v in cfg.items() if k not in ("no_rope_layers", "layer_types")} | {"num_hidden_layers": 8}
    assert ModelArgs.from_hf(bare).nope == (False, True) * 4
    assert ModelArgs.from_hf({**bare, "no_rope_layer_interval": 4}).nope == (False, False, False, True) * 2
    assert ModelArgs.from_hf({**bare, "no_rope_layer_interval": 4}).windows == (None, None, None, 8) * 2
    assert ModelArgs.from_hf({**cfg, "no_rope_layers": [1, 1]}).nope == ()
    assert ModelArgs.from_hf({**cfg, "use_sliding_window": False}).windows == ()
    ids = torch.randint(0, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(4))
    model = load_model(bases["smollm3"])
    with torch.no_grad():
        want = model(ids)
        for layer in model.model.layers:
            layer.self_attn.args = dataclasses.replace(a, nope=())
        assert (model(ids) - want).abs().max() > 1e-3
    for bad in ([1], [1, 2], "1,0"):
        with pytest.raises(UnsupportedModel, match="no_rope_layers"):
            ModelArgs.from_hf({**cfg, "no_rope_layers": bad})


def test_olmo3_configs_as_transformers_reads_them(bases):
    """OLMo 3's two ropes from either spelling (the old one's rope_scaling is the full layers', its
    rope_theta both), its default windows (three of every four layers), and transformers' θ."""
    import transformers as tf

    cfg = read_config(bases["olmo3"])
    a = ModelArgs.from_hf(cfg)
    assert a.windows == (8, None) and a.local(0) and not a.local(1)
    assert (a.rope.kind, a.rope.theta, a.rope.factor, a.local_rope.kind, a.local_rope.theta) == (
        "yarn",
        5e5,
        4.0,
        "default",
        1e4,
    )
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    spelled = ModelArgs.from_hf({**old, "rope_theta": 5e5, "rope_scaling": yarn})
    assert spelled.rope == a.rope and spelled.local_rope == dataclasses.replace(a.local_rope, theta=5e5)
    theirs = tf.Olmo3Config(
        **COMMON, sliding_window=8, layer_types=cfg["layer_types"], rope_theta=5e5, rope_scaling=yarn
    )
    assert ModelArgs.from_hf(theirs.to_dict()) == spelled  # transformers' reading of the old spelling
    bare = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")} | {"num_hidden_layers": 8}
    b = ModelArgs.from_hf(bare)
    assert b.windows == (8, 8, 8, None) * 2 and b.rope.theta == b.local_rope.theta == 5e5


def test_glm_configs_as_transformers_reads_them(bases):
    """Seed-OSS's o_proj bias by attention_out_bias. GLM: the MLP's gate and up fused, q/k/v biases without o's, half of each head rotated by an
    interleaved rope (which the logits depend on); GLM-4: the same under a sandwich of its own norms."""
    seed = ModelArgs.from_hf(read_config(bases["seed-oss"]))  # Seed-OSS: o's bias by its own switch
    assert seed.layout == "q,k,v,o,gate,up,down;bias=q,k,v,o,gate,up,down"
    assert not ModelArgs.from_hf({**read_config(bases["seed-oss"]), "attention_out_bias": False}).o_bias
    glm, glm4 = ModelArgs.from_hf(read_config(bases["glm"])), ModelArgs.from_hf(read_config(bases["glm4"]))
    for a in (glm, glm4):
        assert a.layout == "q,k,v,o,gate_up,down;bias=q,k,v" and (a.qkv_bias, a.o_bias) == (True, False)
        assert (a.rope.dim, a.rope.interleaved, a.head_dim) == (8, True, 16)
    assert glm.norm_roles() == ("input_layernorm", None, "post_attention_layernorm", None)
    assert glm4.norm_roles() == (
        "input_layernorm",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "post_mlp_layernorm",
    )
    ids = torch.randint(0, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(5))
    model = load_model(bases["glm4"])
    with torch.no_grad():
        want = model(ids)
        for layer in model.model.layers:
            layer.self_attn.args = dataclasses.replace(glm4, rope=dataclasses.replace(glm4.rope, interleaved=False))
        assert (model(ids) - want).abs().max() > 1e-3


def test_ernie_rope_as_transformers_computes_it(bases):
    """ERNIE 4.5: every projection biased (use_bias), and its interleaved rotation in fp32 from fp32
    tables, rounded once: a bf16 q equals transformers' own rotation bit for bit (a rotation rounded at
    each step, as GLM's, does not)."""
    from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding, apply_rotary_pos_emb

    from bitdelta.model import rotate

    cfg = read_config(bases["ernie4.5"])
    a = ModelArgs.from_hf(cfg)
    assert a.layout == "q,k,v,o,gate,up,down;bias=q,k,v,o,gate,up,down" and a.tie_embeddings
    assert (a.rope.interleaved, a.rope.fp32, a.rope.table_dtype(torch.bfloat16)) == (True, True, torch.float32)
    q, want, (ours_cos, ours_sin) = _bf16_rotations(a, bases["ernie4.5"], Ernie4_5RotaryEmbedding, apply_rotary_pos_emb)
    assert torch.equal(rotate(a.rope, q, ours_cos, ours_sin), want)
    rounded = dataclasses.replace(a.rope, fp32=False)
    stepwise = rotate(rounded, q, ours_cos.bfloat16(), ours_sin.bfloat16())
    assert not torch.equal(stepwise, want)


def _bf16_rotations(a: ModelArgs, base, rotary_class, apply_rotary_pos_emb):
    """A random bf16 q [1, heads, LONG, head_dim], transformers' rotation of it (its rotary embedding class
    and apply function on `base`'s config), and our tables of LONG positions in bf16."""
    from bitdelta.model import rope_tables

    q = (torch.randn(1, a.n_heads, LONG, a.head_dim, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    pos = torch.arange(LONG)
    cos, sin = rotary_class(hf_model(base).config)(q, pos[None])
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return q, want, rope_tables(a, pos, torch.bfloat16)


def test_cohere_configs_as_transformers_reads_them(bases):
    """Cohere: LayerNorm (no bias) and a parallel block, one norm a layer; logit_scale; a bf16 q rotated
    as transformers rotates it, bit for bit (fp32 products from tables in bf16: fp32 tables, as ERNIE's,
    differ). Cohere 2: the sliding layers take the rope, the full ones none, by layer_types or every
    sliding_window_pattern-th layer; the switches Command R7B's and Command A's config.json carry,
    accepted where they say what transformers does and refused by name where not. Command R+'s
    use_qk_norm read (q and k normed per head, each head by weights of its own); a head_dim transformers
    would overwrite and a null logit_scale refused."""
    import transformers as tf
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding, apply_rotary_pos_emb

    from bitdelta.model import rotate

    a = ModelArgs.from_hf(read_config(bases["cohere"]))
    assert (a.layout, a.logit_scale, a.tie_embeddings) == ("q,k,v,o,gate,up,down;bias=q,k,v,o", 0.25, True)
    assert a.norm_roles() == ("input_layernorm", None, None, None) and a.layer_norms() == (("input_layernorm", 32),)
    assert (a.rope.interleaved, a.rope.fp32, a.rope.table_dtype(torch.bfloat16)) == (True, True, torch.bfloat16)
    q, want, tables = _bf16_rotations(a, bases["cohere"], CohereRotaryEmbedding, apply_rotary_pos_emb)
    assert torch.equal(rotate(a.rope, q, *tables), want)
    fp32_tables = dataclasses.replace(a.rope, fp32_tables=True)
    assert not torch.equal(rotate(a.rope, q, *fp32_tables.tables(torch.arange(LONG), torch.float32)), want)
    plus = ModelArgs.from_hf(read_config(bases["cohere-qk"]))  # Command R+: per-head q/k norms of their own
    assert plus.qk_heads and plus.layout.endswith(";qk_norm")
    assert dict((k, s) for k, _, s in plus.norm_params())["self_attn.q_norm"] == (4, 8)
    with pytest.raises(UnsupportedModel, match="logit_scale"):
        ModelArgs.from_hf({**read_config(bases["cohere"]), "logit_scale": None})

    cfg = read_config(bases["cohere2"])
    two = ModelArgs.from_hf(cfg)
    assert (two.nope, two.windows, two.logit_scale, two.rope.theta) == ((False, True), (8, None), 0.5, 10000.0)
    shipped = {  # Command R7B's and Command A's own switches, as their config.json has them
        "order_of_interleaved_layers": "local_attn_first",
        "position_embedding_type": "rope_gptj",
        "rotary_pct": 1.0,
        "use_gated_activation": True,
        "use_parallel_block": True,
        "use_qk_norm": False,
        "use_embedding_sharing": True,
        "use_parallel_embedding": True,
        "layer_switch": 4,
        "cache_implementation": "hybrid",
    }
    assert ModelArgs.from_hf({**cfg, **shipped}) == two
    for key, bad in (
        ("order_of_interleaved_layers", "global_attn_first"),
        ("position_embedding_type", "rope"),
        ("rotary_pct", 0.5),
        ("use_gated_activation", False),
        ("use_parallel_block", False),
        ("use_qk_norm", True),
        ("use_embedding_sharing", False),
        ("layer_switch", 2),
    ):
        with pytest.raises(UnsupportedModel, match=key):
            ModelArgs.from_hf({**cfg, **shipped, key: bad})
    bare = {k: v for k, v in cfg.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    for every in (4, 2):
        types = tf.Cohere2Config(**bare, sliding_window_pattern=every).layer_types
        b = ModelArgs.from_hf({**bare, "sliding_window_pattern": every})
        assert b.nope == tuple(t == "full_attention" for t in types) and any(b.nope)
        assert b.windows == tuple(None if t == "full_attention" else 8 for t in types)
    with pytest.raises(UnsupportedModel, match="head_dim"):
        ModelArgs.from_hf({**cfg, "head_dim": 16})
    with pytest.raises(UnsupportedModel, match="layer_types"):
        ModelArgs.from_hf({**cfg, "layer_types": ["sliding_attention"]})


def test_exaone4_configs_as_transformers_reads_them(bases):
    """EXAONE 4: post-norms rounded as Llama's (not OLMo 2's once), per-head q/k norms; with a window,
    the sliding layers (layer_types, or all but every sliding_window_pattern-th) take the rope and the
    full ones none; with a null window every layer is full and takes the rope (it then needs
    layer_types, as transformers' class does); a string pattern without layer_types refused."""
    import transformers as tf

    cfg = read_config(bases["exaone4"])
    a = ModelArgs.from_hf(cfg)
    assert (a.nope, a.windows, a.norm_roles()) == (
        (False, True),
        (8, None),
        (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    )
    assert a.family.qk_norm and not a.family.qk_whole and not a.family.norm_once
    assert dict(a.layer_norms())["self_attn.q_norm"] == 16
    bare = {k: v for k, v in cfg.items() if k != "layer_types"} | {"num_hidden_layers": 8, "sliding_window_pattern": 4}
    types = tf.Exaone4Config(**bare).layer_types
    b = ModelArgs.from_hf(bare)
    assert b.nope == tuple(t == "full_attention" for t in types) and b.nope == (False, False, False, True) * 2
    assert b.windows == tuple(None if n else 8 for n in b.nope)
    every_full = ModelArgs.from_hf({**cfg, "sliding_window": None})
    assert (every_full.nope, every_full.windows) == ((), ())
    with pytest.raises(UnsupportedModel, match="needs layer_types"):
        ModelArgs.from_hf({**bare, "sliding_window": None})
    with pytest.raises(UnsupportedModel, match="sliding_window_pattern"):
        ModelArgs.from_hf({**bare, "sliding_window_pattern": "LLLG"})
    assert ModelArgs.from_hf({**cfg, "sliding_window_pattern": "LLLG"}) == a  # layer_types decide


def test_internlm3_and_ministral_configs_as_transformers_reads_them(bases):
    """InternLM3's config.json spells the biases qkv_bias and bias (transformers' attribute_map): read as
    attention_bias and mlp_bias, both spellings disagreeing refused, and the two biases apart refused as
    transformers refuses them. Ministral's windows on the layers layer_types names, by default every layer
    where sliding_window is set."""
    import transformers as tf

    cfg = read_config(bases["internlm3"])
    a = ModelArgs.from_hf(cfg)
    assert a.layout == "q,k,v,o,gate,up,down;bias=q,k,v,o,gate,up,down"
    shipped = {k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias")} | {
        "qkv_bias": True,
        "bias": True,
    }
    assert ModelArgs.from_hf(shipped) == a
    assert ModelArgs.from_hf({**shipped, "qkv_bias": False, "bias": False}).layout == "q,k,v,o,gate,up,down"
    with pytest.raises(UnsupportedModel, match="'qkv_bias'.*'attention_bias'.*disagree"):
        ModelArgs.from_hf({**shipped, "attention_bias": False})
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="qkv_bias"):  # transformers refuses it too
        tf.InternLM3Config(**{**COMMON, "qkv_bias": True, "bias": False})
    with pytest.raises(UnsupportedModel, match="qkv_bias"):
        ModelArgs.from_hf({**shipped, "bias": False})

    cfg = read_config(bases["ministral"])
    assert ModelArgs.from_hf(cfg).windows == (None, 8)
    bare = {k: v for k, v in cfg.items() if k != "layer_types"}
    assert (
        ModelArgs.from_hf(bare).windows
        == (8, 8)
        == tuple(8 if t == "sliding_attention" else None for t in tf.MinistralConfig(**bare).layer_types)
    )
    assert ModelArgs.from_hf({**bare, "sliding_window": None}).windows == ()
    with pytest.raises(UnsupportedModel, match="layer_types"):
        ModelArgs.from_hf({**cfg, "layer_types": ["sliding_attention"]})


def test_stablelm_configs_as_transformers_reads_them(tmp_path, bases):
    """StableLM: LayerNorms with biases (a norm parameter each, beside the weights), q/k/v biases by
    use_qkv_bias, the rope over a quarter of each head by default (either spelling of the factor), a
    parallel block by use_parallel_residual; StableLM 2's own switches accepted where they say what
    transformers does; qk_layernorm (StableLM 2 12B's): q and k normed per head by LayerNorms of their own,
    without biases, stored one per head and read as one [heads, head_dim] weight each (written back head by
    head); an adapter's saved part of one refused."""
    cfg = read_config(bases["stablelm"])
    a = ModelArgs.from_hf(cfg)
    assert (a.layout, a.rope.dim, a.head_dim, a.parallel) == ("q,k,v,o,gate,up,down;bias=q,k,v", 4, 16, False)
    assert a.norm_params() == (
        ("input_layernorm", "input_layernorm.weight", (32,)),
        ("post_attention_layernorm", "post_attention_layernorm.weight", (32,)),
        ("input_layernorm.bias", "input_layernorm.bias", (32,)),
        ("post_attention_layernorm.bias", "post_attention_layernorm.bias", (32,)),
    )
    p = ModelArgs.from_hf(read_config(bases["stablelm-parallel"]))
    assert p.parallel and p.norm_roles() == ("input_layernorm", None, None, None)
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    }
    assert ModelArgs.from_hf(old) == a
    assert ModelArgs.from_hf({**cfg, "use_norm_bias": False, "rotary_scaling_factor": 1.0}) == a
    with pytest.raises(UnsupportedModel, match="rotary_scaling_factor"):
        ModelArgs.from_hf({**cfg, "rotary_scaling_factor": 2.0})
    qk = ModelArgs.from_hf(read_config(bases["stablelm-qk"]))
    assert qk.qk_heads and qk.layout.endswith(";qk_norm")
    params = dict((k, s) for k, _, s in qk.norm_params())
    assert params["self_attn.q_layernorm"] == (4, 8) and params["self_attn.k_layernorm"] == (2, 8)
    assert "self_attn.q_layernorm.bias" not in params and "input_layernorm.bias" in params
    from safetensors import safe_open

    from bitdelta.checkpoint import CheckpointReader, save_checkpoint

    with safe_open(str(bases["stablelm-qk"] / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    with CheckpointReader(bases["stablelm-qk"]) as r:
        k_norm = r.get("model.layers.1.self_attn.k_layernorm.weight")
        assert r.shape("model.layers.1.self_attn.k_layernorm.weight") == [2, 8]
        assert torch.equal(k_norm[1], stored["model.layers.1.self_attn.k_layernorm.norms.1.weight"])
        assert "model.layers.1.self_attn.k_layernorm.norms.1.weight" not in r
        state = dict(r)
    out = save_checkpoint(state, tmp_path / "qk", read_config(bases["stablelm-qk"]))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(stored) and all(torch.equal(f.get_tensor(k), stored[k]) for k in stored)
    with pytest.raises(UnsupportedModel, match="qk_layernorm"):  # Phi's, one LayerNorm with a bias for all heads
        ModelArgs.from_hf({**read_config(bases["phi"]), "qk_layernorm": True})


def test_olmo_norms_are_ones_no_checkpoint_stores(tmp_path, bases):
    """OLMo 1's LayerNorms have no parameters: the reader supplies each norm's weight as ones in the
    checkpoint's dtype (and a slice of it, as a tensor-parallel rank reads), every writer leaves them out
    (save_checkpoint and the merges' sharded writer; a value other than 1 refused, since it would be lost),
    and a checkpoint that stores one is refused (transformers would not read it). clip_qkv is read as
    transformers reads it (OLMoE's too); an rms_norm_eps other than OLMo's fixed 1e-5, and a clip that is not
    a positive number, are refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bitdelta.checkpoint import CheckpointReader, save_checkpoint
    from bitdelta.merge.io import ShardedWriter

    cfg = read_config(bases["olmo"])
    a = ModelArgs.from_hf(cfg)
    assert (a.layout, a.clip_qkv, a.norm_eps, a.family.layer_norm) == ("q,k,v,o,gate,up,down", 1.0, 1e-5, True)
    assert ModelArgs.from_hf(read_config(bases["olmoe"])).clip_qkv == 1.5
    norms = [f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    with CheckpointReader(bases["olmo"]) as r:
        assert sorted(r.implied) == sorted([*norms, "model.norm.weight"])
        assert set(r.implied) <= set(r.keys()) and all(n in r for n in r.implied)
        assert torch.equal(r.get(norms[0]), torch.ones(32)) and r.shape("model.norm.weight") == [32]
        assert torch.equal(r.get_part(norms[1], rows=((4, 8), (20, 24))), torch.ones(8))
        state = {k: t.to(torch.bfloat16) for k, t in r}  # the implied ones included
    out = save_checkpoint(state, tmp_path / "bf16", {**cfg, "torch_dtype": "bfloat16"}, side_files_from=bases["olmo"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not set(r.implied) & set(f.keys()) and "model.embed_tokens.weight" in f.keys()
    with CheckpointReader(out) as r:  # read back in the checkpoint's own dtype
        assert r.get("model.norm.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="norms have no weights, so a value other than 1"):
        save_checkpoint({**state, norms[0]: torch.full((32,), 1.5)}, tmp_path / "moved", cfg)
    assert not (tmp_path / "moved").exists()
    w = ShardedWriter(tmp_path / "merged", bases["olmo"])
    for k, t in state.items():
        w.add(k, t)
    with safe_open(str(w.close() / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(k for k in state if k not in r.implied)
    stored = tmp_path / "stored"
    save_checkpoint({k: t for k, t in state.items() if k not in r.implied}, stored, cfg, side_files_from=bases["olmo"])
    save_file(
        {**{k: t for k, t in state.items() if k not in r.implied}, norms[0]: torch.ones(32)},
        str(stored / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"'model.layers.0.input_layernorm.weight' is stored.*no weights"):
        CheckpointReader(stored)
    with pytest.raises(UnsupportedModel, match="rms_norm_eps.*1e-5"):
        ModelArgs.from_hf({**cfg, "rms_norm_eps": 1e-6})
    for clip in (0, -8.0, "8"):
        with pytest.raises(UnsupportedModel, match="clip_qkv"):
            ModelArgs.from_hf({**cfg, "clip_qkv": clip})
    assert ModelArgs.from_hf({**cfg, "clip_qkv": None}).clip_qkv is None


def test_gpt_neox_checkpoints_read_and_write_in_their_own_names(tmp_path, bases):
    """GPT-NeoX's checkpoints read under the canonical names: q, k and v as the rows of the fused,
    head-interleaved query_key_value ([heads, 3, head_dim]; a tensor-parallel rank's rows of them read from
    the file), `gpt_neox.` as `model.`, `embed_in`/`embed_out` as the embedding and the head; an old
    checkpoint's buffers not read; every writer writes the stored form back bit for bit (a fused tensor with
    a part missing refused); rotary_pct and rotary_emb_base read as transformers reads them; a head_dim or a
    num_key_value_heads that transformers' GPT-NeoX would not honour refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bitdelta.checkpoint import CheckpointReader, save_checkpoint
    from bitdelta.merge.io import ShardedWriter

    cfg = read_config(bases["gpt-neox"])
    a = ModelArgs.from_hf(cfg)
    assert (a.parallel, a.act, a.rope.dim, a.n_kv_heads, a.head_dim) == (True, "gelu", 4, 4, 8)
    assert a.norm_roles() == ("input_layernorm", None, "post_attention_layernorm", None)
    assert not ModelArgs.from_hf(read_config(bases["gpt-neox-seq"])).parallel
    with safe_open(str(bases["gpt-neox"] / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    qkv = stored["gpt_neox.layers.1.attention.query_key_value.weight"].view(4, 3, 8, 32)
    with CheckpointReader(bases["gpt-neox"]) as r:
        assert "model.layers.1.self_attn.k_proj.weight" in r and "gpt_neox.embed_in.weight" not in r
        assert torch.equal(r.get("model.layers.1.self_attn.k_proj.weight"), qkv[:, 1].reshape(32, 32))
        assert torch.equal(r.get("model.embed_tokens.weight"), stored["gpt_neox.embed_in.weight"])
        assert torch.equal(r.get("lm_head.weight"), stored["embed_out.weight"])
        assert r.shape("model.layers.1.self_attn.v_proj.bias") == [32]
        part = r.get_part("model.layers.1.self_attn.v_proj.weight", rows=((8, 24),), cols=(4, 20))
        assert torch.equal(part, qkv[1:3, 2, :, 4:20].reshape(16, 16))  # heads 1 and 2 of v
        state = dict(r)
    assert not any(k.startswith(("gpt_neox.", "embed_")) for k in state)
    out = save_checkpoint(state, tmp_path / "again", cfg, side_files_from=bases["gpt-neox"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(stored) and all(torch.equal(f.get_tensor(k), stored[k]) for k in stored)
    w = ShardedWriter(tmp_path / "merged", bases["gpt-neox"])
    for k, t in state.items():
        w.add(k, t)
    with safe_open(str(w.close() / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(stored)
    w = ShardedWriter(tmp_path / "half", bases["gpt-neox"])
    w.add("model.layers.0.self_attn.q_proj.weight", state["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="q_proj.weight: the checkpoint stores it fused"):
        w.close()
    with pytest.raises(ValueError, match="k_proj.weight: this family stores q, k and v fused"):
        save_checkpoint({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)}, tmp_path / "q", cfg)
    old = tmp_path / "old"  # an old checkpoint's buffers beside the weights
    save_checkpoint(state, old, cfg, side_files_from=bases["gpt-neox"])
    buffers = {
        f"gpt_neox.layers.0.attention.{b}": torch.ones(2) for b in ("bias", "masked_bias", "rotary_emb.inv_freq")
    }
    save_file({**stored, **buffers}, str(old / "model.safetensors"))
    with CheckpointReader(old) as r:
        assert sorted(r.keys()) == sorted(state)
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rotary_pct": 0.5, "rotary_emb_base": 10000}
    assert ModelArgs.from_hf(legacy) == a
    for key, value in (("head_dim", 16), ("num_key_value_heads", 2)):
        with pytest.raises(UnsupportedModel, match=key):
            ModelArgs.from_hf({**cfg, key: value})
    assert ModelArgs.from_hf({**cfg, "head_dim": 8, "num_key_value_heads": 4}) == a


def test_falcon_configs_and_checkpoints_as_transformers_reads_them(tmp_path, bases):
    """Falcon's three q/k/v layouts as rows of its fused query_key_value (multi-query: all q heads, one k,
    one v; the new architecture: grouped per KV head; else per head), its parallel block's two norms
    (ln_attn, ln_mlp) read as the canonical ones and written back, its first configs' spellings and its
    MLP width's default; what transformers' Falcon would run otherwise, or this build does not, refused."""
    from safetensors import safe_open

    from bitdelta.checkpoint import CheckpointReader, save_checkpoint

    seven, forty, seq = (ModelArgs.from_hf(read_config(bases[n])) for n in ("falcon-7b", "falcon-40b", "falcon-seq"))
    assert (seven.n_kv_heads, seven.parallel, seven.parallel_mlp_norm, seven.tie_embeddings) == (1, True, False, True)
    assert seven.norm_roles() == ("input_layernorm", None, None, None)
    assert (forty.n_kv_heads, forty.parallel_mlp_norm) == (2, True)
    assert forty.norm_roles() == ("input_layernorm", None, "post_attention_layernorm", None)
    assert (seq.n_kv_heads, seq.parallel, seq.parallel_mlp_norm, seq.tie_embeddings) == (4, False, False, False)
    for name, runs in (("falcon-7b", (32, 40)), ("falcon-40b", (16, 24)), ("falcon-seq", (8, 16))):
        with safe_open(str(bases[name] / "model.safetensors"), "pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}
        with CheckpointReader(bases[name]) as r:  # the first k head's rows of the fused tensor
            k = r.get("model.layers.0.self_attn.k_proj.weight")
            assert torch.equal(k[:8], stored["transformer.h.0.self_attention.query_key_value.weight"][slice(*runs)])
            q = r.get("model.layers.1.self_attn.q_proj.weight")
            for rows in (((16, 32),), ((0, 8), (24, 32)), ((4, 20),)):  # a tensor-parallel rank's heads, any rows
                part = r.get_part("model.layers.1.self_attn.q_proj.weight", rows=rows, cols=(8, 24))
                assert torch.equal(part, torch.cat([q[a:b, 8:24] for a, b in rows]))
            state = dict(r)
        out = save_checkpoint(state, tmp_path / name, read_config(bases[name]), side_files_from=bases[name])
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == sorted(stored) and all(torch.equal(f.get_tensor(k), stored[k]) for k in stored)
    cfg = read_config(bases["falcon-40b"])
    old = {k: v for k, v in cfg.items() if k not in ("hidden_size", "num_attention_heads", "num_hidden_layers")}
    old |= {"n_embed": 32, "n_head": 4, "n_layer": 2}
    assert ModelArgs.from_hf(old) == forty
    wide = {k: v for k, v in cfg.items() if k != "ffn_hidden_size"}
    assert ModelArgs.from_hf(wide).intermediate_size == 128  # 4 × hidden_size, as transformers' class
    refused = {
        "alibi": {"alibi": True},
        "bias": {"bias": True},
        "without parallel_attn": {"parallel_attn": False},
        "num_ln_in_parallel_attn 3": {"num_ln_in_parallel_attn": 3},
        "num_ln_in_parallel_attn 2 without": {"new_decoder_architecture": False, "num_ln_in_parallel_attn": 2},
        "num_key_value_heads 4": {"num_key_value_heads": 4},
        "apply_residual_connection_post_layernorm": {"apply_residual_connection_post_layernorm": True},
    }
    for why, change in refused.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**cfg, **change})


def test_gptj_configs_and_checkpoints_as_transformers_reads_them(tmp_path, bases):
    """GPT-J: its spellings (n_embd, n_head, n_inner, activation_function, ...), GLM's interleaved rope over
    rotary_dim dims of each head, a parallel block under one norm and a biased head; its checkpoints' names
    (`transformer.h.N.attn.q_proj`, `ln_1`, `transformer.wte`) read as the canonical ones and written back bit
    for bit, an old checkpoint's causal-mask buffers not read; a null rotary_dim (transformers' GPT-J cannot
    run it) and rope fields it does not read refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bitdelta.checkpoint import CheckpointReader, save_checkpoint

    cfg = read_config(bases["gptj"])
    a = ModelArgs.from_hf(cfg)
    assert (a.dim, a.n_heads, a.intermediate_size, a.act, a.rope.dim, a.rope.interleaved) == (
        32,
        4,
        80,
        "gelu_new",
        4,
        True,
    )
    assert a.parallel and a.norm_roles() == ("input_layernorm", None, None, None) and a.family.head_bias
    with safe_open(str(bases["gptj"] / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    with CheckpointReader(bases["gptj"]) as r:
        assert torch.equal(
            r.get("model.layers.1.self_attn.v_proj.weight"), stored["transformer.h.1.attn.v_proj.weight"]
        )
        assert torch.equal(r.get("model.layers.0.input_layernorm.bias"), stored["transformer.h.0.ln_1.bias"])
        assert torch.equal(r.get("model.embed_tokens.weight"), stored["transformer.wte.weight"])
        state = dict(r)
    out = save_checkpoint(state, tmp_path / "again", cfg, side_files_from=bases["gptj"])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(stored) and all(torch.equal(f.get_tensor(k), stored[k]) for k in stored)
    save_file(
        {**stored, "transformer.h.0.attn.bias": torch.ones(2), "transformer.h.1.attn.masked_bias": torch.ones(1)},
        str(out / "model.safetensors"),
    )
    with CheckpointReader(out) as r:
        assert sorted(r.keys()) == sorted(state)
    wide = {k: v for k, v in cfg.items() if k != "n_inner"}
    assert ModelArgs.from_hf(wide).intermediate_size == 128  # 4 × n_embd, as transformers' GPT-J
    for why, change in {
        "rotary_dim None": {"rotary_dim": None},
        "rotary_dim 16": {"rotary_dim": 16},
        "'rope_theta'": {"rope_theta": 5e5},
    }.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**cfg, **change})


def test_starcoder2_configs_as_transformers_reads_them(bases):
    """StarCoder2: every projection biased by use_bias, LayerNorms always biased (norm_epsilon), an ungated
    MLP (c_fc, c_proj: the gate_up group is c_fc alone), windows on every layer where sliding_window is
    set; on two tensor-parallel ranks c_fc's columns split alone; the mlp_type and norm_type its config.json
    carries accepted where they say what transformers builds."""
    from bitdelta.shard import TPLayout

    cfg = read_config(bases["starcoder2"])
    a = ModelArgs.from_hf(cfg)
    assert a.layout == "q,k,v,o,c_fc,c_proj;bias=q,k,v,o,c_fc,c_proj"
    assert (a.group_shapes()["gate_up"], a.windows, a.act, a.norm_eps) == ((48, 32), (8, 8), "gelu_tanh", 1e-5)
    assert ModelArgs.from_hf({**cfg, "use_bias": False}).layout == "q,k,v,o,c_fc,c_proj"
    assert ModelArgs.from_hf({**cfg, "use_bias": False}).family.norm_bias  # the norms keep theirs
    assert ModelArgs.from_hf({**cfg, "sliding_window": None}).windows == ()
    assert ModelArgs.from_hf({**cfg, "norm_epsilon": 1e-6}).norm_eps == 1e-6
    assert TPLayout(a, 2, 1).group_rows("gate_up") == ((24, 48),)
    shipped = {**cfg, "mlp_type": "default", "norm_type": "layer_norm"}  # as StarCoder2's config.json has them
    assert ModelArgs.from_hf(shipped) == a
    for key, bad in (("mlp_type", "gated"), ("norm_type", "rms_norm")):
        with pytest.raises(UnsupportedModel, match=key):
            ModelArgs.from_hf({**shipped, key: bad})


def test_nemotron_and_arcee_configs_as_transformers_reads_them(bases):
    """Nemotron: LayerNorm1P (a LayerNorm with its bias, scaling by w + 1) under norm_eps, the rope over half of
    each head by default, an ungated relu² MLP (up_proj, down_proj: the gate_up group is up alone), attention
    and MLP biases by their switches; Arcee: Llama's layer with the same MLP; another activation refused."""
    cfg = read_config(bases["nemotron"])
    a = ModelArgs.from_hf(cfg)
    assert a.layout == "q,k,v,o,up,down;bias=q,k,v,o,up,down"
    assert (a.act, a.rope.dim, a.head_dim, a.norm_eps, a.group_shapes()["gate_up"]) == ("relu2", 8, 16, 1e-5, (48, 32))
    assert a.family.norm_plus_one and a.family.norm_bias and not a.parallel
    assert [k for k, _, _ in a.norm_params()][2:] == ["input_layernorm.bias", "post_attention_layernorm.bias"]
    assert ModelArgs.from_hf({**cfg, "attention_bias": False, "mlp_bias": False}).layout == "q,k,v,o,up,down"
    assert ModelArgs.from_hf({**cfg, "norm_eps": 1e-6}).norm_eps == 1e-6
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 10000.0}
    assert ModelArgs.from_hf(old) == a  # the older spelling, partial_rotary_factor left at the class's 0.5
    assert ModelArgs.from_hf({**old, "partial_rotary_factor": 1.0}).rope.dim == 16
    arcee = ModelArgs.from_hf(read_config(bases["arcee"]))
    assert (arcee.layout, arcee.act, arcee.rope.kind) == ("q,k,v,o,up,down", "relu2", "yarn")
    assert not arcee.family.layer_norm
    for name in ("nemotron", "arcee"):
        with pytest.raises(UnsupportedModel, match="hidden_act 'relu'"):
            ModelArgs.from_hf({**read_config(bases[name]), "hidden_act": "relu"})


def test_hunyuan_configs_as_transformers_reads_them(bases):
    """Hunyuan dense: per-head q and k norms under its names, after the rope; its rope "dynamic" with an alpha is
    transformers' fixed NTK stretch of θ (the yarn-like fields its config.json carries beside it unread), without
    one the length-dependent dynamic rope; a bad alpha and a field no rope reads refused."""
    cfg = read_config(bases["hunyuan"])
    a = ModelArgs.from_hf(cfg)
    assert a.layout == "q,k,v,o,gate,up,down;qk_norm" and a.family.qk_after_rope
    assert [k for k, _, _ in a.norm_params()][2:] == ["self_attn.query_layernorm", "self_attn.key_layernorm"]
    assert (a.rope.kind, a.rope.theta) == ("default", 10000.0 * 1000.0 ** (16 / 14))
    shipped = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "beta_fast": 32, "beta_slow": 1}
    shipped |= {"factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # as Hunyuan-7B's config.json has them
    assert ModelArgs.from_hf({**cfg, "rope_parameters": shipped}) == a
    plain = ModelArgs.from_hf({**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    assert plain.rope.kind == "dynamic" and plain.rope.theta == 1e4
    for bad, why in ((-1.0, "alpha must be a positive number"), ("big", "alpha must be a positive number")):
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**cfg, "rope_parameters": {**shipped, "alpha": bad}})
    with pytest.raises(UnsupportedModel, match="low_freq_factor"):
        ModelArgs.from_hf({**cfg, "rope_parameters": {**shipped, "low_freq_factor": 1.0}})
    switches = {"use_qk_norm": True, "use_cla": False, "use_mla": False, "use_rotary_pos_emb": True}  # Tencent's
    assert ModelArgs.from_hf({**cfg, **switches}) == a
    for key, bad in (("use_cla", True), ("use_qk_norm", False)):
        with pytest.raises(UnsupportedModel, match=key):
            ModelArgs.from_hf({**cfg, **switches, key: bad})


def test_gemma_configs_as_transformers_reads_them(bases):
    """Gemma 3's two rope spellings give one description; what Gemma's code would run otherwise is
    refused by name."""
    g3 = read_config(bases["gemma3"])
    args = ModelArgs.from_hf(g3)
    assert args.windows == (8, None) and args.local(0) and not args.local(1)
    assert (args.rope.kind, args.rope.theta, args.rope.factor) == ("linear", 1e6, 2.0)
    assert (args.local_rope.kind, args.local_rope.theta) == ("default", 1e4)
    assert (
        args.attn_scale == 24**-0.5
        and ModelArgs.from_hf(read_config(bases["gemma"])).attn_scale is None
        and args.act == "gelu_tanh"
        and args.embed_scale == 32**0.5
    )
    old = {k: v for k, v in g3.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_local_base_freq": 1e4}
    old |= {"sliding_window_pattern": 2}  # the old spelling of layer_types: every 2nd layer is full
    assert ModelArgs.from_hf(old) == args
    g2 = read_config(bases["gemma2"])
    two = ModelArgs.from_hf(g2)
    assert (
        two.tie_embeddings
        and ModelArgs.from_hf({k: v for k, v in g2.items() if k != "tie_word_embeddings"}).tie_embeddings
    )
    assert (two.attn_softcap, two.logit_softcap, two.windows, two.local_rope) == (4.0, 3.0, (8, None), None)
    assert ModelArgs.from_hf({k: v for k, v in g2.items() if k != "layer_types"}).windows == (8, None)
    gemma = read_config(bases["gemma"])
    cases = {
        "'attn_logit_softcapping'": (g3, {"attn_logit_softcapping": 50.0}),  # transformers' Gemma 3 ignores it
        "'use_bidirectional_attention'": (g3, {"use_bidirectional_attention": True}),
        "disagree": (g2, {"hidden_act": "gelu"}),
        "without hidden_activation": (gemma, {"hidden_act": "gelu", "hidden_activation": None}),
        "'query_pre_attn_scalar' must be a positive": (g2, {"query_pre_attn_scalar": 0}),
        "sliding_window is not set": (g2, {"sliding_window": None}),
        "sliding_window_size 16 and sliding_window 8 disagree": (g2, {"sliding_window_size": 16}),
        "only full_attention and sliding_attention": (g3, {"rope_parameters": {**g3["rope_parameters"], "x": {}}}),
    }
    for why, (cfg, change) in cases.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**copy.deepcopy(cfg), **change})
    # Gemma 3 as its multimodal checkpoints ship: its text model, as Gemma3ForCausalLM reads it
    mm = read_config(bases["gemma3-mm"])
    assert mm["model_type"] == "gemma3" and mm["vision_config"]
    assert ModelArgs.from_hf(mm) == dataclasses.replace(args, bos_token_id=mm.get("bos_token_id", args.bos_token_id))
    wrapper_cases = {
        "'audio_config'": {"audio_config": {"hidden_size": 8}},
        "needs a text_config": {"text_config": None},
        "must be a gemma3_text config": {"text_config": {**mm["text_config"], "model_type": "llama"}},
        "tie_word_embeddings is False in the gemma3 config, True in its text_config": {"tie_word_embeddings": False},
    }
    for why, change in wrapper_cases.items():
        with pytest.raises(UnsupportedModel, match=why):
            ModelArgs.from_hf({**copy.deepcopy(mm), **change})


def test_sliding_window_only_where_transformers_applies_it(bases):
    qwen = read_config(bases["qwen2.5"])
    assert ModelArgs.from_hf({**qwen, "sliding_window": 4096, "use_sliding_window": False}).windows == ()
    del qwen["layer_types"]  # transformers derives them from max_window_layers when the config has none
    on = ModelArgs.from_hf({**qwen, "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1})
    assert on.windows == (None, 8)
    on = ModelArgs.from_hf({**on.to_hf(), "layer_types": ["sliding_attention", "full_attention"]})
    assert on.windows == (8, None)
    assert ModelArgs.from_hf({**read_config(bases["phi3-mini"]), "sliding_window": 2047}).windows == (2047, 2047)


def test_the_checkpoint_must_match_its_config(bases, tmp_path):
    """A config that says Phi-3 over a checkpoint with split projections is refused, not half-loaded."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(bases["llama-3.1"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(
        json.dumps({**cfg, "model_type": "phi3", "rope_parameters": {"rope_type": "default"}})
    )
    with pytest.raises(ValueError, match="missing .*qkv_proj.*unexpected"):
        load_model(bad)


def as_v1(path, out):
    """The same delta as the v1 tools wrote it: no architecture/layout, format_version 1."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    md = header["__metadata__"]
    del md["architecture"], md["layout"]
    md["format_version"] = "1"
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    return out


def test_v1_files_are_read_as_llama_or_mistral_deltas(tmp_path, bases):
    from bitdelta.compress import apply, compress
    from bitdelta.format import ArchMismatchError, load_delta, verify
    from bitdelta.model import attach_delta
    from bitdelta.testing.family import make_finetune
    from tests.support.family import make_tiny_family

    base, (ft,) = make_tiny_family(tmp_path / "fam", n_variants=1)
    v2 = compress(base, ft, tmp_path / "v.bitdelta.safetensors", progress=False)
    v1 = as_v1(v2, tmp_path / "v1.bitdelta.safetensors")
    verify(v1)  # every tensor's sha256 still holds
    d1, d2 = load_delta(v1), load_delta(v2)
    assert (d1.meta.architecture, d1.meta.layout) == ("", "q,k,v,o,gate,up,down")
    assert (d2.meta.architecture, d2.meta.layout) == ("llama", "q,k,v,o,gate,up,down")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(attach_delta(load_model(base), d1)(ids), attach_delta(load_model(base), d2)(ids))
    assert load_model(apply(base, v1, tmp_path / "applied", progress=False))  # apply reads v1 too
    # a v1 delta on a Qwen2 base (biases: another layout) is refused naming both
    qwen_ft = make_finetune(bases["qwen2.5"], tmp_path / "qft", seed=1)
    q = compress(bases["qwen2.5"], qwen_ft, tmp_path / "q.bitdelta.safetensors", progress=False)
    assert load_delta(q).meta.layout == "q,k,v,o,gate,up,down;bias=q,k,v"
    with pytest.raises(ArchMismatchError, match=r"llama/mistral \(format v1\).*qwen2 with layout"):
        attach_delta(load_model(bases["qwen2.5"]), d1)


@pytest.mark.parametrize("name", ["llama-3.2", "qwen2.5", "qwen3", "phi3-mini"])
def test_planner_bytes_equal_a_written_delta_of_each_family(tmp_path, bases, name):
    """`bitdelta plan`'s delta bytes for a full fine-tune are the bytes `bitdelta compress` writes,
    per family (tied embeddings, biases, q/k norms, fused projections), so the published configs'
    plans (configs/llama-3.1-*.json, qwen2.5-*.json) are the same arithmetic at their shapes."""
    from bitdelta import plan
    from bitdelta.compress import compress
    from bitdelta.format import read_header
    from bitdelta.testing.family import make_finetune

    ft = make_finetune(bases[name], tmp_path / "ft", seed=4)
    s = plan.Shape.from_hf(read_config(bases[name]))
    for alpha, emb in (("row", "dense"), ("matrix", "sign")):
        out = compress(
            bases[name], ft, tmp_path / f"{alpha}-{emb}.st", alpha_mode=alpha, embeddings=emb, progress=False
        )
        roles = read_header(out).bytes_by_role()
        want = plan.delta_bytes(s, "fp32", alpha, emb)
        assert (roles["sign"], roles["alpha"], roles["dense"]) == (want.signs, want.alpha, want.dense), (alpha, emb)


def test_plans_of_published_configs():
    """Parameter counts of the published configs, as their model cards give them."""
    from pathlib import Path

    from bitdelta import plan

    root = Path(__file__).resolve().parents[2] / "configs"
    counts = {
        "llama-3.1-8b": 8.03e9,
        "llama-3.1-70b": 70.55e9,
        "qwen2.5-7b": 7.62e9,
        "qwen2.5-72b": 72.71e9,
        "gemma-2-9b": 9.24e9,
        "gemma-3-1b": 1.00e9,
        "mixtral-8x7b": 46.70e9,
        "qwen3-30b-a3b": 30.53e9,
        "qwen1.5-moe-a2.7b": 14.32e9,  # "14.3B" on its card: 14,315,784,192 with the shared experts
    }
    for name, n in counts.items():
        gpus = 1 if name == "gemma-3-1b" else 8  # its 4 query heads do not split 8 ways
        p = plan.make_plan(json.loads((root / f"{name}.json").read_text()), variants=4, gpu_mem=80e9, gpus=gpus)
        assert p.params == pytest.approx(n, rel=1e-3), name
        args = ModelArgs.from_hf(json.loads((root / f"{name}.json").read_text()))
        matrices = args.n_layers * sum(m.d_out * m.d_in for m in args.matrices())
        assert p.delta.dense > 0 and p.delta.signs == pytest.approx(matrices / 8, rel=0.01)  # the layers' signs


@pytest.mark.parametrize("name", FAMILY_MEMBERS)
def test_compression_and_distillation_run_on_each_family(tmp_path, bases, name, capsys):
    """compress → distill (α only, biases and norms kept dense) → save → inspect shows the layout;
    the distilled delta is closer to the fine-tune on windows of the calibration text."""
    from bitdelta import cli
    from bitdelta import distill as d
    from bitdelta.compress import compress
    from bitdelta.format import load_delta
    from bitdelta.testing.family import make_finetune

    ft = make_finetune(bases[name], tmp_path / "ft", seed=5, scale=0.02)
    delta = load_delta(compress(bases[name], ft, tmp_path / "v.bitdelta.safetensors", progress=False))
    calib = torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(0))
    # 8 windows a step: on random text fewer fit α to their own tokens (Gemma's tiny base got worse at 2)
    cfg = d.DistillConfig(steps=20, lr=1e-4, batch=8, seq_len=24)
    heldout = d.token_windows(calib, cfg.seq_len, 4, seed=1)  # of the calibration text (random text generalises little)
    distilled, record = d.distill(bases[name], ft, delta, calib, cfg, heldout, progress=False)
    assert record["heldout_mse_after"] < record["heldout_mse_before"], record
    assert distilled.dense.keys() == delta.dense.keys()  # biases, norms: dense, untouched by distillation
    out = d.save(distilled, tmp_path / "distilled.bitdelta.safetensors")
    assert cli.main(["inspect", str(out)]) in (0, None)
    args = ModelArgs.from_hf(read_config(bases[name]))
    shown = capsys.readouterr().out
    assert f"architecture      {args.model_type}, layout {args.layout}" in shown
    biases = int(re.search(r"\((\d+) of them biases\)", shown).group(1))
    layer_biases = sum(key.endswith(".bias") for key, _, _ in args.norm_params())  # StableLM's (not its q/k norms')
    norm_biases = (layer_biases * args.n_layers + 1) if args.family.norm_bias else 0
    head_bias = 1 if args.family.head_bias else 0  # Phi's lm_head.bias
    assert biases == sum(m.bias for m in args.matrices()) * args.n_layers + norm_biases + head_bias  # every bias moved


@pytest.mark.parametrize("name", FAMILY_MEMBERS)
def test_the_applied_checkpoint_decodes_as_the_variant(tmp_path, bases, name):
    """`bitdelta compress` of a full fine-tune (every weight, bias and norm moved), then `bitdelta
    apply`: transformers' greedy tokens on the applied (dense) checkpoint equal the compact model's
    with the delta attached, from a prompt shorter than the original context into a continuation
    past it and past the sliding windows. The worker's step equals the attached delta
    (tests/gpu_worker/test_worker_families.py), so what a family's variant serves is what
    transformers makes of `apply`'s output; a few members also as processes behind the router
    (tests/router/test_router_families.py)."""
    from bitdelta import cli
    from bitdelta.format import load_delta
    from bitdelta.model import attach_delta
    from bitdelta.testing.family import make_finetune
    from bitdelta_kernels.settings import configured

    ft = make_finetune(bases[name], tmp_path / "ft", seed=20, scale=0.02)
    delta, applied = tmp_path / "v.bitdelta.safetensors", tmp_path / "applied"
    argv = ["--base", str(bases[name]), "--finetuned", str(ft), "--out", str(delta), "--variant", "v"]
    assert not cli.main(["compress", *argv])
    assert not cli.main(["apply", "--base", str(bases[name]), "--delta", str(delta), "--out", str(applied)])
    prompt = torch.randint(0, 256, (ORIGINAL - 4,), generator=torch.Generator().manual_seed(3)).tolist()
    n = LONG - len(prompt)
    want = hf_greedy(applied, prompt, n, stop_at_eos=False)
    assert want != hf_greedy(bases[name], prompt, n, stop_at_eos=False)  # the variant answers differently
    with configured(backend="cpu"):  # the C kernels, as the worker on CPU (the interpreter: seconds a token)
        assert attach_delta(load_model(bases[name]), load_delta(delta)).generate(prompt, n) == want
