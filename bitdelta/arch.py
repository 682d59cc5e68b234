"""What a base model is: one typed description per family, read from a Hugging Face config.

    args = ModelArgs.from_hf(json.load(open("config.json")))
    args.family           # Family: parameter names, fused or split projections, biases, norms
    args.rope             # Rope: the rotary variant and its parameters
    args.matrices()       # the compressed matrices of one layer, as the checkpoint stores them

Everything that reads a base (the compact model, the worker's runner and slots,
the loader's checks, compression, apply, verify, distillation, the planner)
takes its layout from here, so a family is described once.

`from_hf` honours every config field that changes the forward pass or refuses
the config naming the field: a served answer is right or there is none. Key
spellings of both transformers generations are read (`rope_scaling` or
`rope_parameters`, `rope_theta` at the top or inside `rope_parameters`,
`type` or `rope_type`). Fields that only matter for training (dropouts,
initializer range) or for other tools are ignored; any other field whose value
is set is refused, so a new transformers feature cannot slip through as the
default behaviour.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SUPPORTED = (
    "llama",
    "mistral",
    "ministral",
    "ministral3",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "ernie4_5",
    "seed_oss",
    "glm",
    "glm4",
    "olmo",
    "olmo2",
    "olmo3",
    "smollm3",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "cohere",
    "cohere2",
    "exaone4",
    "internlm3",
    "stablelm",
    "starcoder2",
    "nemotron",
    "arcee",
    "hunyuan_v1_dense",
    "phi",
    "gpt_neox",
    "falcon",
    "gptj",
)
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class UnsupportedModel(ValueError):
    """A config asks for something this build cannot serve exactly (the message names the field)."""


@dataclass(frozen=True)
class Family:
    """How one architecture lays out its parameters (the switches of the one forward pass)."""

    model_type: str
    fused: bool  # Phi-3: self_attn.qkv_proj and mlp.gate_up_proj instead of q/k/v and gate/up
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k (self_attn.q_norm / k_norm, [head_dim])
    partial_rotary: bool  # the family honours partial_rotary_factor (rope on the first dims only)
    fields: frozenset[str]  # the family-specific config fields it reads
    # Gemma: every RMSNorm scales by (1 + w) in fp32 and rounds once; the embeddings are scaled by
    # √hidden_size (rounded to the model's dtype); the MLP's gate is hidden_activation (GELU, tanh form)
    gemma: bool = False
    # Gemma 2/3: the attention's and the MLP's outputs are normed before the residual add, and the
    # MLP's input by its own norm (post_attention_layernorm, pre_/post_feedforward_layernorm)
    sandwich: bool = False
    # OLMo 2/3, EXAONE 4: only the outputs are normed (post_attention_layernorm, post_feedforward_layernorm;
    # no input norm)
    post_norm: bool = False
    # OLMo 2/3: every RMSNorm rounds once (w · x in fp32, as Gemma's), not after normalising (Llama's)
    norm_once: bool = False
    # OLMo 2, OLMoE: the q and k norms span the whole projection (every head together), not one head
    qk_whole: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE): the module path of each layer's sparse block in place of
    # a dense MLP ("block_sparse_moe", "mlp"); its router is `<moe>.gate`, expert e's projections
    # `<moe>.experts.<e>.<gate, up, down names>`
    moe: str | None = None
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    moe_round: bool = False  # the top-k routing weights rounded to the model's dtype (Qwen3-MoE's, OLMoE's)
    # Qwen2-MoE: beside the routed experts, every token goes through `<moe>.shared_expert` (a gated MLP of
    # shared_expert_intermediate_size) scaled by sigmoid(`<moe>.shared_expert_gate` · x), a [1, dim] matrix
    shared_expert: bool = False
    fused_mlp: bool = False  # GLM: mlp.gate_up_proj fused (gate ‖ up) while q, k, v stay apart
    interleaved_rope: bool = False  # GLM: the rope's pairs are dims (2i, 2i + 1) (Rope.interleaved)
    fp32_rope: bool = False  # ERNIE 4.5, Cohere: the rotation in fp32, rounded once (Rope.fp32)
    fp32_rope_tables: bool = False  # ERNIE 4.5: its cos/sin tables kept in fp32 (Cohere's: the model's dtype)
    # Cohere, StableLM, StarCoder2: LayerNorm in place of RMSNorm (the mean subtracted), w · x in fp32 and one
    # rounding (a bias added before it where norm_bias)
    layer_norm: bool = False
    # OLMo 1: LayerNorms with neither weight nor bias. The checkpoint stores none; `implied_tensors` names each
    # norm's weight as ones, which bitdelta.checkpoint's reader supplies and its writer leaves out (x̂ · 1 in fp32,
    # rounded once, is x̂ rounded once: OLMo's own F.layer_norm(x.float()) cast back)
    weightless_norms: bool = False
    # Cohere: a parallel block, the attention and the MLP both read the one input norm's output and both
    # are added to the residual (x + attention + MLP, added in that order); StableLM's where
    # use_parallel_residual (ModelArgs.parallel)
    parallel: bool = False
    norm_bias: bool = False  # StableLM: every LayerNorm has a bias (`<norm>.bias`, added before the rounding)
    # Nemotron's LayerNorm1P: each LayerNorm scales by (w + 1), that sum rounded to the weights' dtype first
    norm_plus_one: bool = False
    # StarCoder2, Nemotron, Arcee: an ungated MLP, down(act(up(x))), under these (up, down) module names inside
    # `mlp` (its up projection is the gate_up group alone); None: the gated one, down(act(gate(x)) · up(x))
    ungated_mlp: tuple[str, str] | None = None
    norm_eps_field: str = "rms_norm_eps"  # the config field of the norms' eps
    o_bias: bool = True  # attention_bias gives o_proj a bias too (GLM's: q, k, v only)
    # the per-head q and k norms' module paths inside a layer (Hunyuan's self_attn.query_layernorm, key_layernorm)
    qk_norm_names: tuple[str, str] = ("self_attn.q_norm", "self_attn.k_norm")
    qk_after_rope: bool = False  # Hunyuan: q and k normed after the rope, not before
    o_name: str = "o_proj"  # the attention's output projection inside self_attn (Phi's dense)
    final_norm: str = "norm"  # the final norm's module inside `model` (Phi's final_layernorm)
    head_bias: bool = False  # Phi: the LM head has a bias (lm_head.bias)
    biased: bool = False  # Phi: every projection has a bias, whatever the config says (it has no switch)
    mlp_biased: bool = False  # GPT-NeoX: the MLP's projections have biases, whatever the config says
    # Phi: a parallel block's two outputs added first, then the residual ((attention + MLP) + x; Cohere's
    # and StableLM's: (x + attention) + MLP)
    sublayers_first: bool = False
    # GPT-NeoX: a parallel block's MLP reads its own norm of the block's input (post_attention_layernorm), not the
    # attention's input norm
    parallel_mlp_norm: bool = False
    # how the family's checkpoints name and fuse the tensors (bitdelta.checkpoint.stored_form: "gpt_neox",
    # "falcon"; None: as the canonical names, `model.layers.N.self_attn.q_proj.weight`, ...)
    stored_form: str | None = None
    # a sandwich layer's norms (Family.sandwich): of the attention's output, of the MLP's input, of the MLP's output
    sandwich_names: tuple[str, str, str] = (
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )


# The mixture-of-experts fields every MoE family reads (either spelling of the expert count)
_MOE_FIELDS = frozenset({"num_local_experts", "num_experts", "num_experts_per_tok"})

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", False, False, False, frozenset({"attention_bias", "mlp_bias"})),
    "mistral": Family("mistral", False, False, False, frozenset({"sliding_window"})),
    # Ministral (Ministral-8B-2410): Mistral's layer, sliding windows on the layers layer_types names (default:
    # every layer where sliding_window is set)
    "ministral": Family("ministral", False, False, False, frozenset({"sliding_window", "layer_types"})),
    # InternLM3 (Shanghai AI Lab): Llama's layer (transformers runs it as LlamaForCausalLM), its config's
    # qkv_bias and bias the spellings of attention_bias and mlp_bias
    "internlm3": Family("internlm3", False, False, False, frozenset({"attention_bias", "mlp_bias"})),
    # Ministral 3: Mistral's layer, a yarn rope by default, and Llama 4's attention temperature: q × (1 + β ·
    # log(1 + ⌊position / original_max_position_embeddings⌋)) after the rope (rope_parameters'
    # llama_4_scaling_beta β; 1 below the original context)
    "ministral3": Family("ministral3", False, False, False, frozenset({"sliding_window"})),
    "qwen2": Family(
        "qwen2",
        False,
        False,
        False,
        frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    ),
    "qwen3": Family(
        "qwen3",
        False,
        True,
        False,
        frozenset({"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}),
    ),
    "phi3": Family("phi3", True, False, True, frozenset({"sliding_window", "original_max_position_embeddings"})),
    "gemma": Family("gemma", False, False, False, frozenset({"attention_bias", "hidden_activation"}), gemma=True),
    "gemma2": Family(
        "gemma2",
        False,
        False,
        False,
        frozenset(
            {
                "attention_bias",
                "hidden_activation",
                "query_pre_attn_scalar",
                "sliding_window",
                "layer_types",
                "attn_logit_softcapping",
                "final_logit_softcapping",
                "sliding_window_size",  # early Gemma 2 configs: sliding_window's twin
            }
        ),
        gemma=True,
        sandwich=True,
    ),
    "gemma3_text": Family(
        "gemma3_text",
        False,
        True,
        False,
        frozenset(
            {
                "attention_bias",
                "hidden_activation",
                "query_pre_attn_scalar",
                "sliding_window",
                "sliding_window_pattern",
                "layer_types",
                "final_logit_softcapping",
                "rope_local_base_freq",
            }
        ),
        gemma=True,
        sandwich=True,
    ),
    # Granite: Llama's layer with four scalars (embedding_multiplier, residual_multiplier,
    # attention_multiplier as the scores' scale, logits_scaling)
    "granite": Family(
        "granite",
        False,
        False,
        False,
        frozenset(
            {
                "attention_bias",
                "mlp_bias",
                "embedding_multiplier",
                "residual_multiplier",
                "attention_multiplier",
                "logits_scaling",
            }
        ),
    ),
    # OLMo 1 (AI2: OLMo-1B, OLMo-7B and its 0424/0724 releases, transformers' `olmo`): Llama's layer under
    # LayerNorms without parameters (eps 1e-5), q, k and v clipped to ±clip_qkv as projected where it is set
    "olmo": Family(
        "olmo", False, False, False, frozenset({"attention_bias", "clip_qkv"}), layer_norm=True, weightless_norms=True
    ),
    "olmo2": Family(
        "olmo2", False, True, False, frozenset({"attention_bias"}), post_norm=True, norm_once=True, qk_whole=True
    ),
    # ERNIE 4.5 (Baidu, the dense ones): Llama's layer, every projection biased where use_bias, an interleaved
    # rope computed in fp32 and rounded once
    "ernie4_5": Family(
        "ernie4_5",
        False,
        False,
        False,
        frozenset({"use_bias"}),
        interleaved_rope=True,
        fp32_rope=True,
        fp32_rope_tables=True,
    ),
    # Seed-OSS (ByteDance): Llama's layer, q/k/v biases by attention_bias and o's by attention_out_bias
    "seed_oss": Family(
        "seed_oss", False, False, False, frozenset({"attention_bias", "attention_out_bias", "mlp_bias"}), o_bias=False
    ),
    # GLM (GLM-4-9B-chat-hf): Llama's layer with the MLP's gate and up fused, q/k/v biases (attention_bias),
    # and the rope over the first half of each head (partial_rotary_factor 0.5 by default), its pairs
    # interleaved (dims 2i, 2i+1) as GPT-J's, not split in halves
    "glm": Family(
        "glm",
        False,
        False,
        True,
        frozenset({"attention_bias"}),
        fused_mlp=True,
        o_bias=False,
        interleaved_rope=True,
    ),
    # GLM-4 (GLM-4-0414, GLM-Z1): GLM's layer with a sandwich of norms as Gemma 2's, under its own names
    "glm4": Family(
        "glm4",
        False,
        False,
        True,
        frozenset({"attention_bias"}),
        sandwich=True,
        fused_mlp=True,
        o_bias=False,
        interleaved_rope=True,
        sandwich_names=("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    ),
    # OLMo 3 (AI2): OLMo 2's layer, sliding windows on the layers layer_types names (default: three of every
    # four), and a rope per layer type as Gemma 3 (rope_parameters keyed by it; the old spelling's
    # rope_scaling is the full layers')
    "olmo3": Family(
        "olmo3",
        False,
        True,
        False,
        frozenset({"attention_bias", "sliding_window", "layer_types"}),
        post_norm=True,
        norm_once=True,
        qk_whole=True,
    ),
    # SmolLM3 (Hugging Face): Llama's layer without the rope on the layers no_rope_layers marks 0 (every
    # no_rope_layer_interval-th by default: NoPE), sliding windows where use_sliding_window (on the NoPE
    # layers by default)
    "smollm3": Family(
        "smollm3",
        False,
        False,
        False,
        frozenset(
            {
                "attention_bias",
                "mlp_bias",
                "use_sliding_window",
                "sliding_window",
                "no_rope_layers",
                "no_rope_layer_interval",
                "layer_types",
            }
        ),
    ),
    # Mixtral: Mistral's attention, a sparse block of SiLU-gated experts w1 (gate), w3 (up), w2 (down);
    # the top-k routing weights always renormalised
    "mixtral": Family(
        "mixtral",
        False,
        False,
        False,
        _MOE_FIELDS | {"sliding_window"},
        moe="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
    ),
    # Qwen3-MoE: Qwen3's attention (per-head q/k norms), experts of moe_intermediate_size, the top-k
    # weights renormalised where norm_topk_prob says so. Every layer sparse: decoder_sparse_step 1 and
    # no mlp_only_layers (max_window_layers is not read by transformers' Qwen3-MoE)
    "qwen3_moe": Family(
        "qwen3_moe",
        False,
        True,
        False,
        _MOE_FIELDS
        | {
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        },
        moe="mlp",
        moe_round=True,
    ),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q, k, v biases where qkv_bias), experts
    # of moe_intermediate_size and a shared expert, the top-k weights renormalised where norm_topk_prob
    # and always rounded to the model's dtype. Every layer sparse, as in Qwen3-MoE
    "qwen2_moe": Family(
        "qwen2_moe",
        False,
        False,
        False,
        _MOE_FIELDS
        | {
            "qkv_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        },
        moe="mlp",
        moe_round=True,
        shared_expert=True,
    ),
    # OLMoE (AI2): Llama's pre-norm layer, q and k normed over their whole projections, 64 experts, 8 per
    # token, not renormalised by default; q, k (after their norms) and v clipped to ±clip_qkv where it is set
    "olmoe": Family(
        "olmoe",
        False,
        True,
        False,
        _MOE_FIELDS | {"attention_bias", "norm_topk_prob", "clip_qkv"},
        qk_whole=True,
        moe="mlp",
        moe_round=True,
    ),
    # StarCoder2 (BigCode: 3B, 7B, 15B): Mistral's attention with every projection biased (use_bias), LayerNorms
    # with biases (norm_epsilon), and an ungated MLP c_fc -> GELU (tanh form) -> c_proj
    "starcoder2": Family(
        "starcoder2",
        False,
        False,
        False,
        frozenset({"use_bias", "norm_epsilon", "sliding_window"}),
        layer_norm=True,
        norm_bias=True,
        ungated_mlp=("c_fc", "c_proj"),
        norm_eps_field="norm_epsilon",
    ),
    # StableLM (Stability AI: StableLM 2 1.6B and 12B, StableLM-3B-4E1T, their Zephyrs): Llama's layer under
    # LayerNorms with biases, q/k/v biases where use_qkv_bias, the rope over the first partial_rotary_factor of each
    # head (0.25 by default), a parallel block where use_parallel_residual; where qk_layernorm (StableLM 2 12B), q
    # and k normed per head by unbiased LayerNorms of each head's own weights (stored one per head)
    "stablelm": Family(
        "stablelm",
        False,
        False,
        True,
        frozenset({"layer_norm_eps", "use_qkv_bias", "use_parallel_residual", "qk_layernorm"}),
        layer_norm=True,
        norm_bias=True,
        norm_eps_field="layer_norm_eps",
        qk_norm_names=("self_attn.q_layernorm", "self_attn.k_layernorm"),
        stored_form="stablelm",
    ),
    # EXAONE 4 (LG AI Research): OLMo 2's post-norms (rounded as Llama's), Qwen3's per-head q/k norms, sliding
    # windows on three layers of four where sliding_window is set, the full layers then without the rope (NoPE)
    "exaone4": Family(
        "exaone4",
        False,
        True,
        False,
        frozenset({"sliding_window", "sliding_window_pattern", "layer_types"}),
        post_norm=True,
    ),
    # Nemotron (NVIDIA: Nemotron-4, Minitron 4B/8B, Nemotron-Mini-4B): Llama's attention (biases where attention_bias)
    # under LayerNorm1P norms (LayerNorms with biases, scaling by w + 1), the rope over the first half of each head
    # by default, an ungated MLP up_proj -> relu² -> down_proj (biases where mlp_bias)
    "nemotron": Family(
        "nemotron",
        False,
        False,
        True,
        frozenset({"attention_bias", "mlp_bias", "norm_eps"}),
        layer_norm=True,
        norm_bias=True,
        norm_plus_one=True,
        ungated_mlp=("up_proj", "down_proj"),
        norm_eps_field="norm_eps",
    ),
    # Hunyuan dense (Tencent: Hunyuan-0.5B to 7B): Llama's layer, q and k normed per head after the rope (its
    # query_layernorm, key_layernorm), the rope's θ stretched by a fixed NTK alpha (rope_parameters.alpha)
    "hunyuan_v1_dense": Family(
        "hunyuan_v1_dense",
        False,
        True,
        False,
        frozenset({"attention_bias"}),
        qk_norm_names=("self_attn.query_layernorm", "self_attn.key_layernorm"),
        qk_after_rope=True,
    ),
    # Phi (Phi-1, Phi-1.5, Phi-2; Microsoft): a parallel block under one LayerNorm with a bias, every projection
    # biased (q, k, v, dense; the ungated MLP fc1 -> GELU (gelu_new) -> fc2), the rope over the first
    # partial_rotary_factor of each head (0.5 by default), the final LayerNorm `final_layernorm`, a biased head
    "phi": Family(
        "phi",
        False,
        False,
        True,
        frozenset({"layer_norm_eps", "qk_layernorm"}),
        layer_norm=True,
        parallel=True,
        norm_bias=True,
        ungated_mlp=("fc1", "fc2"),
        norm_eps_field="layer_norm_eps",
        o_name="dense",
        final_norm="final_layernorm",
        head_bias=True,
        biased=True,
        sublayers_first=True,
    ),
    # GPT-NeoX (EleutherAI: Pythia 70M–12B and its fine-tunes, GPT-NeoX-20B, Dolly v2, RedPajama-INCITE): LayerNorms
    # with biases, q/k/v (one fused, head-interleaved `query_key_value` as stored) and `dense` biased where
    # attention_bias, an ungated biased MLP dense_h_to_4h -> GELU (exact) -> dense_4h_to_h, the rope over the first
    # rotary_pct of each head (0.25 by default), a parallel block where use_parallel_residual (its default) whose MLP
    # reads its own norm: x + (attention(ln1(x)) + MLP(ln2(x)))
    "gpt_neox": Family(
        "gpt_neox",
        False,
        False,
        True,
        frozenset({"layer_norm_eps", "use_parallel_residual", "attention_bias", "classifier_dropout"}),
        layer_norm=True,
        norm_bias=True,
        ungated_mlp=("dense_h_to_4h", "dense_4h_to_h"),
        norm_eps_field="layer_norm_eps",
        o_name="dense",
        final_norm="final_layer_norm",
        mlp_biased=True,
        sublayers_first=True,
        parallel_mlp_norm=True,
        stored_form="gpt_neox",
    ),
    # Falcon (TII: Falcon-7B, -40B, -180B, Falcon 2 11B and their fine-tunes; not Falcon 3, which is Llama's): stored
    # under its own names, q/k/v fused as its layout says (multi_query: all q heads, one k, one v; the new decoder
    # architecture: grouped per KV head; else per head), LayerNorms with biases (layer_norm_epsilon), an ungated
    # MLP dense_h_to_4h -> GELU (exact; `activation`) -> dense_4h_to_h of ffn_hidden_size (4 × hidden by default),
    # a parallel block where parallel_attn (its default) under one norm, or two (ln_attn, ln_mlp) where the new
    # architecture has num_ln_in_parallel_attn 2 (its default), ((MLP + attention) + x); a tied head by default
    "falcon": Family(
        "falcon",
        False,
        False,
        False,
        frozenset(
            {
                "layer_norm_epsilon",
                "alibi",
                "bias",
                "multi_query",
                "new_decoder_architecture",
                "parallel_attn",
                "num_kv_heads",
                "num_ln_in_parallel_attn",
            }
        ),
        layer_norm=True,
        norm_bias=True,
        ungated_mlp=("dense_h_to_4h", "dense_4h_to_h"),
        norm_eps_field="layer_norm_epsilon",
        o_name="dense",
        final_norm="ln_f",
        sublayers_first=True,
        stored_form="falcon",
    ),
    # GPT-J (EleutherAI: GPT-J-6B and its fine-tunes, GPT4All-J, Dolly v1, Pygmalion-6B): stored under its own
    # names, q, k, v and out_proj unbiased, Phi's parallel block under one LayerNorm with a bias ((attention + MLP)
    # + x), an ungated biased MLP fc_in -> gelu_new -> fc_out, GLM's interleaved rope over the first rotary_dim
    # dims of each head (θ 10⁴), a biased head
    "gptj": Family(
        "gptj",
        False,
        False,
        True,
        frozenset({"layer_norm_epsilon", "attn_pdrop"}),
        layer_norm=True,
        parallel=True,
        norm_bias=True,
        ungated_mlp=("fc_in", "fc_out"),
        norm_eps_field="layer_norm_epsilon",
        o_name="out_proj",
        final_norm="ln_f",
        head_bias=True,
        mlp_biased=True,
        sublayers_first=True,
        interleaved_rope=True,
        stored_form="gptj",
    ),
    # Arcee (AFM-4.5B): Llama's layer with an ungated MLP up_proj -> relu² -> down_proj
    "arcee": Family(
        "arcee", False, False, False, frozenset({"attention_bias", "mlp_bias"}), ungated_mlp=("up_proj", "down_proj")
    ),
    # Cohere (Command R, Command R+, Aya 23, Aya Expanse): a parallel block under one LayerNorm, an interleaved rope
    # rotated in fp32 from tables in the model's dtype, the logits × logit_scale, a tied head by default; where
    # use_qk_norm (Command R+), q and k normed per head by LayerNorms of their own (ModelArgs.qk_heads)
    "cohere": Family(
        "cohere",
        False,
        False,
        False,
        frozenset({"attention_bias", "layer_norm_eps", "logit_scale", "use_qk_norm"}),
        interleaved_rope=True,
        fp32_rope=True,
        layer_norm=True,
        parallel=True,
        norm_eps_field="layer_norm_eps",
    ),
    # Cohere 2 (Command R7B, Command A, Aya Vision's text): Cohere's layer, sliding windows on three layers
    # of four, the rope on those only (the full layers take none: NoPE), head_dim = hidden_size / heads
    "cohere2": Family(
        "cohere2",
        False,
        False,
        False,
        frozenset(
            {
                "attention_bias",
                "layer_norm_eps",
                "logit_scale",
                "sliding_window",
                "sliding_window_pattern",
                "layer_types",
            }
        ),
        interleaved_rope=True,
        fp32_rope=True,
        layer_norm=True,
        parallel=True,
        norm_eps_field="layer_norm_eps",
    ),
}
# Other spellings of a family's fields (transformers' attribute_map: alias -> the field it sets)
ALIASES: dict[str, dict[str, str]] = {
    "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
    "gpt_neox": {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},  # its configs' spellings
    # GPT-J's (transformers' attribute_map, and its MLP's width and activation)
    "gptj": {
        "n_positions": "max_position_embeddings",
        "n_embd": "hidden_size",
        "n_head": "num_attention_heads",
        "n_layer": "num_hidden_layers",
        "n_inner": "intermediate_size",
        "activation_function": "hidden_act",
    },
    # Falcon's (and its first configs' n_embed, n_head, n_layer, n_head_kv)
    "falcon": {
        "activation": "hidden_act",
        "ffn_hidden_size": "intermediate_size",
        "n_embed": "hidden_size",
        "n_head": "num_attention_heads",
        "n_layer": "num_hidden_layers",
        "n_head_kv": "num_kv_heads",
    },
}
# Fields of a family's original release that transformers does not read, each accepted only where its
# value is what transformers' model does anyway (field -> (does the value agree, what transformers does)):
# Command R7B's and Command A's config.json carry their training code's switches.
AGREEING_FIELDS: dict[str, dict[str, tuple[Callable[[object, dict], bool], str]]] = {
    # StarCoder2's config.json names its MLP and norm kinds; transformers builds these whatever they say
    "starcoder2": {
        "mlp_type": (lambda v, c: v == "default", "'default' (the ungated MLP)"),
        "norm_type": (lambda v, c: v == "layer_norm", "'layer_norm'"),
    },
    # StableLM 2's own code read these: transformers' StableLM biases every LayerNorm whatever use_norm_bias
    # says (the checkpoints store the biases: a missing one is refused at load) and scales no frequency
    "stablelm": {
        "use_norm_bias": (lambda v, c: isinstance(v, bool), "true or false (every norm has its bias)"),
        "rotary_scaling_factor": (lambda v, c: v == 1.0, "1.0 (no scaling)"),
    },
    # Tencent's config.json files carry their own code's switches; transformers' dense Hunyuan always norms q and k,
    # rotates every layer, and shares no KV across layers (CLA) nor compresses it (MLA)
    "hunyuan_v1_dense": {
        "use_qk_norm": (lambda v, c: v is True, "true (q and k normed per head)"),
        "use_rotary_pos_emb": (lambda v, c: v is True, "true (every layer rotates)"),
        "use_cla": (lambda v, c: v is False, "false (each layer its own KV)"),
        "use_mla": (lambda v, c: v is False, "false (no latent attention)"),
    },
    # GPT-NeoX's heads are hidden_size / num_attention_heads wide, each with its own k and v, whatever the config says
    "gpt_neox": {
        "head_dim": (
            lambda v, c: v == c["hidden_size"] // c["num_attention_heads"],
            "hidden_size / num_attention_heads",
        ),
        "num_key_value_heads": (lambda v, c: v == c["num_attention_heads"], "num_attention_heads (no grouped KV)"),
    },
    # TII's own Falcon code read it; transformers' Falcon adds the residual to the layer's input, not its norm's output
    "falcon": {"apply_residual_connection_post_layernorm": (lambda v, c: v is False, "false")},
    # OLMo 1's LayerNorms take eps 1e-5 whatever the config says (transformers' OlmoLayerNorm)
    "olmo": {"rms_norm_eps": (lambda v, c: v == 1e-5, "1e-5 (OLMo's LayerNorms have a fixed eps)")},
    "cohere2": {
        "order_of_interleaved_layers": (lambda v, c: v == "local_attn_first", "'local_attn_first'"),
        "position_embedding_type": (lambda v, c: v == "rope_gptj", "'rope_gptj' (the interleaved rope)"),
        "rotary_pct": (lambda v, c: v == 1.0, "1.0 (every dim of a head rotates)"),
        "use_gated_activation": (lambda v, c: v is True, "true (the gated MLP)"),
        "use_parallel_block": (lambda v, c: v is True, "true (the parallel block)"),
        "use_qk_norm": (lambda v, c: v is False, "false (no q/k norms)"),
        "use_embedding_sharing": (
            lambda v, c: v == c.get("tie_word_embeddings", True),
            "tie_word_embeddings' value",
        ),
        "use_parallel_embedding": (lambda v, c: isinstance(v, bool), "true or false (a tensor-parallel split)"),
        "layer_switch": (
            lambda v, c: v == c.get("sliding_window_pattern", 4),
            "sliding_window_pattern's value (the period of the sliding and full layers)",
        ),
    },
}
# What transformers' config class of each family sets where a config.json leaves a field out (the
# fields this build reads): a partial config means what it means to transformers (e.g. Gemma 3's
# text_config inside a multimodal config, which lists only what differs). Rope defaults are
# `_rope_from_hf`'s and `_layer_type_ropes`'; head_dim, where absent here, is hidden_size / heads.
_LLAMA_LIKE = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6)
_QWEN = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    max_window_layers=28,
)
_GEMMA_2_3 = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
_GLM = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=13696,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1.5625e-07,
    tie_word_embeddings=False,
    attention_bias=True,
)
_COHERE = dict(
    vocab_size=256000,
    hidden_size=8192,
    intermediate_size=22528,
    num_hidden_layers=40,
    num_attention_heads=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    layer_norm_eps=1e-5,
    tie_word_embeddings=True,
    logit_scale=0.0625,
    attention_bias=False,
)
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": {**_LLAMA_LIKE, "intermediate_size": 11008, "max_position_embeddings": 2048, "hidden_act": "silu"},
    "mistral": {
        **_LLAMA_LIKE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "sliding_window": 4096,
    },
    "ministral": {
        **_LLAMA_LIKE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "sliding_window": 4096,
    },
    "internlm3": {
        "vocab_size": 128512,
        "hidden_size": 4096,
        "intermediate_size": 10240,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "ministral3": {
        "vocab_size": 131072,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 34,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "max_position_embeddings": 262144,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
            "rope_type": "yarn",
        },
    },
    "qwen2": {**_QWEN, "hidden_act": "silu"},
    "qwen3": {**_QWEN, "hidden_act": "silu", "head_dim": 128},
    "phi3": dict(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        hidden_act="silu",
    ),
    "gemma": dict(
        vocab_size=256000,
        hidden_size=3072,
        intermediate_size=24576,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
    ),
    "gemma2": {
        **_GEMMA_2_3,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {**_GEMMA_2_3, "vocab_size": 262208, "max_position_embeddings": 131072},
    "olmo": {
        **_LLAMA_LIKE,
        "vocab_size": 50304,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "clip_qkv": None,
    },
    "olmo2": {
        **_LLAMA_LIKE,
        "vocab_size": 50304,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    },
    "ernie4_5": dict(
        vocab_size=103424,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        use_bias=False,
    ),
    "seed_oss": dict(
        vocab_size=155136,
        hidden_size=4096,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=80,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=524288,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=True,
        attention_out_bias=False,
        mlp_bias=False,
    ),
    "glm": _GLM,
    "glm4": _GLM,
    "olmo3": {
        **_LLAMA_LIKE,
        "vocab_size": 50304,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "sliding_window": 4096,
    },
    "smollm3": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "no_rope_layer_interval": 4,
    },
    "granite": {
        **_LLAMA_LIKE,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "logits_scaling": 1.0,
    },
    "mixtral": {
        **_LLAMA_LIKE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        **{k: v for k, v in _QWEN.items() if k != "max_window_layers"},
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "qwen2_moe": {
        **_QWEN,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
    "olmoe": {
        **_LLAMA_LIKE,
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
    "starcoder2": {
        "vocab_size": 49152,
        "hidden_size": 3072,
        "intermediate_size": 12288,
        "num_hidden_layers": 30,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "use_bias": True,
        "sliding_window": None,
    },
    "stablelm": {
        "vocab_size": 50304,
        "hidden_size": 2560,
        "intermediate_size": 6912,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_qkv_bias": False,
        "use_parallel_residual": False,
        "qk_layernorm": False,
    },
    "exaone4": {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
    },
    "cohere": {**_COHERE, "use_qk_norm": False},
    "cohere2": {**_COHERE, "sliding_window": 4096},
    "nemotron": {
        "vocab_size": 256000,
        "hidden_size": 6144,
        "intermediate_size": 24576,
        "num_hidden_layers": 32,
        "num_attention_heads": 48,
        "hidden_act": "relu2",
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "hunyuan_v1_dense": {
        "vocab_size": 290943,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "phi": {
        "vocab_size": 51200,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "hidden_act": "gelu_new",
        "max_position_embeddings": 2048,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_layernorm": False,
    },
    "gpt_neox": {
        "vocab_size": 50432,
        "hidden_size": 6144,
        "intermediate_size": 24576,
        "num_hidden_layers": 44,
        "num_attention_heads": 64,
        "hidden_act": "gelu",
        "max_position_embeddings": 2048,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_parallel_residual": True,
        "attention_bias": True,
    },
    "gptj": {
        "vocab_size": 50400,
        "max_position_embeddings": 2048,
        "hidden_size": 4096,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "rotary_dim": 64,
        "hidden_act": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
    },
    "falcon": {
        "vocab_size": 65024,
        "hidden_size": 4544,
        "num_hidden_layers": 32,
        "num_attention_heads": 71,
        "hidden_act": "gelu",
        "max_position_embeddings": 2048,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "alibi": False,
        "bias": False,
        "multi_query": True,
        "new_decoder_architecture": False,
        "parallel_attn": True,
    },
    "arcee": {
        "vocab_size": 32000,
        "hidden_size": 2560,
        "intermediate_size": 18432,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "relu2",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
}
# The rope's θ where a config names none, where transformers' class of the family has its own
DEFAULT_THETA = {"mixtral": 1e6, "smollm3": 2e6, "gemma3_text": 1e6, "olmo3": 5e5, "ernie4_5": 5e5, "cohere": 5e5}
# The partial_rotary_factor where a config names none, where transformers' class of the family has its own
DEFAULT_PARTIAL_ROTARY = {"glm": 0.5, "glm4": 0.5, "stablelm": 0.25, "nemotron": 0.5, "phi": 0.5, "gpt_neox": 0.25}
# Families with a rope per layer type (ModelArgs.local_rope, `_layer_type_ropes`): where the old spelling
# gives the sliding layers' θ (field, default); None: the full layers' θ
LAYER_TYPE_ROPES: dict[str, tuple[str, float] | None] = {
    "gemma3_text": ("rope_local_base_freq", 10_000.0),
    "olmo3": None,
}
# Multimodal wrappers whose text model this build serves alone (model_type -> each text model it may
# wrap, the first its default, and that text model's causal LM class): prompts are text, the vision
# tower's weights are never read (`text_model_config`; bitdelta.checkpoint reads the text model's
# tensors under its causal LM's names). Gemma 3's Gemma3ForConditionalGeneration; Mistral 3's
# Mistral3ForConditionalGeneration (Mistral Small 3.1/3.2 wrap a Mistral, the Ministral 3 a Ministral 3).
TEXT_MODELS: dict[str, dict[str, str]] = {
    "gemma3": {"gemma3_text": "Gemma3ForCausalLM"},
    "mistral3": {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"},
}
# A wrapper's own fields beside its text model's (its vision tower's, the image tokens', the
# projector's): not read.
WRAPPER_FIELDS: dict[str, frozenset[str]] = {
    "gemma3": frozenset(
        {
            "text_config",
            "vision_config",
            "boi_token_index",
            "eoi_token_index",
            "image_token_index",
            "mm_tokens_per_image",
            "tie_word_embeddings",
        }
    ),
    "mistral3": frozenset(
        {
            "text_config",
            "vision_config",
            "image_token_index",
            "multimodal_projector_bias",
            "projector_hidden_act",
            "spatial_merge_size",
            "vision_feature_layer",
            "tie_word_embeddings",
        }
    ),
}
# The MLP gate activations (config name -> the runner's name); Gemma's is GELU in its tanh form, Nemotron's
# and Arcee's relu(x)² (transformers' relu2), Phi's GELU's tanh form written out op by op (gelu_new: each
# op rounds to the model's dtype, as transformers' NewGELUActivation), GPT-NeoX's the exact GELU (erf).
ACTIVATIONS = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu2": "relu2",
    "gelu_new": "gelu_new",
    "gelu": "gelu",
}

# Fields every family reads.
COMMON_FIELDS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "head_dim",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
    }
)
# Fields that do not change inference: bookkeeping, training-only knobs, other tools' settings
# (and every "_"-prefixed key and "*_token_id").
IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "embd_pdrop",
        "resid_pdrop",
        "pad_token_id",
        "pretraining_tp",  # a training-time split of the projections; the math is the same
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "tokenizer_class",
        "is_llama_config",  # a serving framework's marker in SmolLM configs
        "cache_implementation",  # Gemma 2/3's "hybrid": how transformers allocates its cache
        # mixture-of-experts training knobs: the auxiliary loss, the router's logits as an output, the
        # router's input noise (applied in training only)
        "router_aux_loss_coef",
        "output_router_logits",
        "router_jitter_noise",
        "residual_dropout",  # Seed-OSS's, in training only
        "hidden_dropout",  # StableLM's, in training only
        "embedding_dropout",  # StarCoder2's, in training only
        "model_max_length",  # a tokenizer's limit some Cohere configs carry (max_position_embeddings is the model's)
    }
)
ROPE_FIELDS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"}
    ),
}


@dataclass(frozen=True)
class Rope:
    """A rotary embedding: inverse frequencies over the first `dim` dims of a head, cos/sin scaled by
    `attention_factor` (yarn, longrope). `dynamic` and `longrope` depend on the length of the sequence
    at the step a token is computed (transformers' single-sequence semantics): `tables` takes that
    length per row."""

    kind: str = "default"
    theta: float = 10000.0
    dim: int = 0  # rotated dims of a head (head_dim · partial_rotary_factor); 0: ModelArgs fills in head_dim
    factor: float = 1.0
    original_max: int = 0  # the pre-training context (llama3, yarn, longrope)
    max_positions: int = 0  # max_position_embeddings (dynamic)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    interleaved: bool = False  # GLM: the rotated pairs are dims (2i, 2i + 1), not (i, i + dim/2)
    fp32: bool = False  # ERNIE 4.5, Cohere: the rotation in fp32, rounded once
    fp32_tables: bool = False  # ERNIE 4.5: its cos/sin tables in fp32 (`table_dtype`; Cohere's: the model's)

    def table_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the cos/sin tables of a model of `dtype` (its own, or fp32 for `fp32_tables`)."""
        return torch.float32 if self.fp32_tables else dtype

    @property
    def length_dependent(self) -> bool:
        return self.kind in ("dynamic", "longrope")

    def step_start(self, cached: int, new: int) -> int:
        """Where a step that adds `new` tokens to a sequence with `cached` tokens in its KV cache
        must compute from: 0 when LongRoPE switches to its long factors in this step (the sequence
        passes the original context), so every cached key is recomputed with them, as
        transformers' Phi-3 does; else `cached`. Dynamic rope keeps its cached keys (transformers too)."""
        if self.kind == "longrope" and 0 < cached <= self.original_max < cached + new:
            return 0
        return cached

    def _base_powers(self) -> torch.Tensor:
        return torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim

    def inv_freq(self, seq_len: int = 0) -> torch.Tensor:
        """fp32 [dim // 2] for a sequence that is `seq_len` tokens long at this step."""
        powers = self._base_powers()
        if self.kind == "default":
            return 1.0 / self.theta**powers
        if self.kind == "linear":
            return 1.0 / self.theta**powers / self.factor
        if self.kind == "dynamic":
            n = max(seq_len, self.max_positions)
            base = self.theta * ((self.factor * n / self.max_positions) - (self.factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
            return 1.0 / base**powers
        if self.kind == "llama3":
            inv = 1.0 / self.theta**powers
            wavelen = 2 * math.pi / inv
            low_wl = self.original_max / self.low_freq_factor
            high_wl = self.original_max / self.high_freq_factor
            scaled = torch.where(wavelen > low_wl, inv / self.factor, inv)
            smooth = (self.original_max / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return torch.where(medium, smoothed, scaled)
        if self.kind == "yarn":
            return self._yarn()
        if self.kind == "longrope":
            ext = self.long_factor if seq_len > self.original_max else self.short_factor
            return 1.0 / (torch.tensor(ext, dtype=torch.float32) * self.theta**powers)
        raise UnsupportedModel(f"rope type {self.kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")

    def _yarn(self) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(self.original_max / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
        pos_freqs = self.theta ** self._base_powers()
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] for integer positions [T] (halves concatenated, the HF layout).

        seq_lens: per row, the length of its sequence at this step (only `length_dependent`
        kinds read it; None: one sequence of max(positions) + 1 tokens, which needs a host read)."""
        device = positions.device
        if not self.length_dependent:
            inv = _inv_freq_on(self, 0, device)[None, :]  # cached per device: no copy per step
        else:
            if seq_lens is None:
                seq_lens = [int(positions.max()) + 1] * positions.shape[0]
            index = {n: i for i, n in enumerate(sorted(set(seq_lens)))}
            table = torch.stack([_inv_freq_on(self, n, device) for n in index])  # [U, dim/2]
            which = torch.tensor([index[n] for n in seq_lens], dtype=torch.int64)
            if device.type == "cuda":  # pinned and asynchronous, like the runner's other step indices
                which = which.pin_memory().to(device, non_blocking=True)
            inv = table[which]
        freqs = positions.float()[:, None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


@functools.lru_cache(maxsize=256)
def _inv_freq_on(rope: Rope, seq_len: int, device: torch.device) -> torch.Tensor:
    """rope.inv_freq(seq_len) on `device`, computed and copied once (dynamic rope: per length)."""
    return rope.inv_freq(seq_len).to(device)


@dataclass(frozen=True)
class Matrix:
    """One compressed matrix of a layer as the checkpoint stores it.

    name: module path inside the layer ("self_attn.qkv_proj"); group: the worker's projection
    group it belongs to ("qkv", "o", "gate_up", "down": projections that read the same input; a
    sparse layer's "router" and each expert e's "gate_up.e", "down.e"); bias: the base has a bias
    vector for it."""

    name: str
    group: str
    d_out: int
    d_in: int
    bias: bool

    @property
    def short(self) -> str:
        """The module's name without "_proj" (q, gate_up, w1), GPT-2-style names whole (StarCoder2's c_fc, c_proj)."""
        last = self.name.rsplit(".", 1)[1]
        return last if last.startswith("c_") else last.removesuffix("_proj")


GROUP_ORDER = ("qkv", "o", "gate_up", "down")
# A sparse layer's groups whose rows every token needs whole on every tensor-parallel rank: the router
# [n_experts, dim] and a shared expert's gate [1, dim] (an expert's "gate_up.e"/"down.e" split as the MLP's)
SPARSE_GROUPS = ("router", "shared_gate")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: dim // n_heads
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    rope: Rope = field(default_factory=Rope)
    qkv_bias: bool = False  # q, k, v projections have biases (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # gate, up, down have biases (Llama mlp_bias)
    windows: tuple[int | None, ...] = ()  # per layer: sliding-window size, None = full attention; (): all full
    act: str = "silu"  # the MLP's gate activation: "silu", "gelu_tanh", "relu2" or "gelu_new" (ACTIVATIONS)
    # the scores' scale where it is not 1/√head_dim (Gemma 2/3's query_pre_attn_scalar ** -0.5, Granite's
    # attention_multiplier), else None (SDPA's own)
    attn_scale: float | None = None
    attn_softcap: float | None = None  # Gemma 2: scores -> cap · tanh(scores / cap) before the softmax
    logit_softcap: float | None = None  # Gemma 2/3: logits -> cap · tanh(logits / cap)
    local_rope: Rope | None = None  # Gemma 3: the sliding-window layers' own rope (None: `rope` everywhere)
    embed_multiplier: float = 1.0  # Granite: the embeddings × this (a Python float: one rounding)
    residual_multiplier: float = 1.0  # Granite: each sublayer's output × this before its residual add
    logits_scaling: float = 1.0  # Granite: the logits ÷ this
    logit_scale: float = 1.0  # Cohere: the logits × this
    # Mixture of experts (Family.moe): every layer's MLP is n_experts experts of intermediate_size,
    # each token's output the sum of its experts_per_token highest-scoring experts' (softmax of the
    # router's logits in fp32, renormalised over the chosen ones where norm_topk)
    n_experts: int = 0
    experts_per_token: int = 0
    norm_topk: bool = True
    shared_intermediate_size: int = 0  # Qwen2-MoE: the shared expert's (Family.shared_expert); 0: none
    # Ministral 3's attention temperature (Llama 4's): q × round(1 + β · log(1 + ⌊pos / original⌋)) after the
    # rope, β = temperature_beta, original = temperature_original (β 0: none)
    temperature_beta: float = 0.0
    temperature_original: int = 0
    nope: tuple[bool, ...] = ()  # per layer: True where it takes no rope (SmolLM3's NoPE layers); (): rope everywhere
    # a parallel block (Family.parallel: Cohere's always, StableLM's where use_parallel_residual)
    parallel: bool = False
    # Command R+'s use_qk_norm: q and k normed per head as Qwen3's, but each head by weights of its own
    # (self_attn.q_norm [heads, head_dim], k_norm [kv heads, head_dim])
    qk_heads: bool = False
    # a parallel block whose MLP reads its own norm of the block's input (post_attention_layernorm): GPT-NeoX's
    # (Family.parallel_mlp_norm), Falcon's new architecture with two norms
    parallel_mlp_norm: bool = False
    # OLMo 1, OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (in the model's dtype) before the heads are split,
    # after a whole-projection q/k norm where the family has one (OLMoE's); None: not clipped
    clip_qkv: float | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.model_type not in FAMILIES:
            raise UnsupportedModel(_unsupported_type(self.model_type))
        if self.rope.dim == 0:
            self.rope = dataclasses.replace(self.rope, dim=self.head_dim)
        if self.windows and len(self.windows) != self.n_layers:
            raise ValueError(f"windows has {len(self.windows)} entries for {self.n_layers} layers")
        if self.nope and len(self.nope) != self.n_layers:
            raise ValueError(f"nope has {len(self.nope)} entries for {self.n_layers} layers")
        if self.local_rope is not None and self.local_rope.dim == 0:
            self.local_rope = dataclasses.replace(self.local_rope, dim=self.head_dim)
        if self.act not in ACTIVATIONS.values():
            raise ValueError(f"act {self.act!r} is not one of {sorted(ACTIVATIONS.values())}")
        if (self.family.moe is not None) != (self.n_experts > 0) or not 0 <= self.experts_per_token <= self.n_experts:
            raise ValueError(
                f"{self.model_type}: {self.n_experts} experts, {self.experts_per_token} per token do not fit the family"
            )
        if self.family.parallel:
            self.parallel = True
        if self.family.parallel_mlp_norm:
            self.parallel_mlp_norm = True
        if self.family.shared_expert != (self.shared_intermediate_size > 0):
            raise ValueError(
                f"{self.model_type}: a shared expert of {self.shared_intermediate_size} columns does not fit the family"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def qk_norm(self) -> bool:
        """q and k are normed per head (Qwen3's, Gemma 3's, EXAONE 4's; Command R+'s with per-head weights)."""
        return self.family.qk_norm or self.qk_heads

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def q_temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """fp32 [T] of the factor each position's q takes (`temperature_beta`), or None where the model
        has none. 1 exactly below `temperature_original`."""
        if not self.temperature_beta:
            return None
        steps = torch.floor(positions.to(torch.float32) / self.temperature_original)
        return 1 + self.temperature_beta * torch.log(1 + steps)

    def rotates(self, layer: int) -> bool:
        """The layer's q and k take the rope (all but SmolLM3's NoPE layers)."""
        return not (self.nope and self.nope[layer])

    def local(self, layer: int) -> bool:
        """The layer takes `local_rope` (Gemma 3's sliding-window layers)."""
        return self.local_rope is not None and self.window(layer) is not None

    @property
    def embed_scale(self) -> float | None:
        """What the embeddings are multiplied by (in the model's dtype), or None."""
        return self.dim**0.5 if self.family.gemma else None

    # -- layout ---------------------------------------------------------------------------------
    def matrices(self) -> tuple[Matrix, ...]:
        """The compressed matrices of one layer, in the checkpoint's own layout, grouped in GROUP_ORDER
        (a sparse layer's router and experts in place of gate_up and down: `expert_matrices`)."""
        d, f, hd = self.dim, self.intermediate_size, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        if self.family.fused:
            attn = [Matrix("self_attn.qkv_proj", "qkv", q + 2 * kv, d, self.qkv_bias)]
        else:
            attn = [
                Matrix("self_attn.q_proj", "qkv", q, d, self.qkv_bias),
                Matrix("self_attn.k_proj", "qkv", kv, d, self.qkv_bias),
                Matrix("self_attn.v_proj", "qkv", kv, d, self.qkv_bias),
            ]
        down = "mlp.down_proj"
        if self.family.ungated_mlp is not None:  # StarCoder2: the up projection alone
            up, down = (f"mlp.{n}" for n in self.family.ungated_mlp)
            mlp = [Matrix(up, "gate_up", f, d, self.mlp_bias)]
        elif self.family.fused or self.family.fused_mlp:
            mlp = [Matrix("mlp.gate_up_proj", "gate_up", 2 * f, d, self.mlp_bias)]
        else:
            mlp = [
                Matrix("mlp.gate_proj", "gate_up", f, d, self.mlp_bias),
                Matrix("mlp.up_proj", "gate_up", f, d, self.mlp_bias),
            ]
        o = Matrix(f"self_attn.{self.family.o_name}", "o", d, q, self.o_bias)
        if self.family.moe is not None:
            return (*attn, o, *self.expert_matrices())
        return (*attn, o, *mlp, Matrix(down, "down", d, f, self.mlp_bias))

    def expert_matrices(self) -> tuple[Matrix, ...]:
        """A sparse layer's router (group "router": [n_experts, dim]) and each expert e's gate and up
        (group "gate_up.e") and down (group "down.e") projections; then a shared expert's (Qwen2-MoE:
        groups "gate_up.shared", "down.shared") and its gate (group "shared_gate": [1, dim]); () for a
        dense family."""
        moe = self.family.moe
        if moe is None:
            return ()
        d, f = self.dim, self.intermediate_size
        gate, up, down = self.family.expert_names
        out = [Matrix(f"{moe}.gate", "router", self.n_experts, d, False)]
        for e in range(self.n_experts):
            out += [
                Matrix(f"{moe}.experts.{e}.{gate}", f"gate_up.{e}", f, d, False),
                Matrix(f"{moe}.experts.{e}.{up}", f"gate_up.{e}", f, d, False),
                Matrix(f"{moe}.experts.{e}.{down}", f"down.{e}", d, f, False),
            ]
        if self.family.shared_expert:
            fs = self.shared_intermediate_size
            out += [
                Matrix(f"{moe}.shared_expert.{gate}", "gate_up.shared", fs, d, False),
                Matrix(f"{moe}.shared_expert.{up}", "gate_up.shared", fs, d, False),
                Matrix(f"{moe}.shared_expert.{down}", "down.shared", d, fs, False),
                Matrix(f"{moe}.shared_expert_gate", "shared_gate", 1, d, False),
            ]
        return tuple(out)

    def norm_params(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(key, parameter path inside a layer, shape in the checkpoint) of each norm parameter of a layer:
        each norm's weight (keyed by the norm's module path, `layer_norms`; Command R+'s q and k norms
        [heads, head_dim]), then, for a family whose norms have biases (StableLM), each one's bias (keyed
        `<norm>.bias`)."""
        hd = self.head_dim
        qn, kn = self.family.qk_norm_names
        heads = {qn: (self.n_heads, hd), kn: (self.n_kv_heads, hd)}
        out = [
            (n, f"{n}.weight", heads[n] if self.qk_heads and n in heads else (size,)) for n, size in self.layer_norms()
        ]
        if self.family.norm_bias:  # the layer's norms' (StableLM 2 12B's per-head q and k norms have none)
            out += [(f"{n}.bias", f"{n}.bias", (size,)) for n, size in self.layer_norms() if n not in heads]
        return tuple(out)

    def layer_norms(self) -> tuple[tuple[str, int], ...]:
        """(module path inside a layer, size) of each RMSNorm of a layer: its `norm_roles`, then the
        q and k norms."""
        out = [(n, self.dim) for n in self.norm_roles() if n is not None]
        hd = self.head_dim
        if self.family.qk_whole or self.qk_heads:  # OLMo 2, OLMoE: q and k normed whole; Command R+: per-head weights
            out += [
                (self.family.qk_norm_names[0], self.n_heads * hd),
                (self.family.qk_norm_names[1], self.n_kv_heads * hd),
            ]
        elif self.family.qk_norm:
            out += [(n, hd) for n in self.family.qk_norm_names]
        return tuple(out)

    def norm_roles(self) -> tuple[str | None, str | None, str | None, str | None]:
        """A layer's norms by role, None where the family has none: of the attention's input, of its
        output (a sandwich's, or OLMo's post-norm), of the MLP's input, of the MLP's output."""
        if self.family.post_norm:
            return (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
        if self.parallel:  # Cohere, StableLM's parallel residual: the MLP reads the input norm's output too;
            # GPT-NeoX's its own norm of the block's input
            return (
                "input_layernorm",
                None,
                "post_attention_layernorm" if self.parallel_mlp_norm else None,
                None,
            )
        if self.family.sandwich:
            return ("input_layernorm", *self.family.sandwich_names)
        return ("input_layernorm", None, "post_attention_layernorm", None)

    def group_shapes(self) -> dict[str, tuple[int, int]]:
        """Worker projection group -> (d_out of its matrices together, d_in)."""
        out: dict[str, tuple[int, int]] = {}
        for m in self.matrices():
            d_out, _ = out.get(m.group, (0, m.d_in))
            out[m.group] = (d_out + m.d_out, m.d_in)
        return out

    def compressed_names(self) -> set[str]:
        """Full names of every matrix compression turns into signs + α (embeddings aside)."""
        return {f"model.layers.{i}.{m.name}.weight" for i in range(self.n_layers) for m in self.matrices()}

    @property
    def layout(self) -> str:
        """A short canonical description of the parameter layout a delta must match, e.g.
        `q,k,v,o,gate,up,down;bias=q,k,v` or `qkv,o,gate_up,down` or `...;qk_norm`."""
        mats = self.matrices()
        text = ",".join(m.short for m in mats if m.group not in SPARSE_GROUPS and "." not in m.group)
        if self.family.moe is not None:  # e.g. q,k,v,o,router,experts=8x(w1,w3,w2)
            names = ",".join(self.family.expert_names).replace("_proj", "")
            text += f",router,experts={self.n_experts}x({names})"
            if (
                self.family.shared_expert
            ):  # Qwen2-MoE: q,k,v,o,router,experts=60x(gate,up,down),shared_expert=(...)+gate
                text += f",shared_expert=({names})+gate"
        biased = [m.short for m in mats if m.bias]
        if biased:
            text += ";bias=" + ",".join(biased)
        if self.qk_norm:
            text += ";qk_norm"
        return text

    @property
    def final_norm_path(self) -> str:
        """The final norm's module path ("model.norm"; Phi's "model.final_layernorm")."""
        return f"model.{self.family.final_norm}"

    def norm_param_count(self) -> int:
        """Every norm parameter: each layer's (`norm_params`) and the final norm's weight (and bias); none
        where the norms have none (OLMo 1's, `Family.weightless_norms`)."""
        if self.family.weightless_norms:
            return 0
        per_layer = sum(math.prod(shape) for _, _, shape in self.norm_params())
        return self.n_layers * per_layer + self.dim * (2 if self.family.norm_bias else 1)

    def param_count(self) -> int:
        per_layer = sum(m.d_out * m.d_in + (m.d_out if m.bias else 0) for m in self.matrices())
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        head_bias = self.vocab_size if self.family.head_bias else 0
        return self.n_layers * per_layer + emb + head_bias + self.norm_param_count()

    # -- configs --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict) -> ModelArgs:
        """From a Hugging Face config dict; UnsupportedModel names any field it cannot honour."""
        return _from_hf(cls, cfg)

    def to_hf(self) -> dict:
        """A config dict transformers reads as this model (for writing test checkpoints)."""
        names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}
        if self.model_type not in names:  # Gemma's tests are built by transformers' own config classes
            raise NotImplementedError(f"to_hf writes {', '.join(names)} configs, not {self.model_type}")
        out = {
            "architectures": [f"{names[self.model_type]}ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            "rope_parameters": _rope_to_hf(self.rope, self.head_dim),
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "phi3" and self.rope.original_max:
            out["original_max_position_embeddings"] = self.rope.original_max
        windows = {w for w in self.windows if w is not None}
        if windows:
            (w,) = windows
            if self.model_type in ("qwen2", "qwen3"):
                out |= {
                    "use_sliding_window": True,
                    "sliding_window": w,
                    "layer_types": ["sliding_attention" if x else "full_attention" for x in self.windows],
                }
            else:
                out["sliding_window"] = w
        return out


def _rope_to_hf(rope: Rope, head_dim: int) -> dict:
    out: dict = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.dim != head_dim:
        out["partial_rotary_factor"] = rope.dim / head_dim
    if rope.kind in ("linear", "dynamic", "llama3", "yarn"):
        out["factor"] = rope.factor
    if rope.kind in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = rope.original_max
    if rope.kind == "llama3":
        out |= {"low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor}
    if rope.kind == "yarn":
        out |= {"beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "attention_factor": rope.attention_factor}
    if rope.kind == "longrope":
        out |= {"short_factor": list(rope.short_factor), "long_factor": list(rope.long_factor)}
    return out


def _unsupported_type(model_type) -> str:
    hint = ""
    if isinstance(model_type, str) and ("moe" in model_type or model_type in ("dbrx", "deepseek_v2", "deepseek_v3")):
        hint = " (of the mixture-of-experts families, this build serves mixtral, qwen3_moe, qwen2_moe and olmoe)"
    elif isinstance(model_type, str) and model_type.startswith(("llava", "idefics", "qwen2_vl", "mllama", "paligemma")):
        hint = " (multimodal models are not supported, but for the text models of Gemma 3 and Mistral 3)"
    return f"model_type {model_type!r} is not supported{hint}; this build serves {', '.join(SUPPORTED)}"


def _is_set(value) -> bool:
    return value is not None and value is not False and value != {} and value != []


def text_model_config(cfg: dict) -> dict:
    """The config of the model this build serves from `cfg`: cfg itself, or for a multimodal wrapper
    (TEXT_MODELS: Gemma 3's Gemma3ForConditionalGeneration, Mistral 3's Mistral3ForConditionalGeneration)
    its text model's, as that text model's causal LM reads it: the text_config, with the wrapper's token
    ids and tie_word_embeddings where the text_config has none. A wrapper field this build does not
    know is refused by name."""
    model_type = cfg.get("model_type")
    if model_type not in TEXT_MODELS:
        return cfg
    texts = TEXT_MODELS[model_type]
    unknown = sorted(
        k
        for k in cfg
        if k not in WRAPPER_FIELDS[model_type] | IGNORED_FIELDS | {"model_type"}
        and not k.startswith("_")
        and not k.endswith("_token_id")
        and _is_set(cfg[k])
    )
    if unknown:
        raise UnsupportedModel(
            f"{model_type} config field(s) {', '.join(repr(k) for k in unknown)} are not read by this build, "
            f"which serves its text model alone"
        )
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModel(f"a {model_type} config serves its text model: it needs a text_config")
    text_type = text.get("model_type", next(iter(texts)))
    if text_type not in texts:
        raise UnsupportedModel(
            f"a {model_type} config's text_config must be a {' or '.join(texts)} config, not {text_type!r}"
        )
    out = {**text, "model_type": text_type, "architectures": [texts[text_type]]}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in cfg and cfg[key] is not None:
            if key in text and text[key] is not None and text[key] != cfg[key]:
                raise UnsupportedModel(
                    f"{key} is {cfg[key]!r} in the {model_type} config, {text[key]!r} in its text_config"
                )
            out[key] = cfg[key]
    return out


def implied_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of config `cfg` does not store but its model reads as ones (OLMo 1's
    LayerNorms, `Family.weightless_norms`): full name -> shape; {} for every other family."""
    fam = FAMILIES.get(text_model_config(cfg).get("model_type", "llama"))
    if fam is None or not fam.weightless_norms:
        return {}
    a = ModelArgs.from_hf(cfg)
    out = {f"model.layers.{i}.{param}": shape for i in range(a.n_layers) for _, param, shape in a.norm_params()}
    return out | {f"{a.final_norm_path}.weight": (a.dim,)}


def _from_hf(cls, cfg: dict) -> ModelArgs:
    cfg = text_model_config(cfg)
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise UnsupportedModel(_unsupported_type(model_type))
    fam = FAMILIES[model_type]
    cfg = _aliased(cfg, ALIASES.get(model_type, {}))
    cfg = {**FAMILY_DEFAULTS[model_type], **cfg}  # what transformers reads where the file says nothing
    if model_type == "falcon":
        cfg = _falcon(cfg)
    if model_type == "gptj":
        cfg = _gptj(cfg)
    for key in ("text_config", "vision_config", "audio_config"):
        if _is_set(cfg.get(key)):
            raise UnsupportedModel(f"config field {key!r}: multimodal models are not supported")
    known = COMMON_FIELDS | IGNORED_FIELDS | fam.fields | set(AGREEING_FIELDS.get(model_type, {}))
    # "_"-prefixed keys are bookkeeping (_name_or_path, _attn_implementation_autoset, comments)
    # and token ids (unk_token_id, sep_token_id, ...) are the tokenizer's business
    unknown = sorted(
        k for k in cfg if k not in known and not k.startswith("_") and not k.endswith("_token_id") and _is_set(cfg[k])
    )
    if unknown:
        raise UnsupportedModel(
            f"{model_type} config field(s) {', '.join(repr(k) for k in unknown)} would change the model in a way "
            f"this build does not implement (e.g. quantization, mixture-of-experts); "
            f"a {model_type} config may set {', '.join(sorted(COMMON_FIELDS | fam.fields))}"
        )
    for key, (agrees, means) in AGREEING_FIELDS.get(model_type, {}).items():
        if key in cfg and cfg[key] is not None and not agrees(cfg[key], cfg):
            raise UnsupportedModel(
                f"{model_type} config field {key!r} is {cfg[key]!r}: transformers' {model_type} model does not read "
                f"it and runs as {key} = {means} would"
            )
    if model_type == "internlm3":
        if bool(cfg["attention_bias"]) != bool(cfg["mlp_bias"]):
            raise UnsupportedModel(
                "internlm3 with qkv_bias (attention_bias) different from bias (mlp_bias): transformers refuses it"
            )
    if model_type == "phi" and cfg.get("qk_layernorm"):
        raise UnsupportedModel(f"qk_layernorm ({model_type}'s LayerNorms of q and k) is not supported")
    act = _activation(cfg, fam)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if model_type == "cohere2" and head_dim != cfg["hidden_size"] // heads:  # transformers sets it so
        raise UnsupportedModel(
            f"head_dim {head_dim}: transformers' cohere2 model uses hidden_size / num_attention_heads "
            f"= {cfg['hidden_size'] // heads} whatever the config says"
        )
    n_layers = cfg["num_hidden_layers"]
    max_pos = cfg.get("max_position_embeddings", 2048)
    local_rope = None
    temperature = (0.0, 0)
    if model_type == "ministral3":
        cfg, temperature = _temperature(cfg)
    if model_type in LAYER_TYPE_ROPES:
        rope, local_rope = _layer_type_ropes(cfg, fam, head_dim, max_pos)
    else:
        rope = _rope_from_hf(cfg, fam, head_dim, max_pos)
    caps = {k: _positive(cfg, k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    scalar = _positive(cfg, "query_pre_attn_scalar")
    attn_scale = None if scalar in (None, head_dim) else scalar**-0.5
    if model_type == "granite":
        attn_scale = _positive(cfg, "attention_multiplier")
    attn_bias = bool(cfg.get("attention_bias", False)) or bool(cfg.get("use_bias", False))  # ERNIE's: every one
    eos = cfg.get("eos_token_id")
    n_experts, per_token, ffn, shared = _experts(cfg, fam)
    return cls(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        intermediate_size=ffn,
        norm_eps=cfg[fam.norm_eps_field],
        max_seq_len=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=head_dim,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        model_type=model_type,
        rope=rope,
        qkv_bias=model_type == "qwen2"
        or fam.biased
        or attn_bias
        or (model_type == "qwen2_moe" and bool(cfg["qkv_bias"]))
        or bool(cfg.get("use_qkv_bias", False)),
        o_bias=(attn_bias and fam.o_bias) or bool(cfg.get("attention_out_bias", False)) or fam.biased,
        mlp_bias=bool(cfg.get("mlp_bias", False)) or bool(cfg.get("use_bias", False)) or fam.biased or fam.mlp_biased,
        windows=_windows(cfg, model_type, n_layers),
        act=act,
        attn_scale=attn_scale,
        embed_multiplier=_positive(cfg, "embedding_multiplier") or 1.0,
        residual_multiplier=_positive(cfg, "residual_multiplier") or 1.0,
        logits_scaling=_positive(cfg, "logits_scaling") or 1.0,
        logit_scale=_logit_scale(cfg) if "logit_scale" in fam.fields else 1.0,
        attn_softcap=caps["attn_logit_softcapping"],
        logit_softcap=caps["final_logit_softcapping"],
        local_rope=local_rope,
        n_experts=n_experts,
        experts_per_token=per_token,
        norm_topk=fam.model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        temperature_beta=temperature[0],
        temperature_original=temperature[1],
        nope=_nope_layers(cfg, n_layers) if model_type == "smollm3" else _full_layers(cfg, model_type, n_layers),
        # Cohere's: its family's (__post_init__); Falcon's parallel_attn
        parallel=bool(cfg.get("use_parallel_residual", False)) or bool(cfg.get("parallel_attn", False)),
        parallel_mlp_norm=model_type == "falcon" and bool(cfg["parallel_attn"]) and _falcon_norms(cfg) == 2,
        # Command R+'s use_qk_norm, StableLM 2 12B's qk_layernorm: q and k normed per head, each head by weights of its own
        qk_heads=(model_type == "cohere" and bool(cfg["use_qk_norm"]))
        or (model_type == "stablelm" and bool(cfg.get("qk_layernorm"))),
        clip_qkv=_positive(cfg, "clip_qkv") if "clip_qkv" in fam.fields else None,
    )


def _gptj(cfg: dict) -> dict:
    """A GPT-J config's rope and MLP width as the common fields say them: partial_rotary_factor = rotary_dim ÷
    head_dim (a null rotary_dim, which transformers' GPT-J cannot run unless one head spans the model, refused),
    intermediate_size 4 × hidden where n_inner is unset; θ is 10⁴, the one its positions' table takes."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    dim = cfg.pop("rotary_dim", None)
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 < dim <= head_dim:
        raise UnsupportedModel(f"rotary_dim {dim!r}: GPT-J rotates the first rotary_dim dims of a {head_dim}-wide head")
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "head_dim"):
        if _is_set(cfg.get(key)):
            raise UnsupportedModel(f"config field {key!r}: transformers' GPT-J does not read it (its rope is fixed)")
    return {
        **cfg,
        "partial_rotary_factor": dim / head_dim,
        "intermediate_size": cfg.get("intermediate_size") or 4 * cfg["hidden_size"],
    }


def _falcon_norms(cfg: dict) -> int:
    """How many norms a Falcon layer has (transformers' FalconDecoderLayer): 2 for a parallel block of the new
    decoder architecture with num_ln_in_parallel_attn 2 (its default there: ln_attn, ln_mlp); else 1 for a
    parallel block (input_layernorm), 2 for the sequential layer (input_layernorm, post_attention_layernorm)."""
    if not cfg.get("parallel_attn"):
        return 2
    if not cfg.get("new_decoder_architecture"):
        return 1
    n = cfg.get("num_ln_in_parallel_attn")
    return 2 if n is None else int(n)


def _falcon(cfg: dict) -> dict:
    """A Falcon config's KV heads and MLP width as the common fields say them (num_key_value_heads: one for
    multi_query, num_kv_heads for the new decoder architecture, every head else; intermediate_size: 4 × hidden
    where ffn_hidden_size is unset); what transformers' Falcon runs otherwise, or this build does not, refused."""
    if cfg.get("alibi"):
        raise UnsupportedModel("alibi (Falcon-RW's position biases in place of the rope) is not supported")
    if cfg.get("bias"):
        raise UnsupportedModel(
            "bias: Falcon's biased projections (transformers rounds the product, then adds the bias) are not supported"
        )
    if cfg.get("new_decoder_architecture") and not cfg.get("parallel_attn"):
        raise UnsupportedModel(
            "new_decoder_architecture without parallel_attn: transformers' Falcon builds no such layer"
        )
    n = cfg.get("num_ln_in_parallel_attn")
    if n is not None and (isinstance(n, bool) or n not in (1, 2)):
        raise UnsupportedModel(f"num_ln_in_parallel_attn {n!r}: 1 or 2")
    if n == 2 and cfg.get("parallel_attn") and not cfg.get("new_decoder_architecture"):
        raise UnsupportedModel(
            "num_ln_in_parallel_attn 2 without new_decoder_architecture: transformers' Falcon builds the two norms "
            "but runs the one norm it did not build"
        )
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_kv_heads") or heads
    kv = kv if cfg.get("new_decoder_architecture") or not cfg.get("multi_query") else 1
    if cfg.get("num_key_value_heads") not in (None, kv):
        raise UnsupportedModel(
            f"num_key_value_heads {cfg['num_key_value_heads']!r}: transformers' Falcon runs {kv} (num_kv_heads, "
            f"multi_query, new_decoder_architecture)"
        )
    return {
        **cfg,
        "num_key_value_heads": kv,
        "intermediate_size": cfg.get("intermediate_size") or 4 * cfg["hidden_size"],
    }


def _aliased(cfg: dict, aliases: dict[str, str]) -> dict:
    """cfg with each alias (a transformers attribute_map spelling) read as its field; the two spellings
    set to different values refused, since which one transformers keeps depends on their order."""
    out = dict(cfg)
    for alias, name in aliases.items():
        if alias in out:
            value = out.pop(alias)
            if name in cfg and cfg[name] != value:
                raise UnsupportedModel(f"config fields {alias!r} ({value!r}) and {name!r} ({cfg[name]!r}) disagree")
            out[name] = value
    return out


def _logit_scale(cfg: dict) -> float:
    """Cohere's logit_scale: a positive number (transformers multiplies the logits by it, null included)."""
    value = _positive(cfg, "logit_scale")
    if value is None:
        raise UnsupportedModel("config field 'logit_scale' must be a positive number, got null")
    return value


def _full_layers(cfg: dict, model_type: str, n_layers: int) -> tuple[bool, ...]:
    """The layers without the rope of Cohere 2 and EXAONE 4 (with a sliding_window: its hybrid layout): their
    full-attention ones (`_hybrid_types`); () for others."""
    if model_type not in ("cohere2", "exaone4") or (model_type == "exaone4" and cfg.get("sliding_window") is None):
        return ()
    out = tuple(t == "full_attention" for t in _hybrid_types(cfg, n_layers))
    return out if any(out) else ()


def _checked_types(types, n_layers: int) -> list[str]:
    """A config's layer_types: n_layers entries, each 'full_attention' or 'sliding_attention'."""
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"layer_types {types!r}: expected {n_layers} of 'full_attention'/'sliding_attention'")
    return types


def _hybrid_types(cfg: dict, n_layers: int) -> list[str]:
    """Cohere 2's and EXAONE 4's layer types as transformers reads them: layer_types, or every
    sliding_window_pattern-th layer (from 1; 4 by default) full and the others sliding (EXAONE 4 needs
    layer_types where its pattern is a string such as "LLLG" or it has no window: transformers' class
    computes the default from an integer pattern only)."""
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("sliding_window_pattern", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UnsupportedModel(
                f"sliding_window_pattern must be a positive integer without layer_types, got {every!r}"
            )
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    return _checked_types(types, n_layers)


def _nope_layers(cfg: dict, n_layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers without the rope, as transformers reads them: no_rope_layers (per layer, 1 =
    the rope, 0 = none), or by default every no_rope_layer_interval-th layer; () where every layer
    has it."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg["no_rope_layer_interval"]
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UnsupportedModel(f"no_rope_layer_interval must be a positive integer, got {every!r}")
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) or f is True for f in flags):
        raise UnsupportedModel(f"no_rope_layers {flags!r}: expected {n_layers} entries of 0 (no rope) or 1 (rope)")
    out = tuple(f == 0 for f in flags)
    return out if any(out) else ()


def _temperature(cfg: dict) -> tuple[dict, tuple[float, int]]:
    """Ministral 3's rope_parameters without the attention temperature's fields (and their own
    max_position_embeddings, which transformers' rope does not read), and (β, original context)."""
    params = dict(cfg.get("rope_parameters") or {})
    if _is_set(cfg.get("rope_scaling")):
        raise UnsupportedModel("ministral3 reads rope_parameters, not rope_scaling")
    beta = params.pop("llama_4_scaling_beta", None)
    params.pop("max_position_embeddings", None)
    original = params.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
        raise UnsupportedModel(f"ministral3 needs a number rope_parameters.llama_4_scaling_beta, got {beta!r}")
    if beta and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise UnsupportedModel(
            "ministral3's attention temperature needs a positive integer rope_parameters."
            f"original_max_position_embeddings, got {original!r}"
        )
    return {**cfg, "rope_parameters": params}, (float(beta), int(original or 0))


_DEFAULT_EXPERTS = {"mixtral": 8, "qwen3_moe": 128, "qwen2_moe": 60, "olmoe": 64}


def _experts(cfg: dict, fam: Family) -> tuple[int, int, int, int]:
    """(experts, experts per token, the MLP's or each expert's intermediate size, the shared expert's
    or 0) as transformers' model of the family reads them; a sparse family whose layers are not all
    sparse is refused."""
    if fam.moe is None:
        return 0, 0, cfg["intermediate_size"], 0
    counts = {cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None}
    counts = counts or {_DEFAULT_EXPERTS[fam.model_type]}  # transformers' default (either spelling)
    if len(counts) != 1:
        raise UnsupportedModel(f"num_local_experts and num_experts disagree: {sorted(counts)}")
    (n,) = counts
    k = cfg.get("num_experts_per_tok")
    for key, value in (("num_local_experts", n), ("num_experts_per_tok", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedModel(f"config field {key!r} must be a positive integer, got {value!r}")
    if k > n:
        raise UnsupportedModel(f"num_experts_per_tok {k} is more than the {n} experts")
    if cfg.get("decoder_sparse_step", 1) != 1 or _is_set(cfg.get("mlp_only_layers")):
        raise UnsupportedModel(
            "decoder_sparse_step / mlp_only_layers: layers with a dense MLP among sparse ones are not supported"
        )
    shared = 0
    if fam.shared_expert:
        shared = cfg["shared_expert_intermediate_size"]
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise UnsupportedModel(
                f"config field 'shared_expert_intermediate_size' must be a positive integer, got {shared!r}"
            )
    own = fam.model_type in ("qwen3_moe", "qwen2_moe")  # experts of their own size (the dense MLP's unused)
    return n, k, cfg["moe_intermediate_size"] if own else cfg["intermediate_size"], shared


def _positive(cfg: dict, key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise UnsupportedModel(f"config field {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def _activation(cfg: dict, fam: Family) -> str:
    """The MLP's gate activation as transformers' model of the family reads it: `hidden_act`, or for
    Gemma `hidden_activation` (Gemma 2/3 read only it; a Gemma checkpoint that names both kinds
    differently is refused, as is Gemma's old exact-'gelu' spelling without `hidden_activation`,
    which transformers and vLLM run differently)."""
    act, named = cfg.get("hidden_act"), cfg.get("hidden_activation")
    field_name = "hidden_activation" if named is not None else "hidden_act"
    if fam.gemma:
        if named is None and fam.sandwich:
            named = "gelu_pytorch_tanh"  # Gemma 2/3's default
        if named is None:
            named = act or "gelu_pytorch_tanh"
            if named == "gelu":
                raise UnsupportedModel(
                    "hidden_act 'gelu' without hidden_activation: transformers runs exact GELU, vLLM and "
                    "Gemma's own code its tanh form; set hidden_activation"
                )
        elif act is not None and act != named:
            raise UnsupportedModel(f"hidden_act {act!r} and hidden_activation {named!r} disagree")
        act = named
    elif act is None:
        act = "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"{field_name} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def _windows(cfg: dict, model_type: str, n_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows as transformers applies them for this family."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return ()  # transformers drops the window when use_sliding_window is off
        if window is None:
            return ()
        types = cfg.get("layer_types")
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        _checked_types(types, n_layers)
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type == "qwen2_moe":
        # transformers' Qwen2-MoE: no window unless use_sliding_window (its sliding_window is then 0);
        # without layer_types, the even layers (0, 2, ...) below max_window_layers slide
        types = cfg.get("layer_types")
        if not cfg.get("use_sliding_window", False):
            if types is not None and "sliding_attention" in types:
                raise UnsupportedModel("layer_types has sliding_attention layers but use_sliding_window is off")
            return ()
        window = cfg.get("sliding_window", 4096)  # the class's default, kept only when use_sliding_window
        if types is None:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(n_layers)]
        _checked_types(types, n_layers)
        if window is None and "sliding_attention" in types:
            raise UnsupportedModel("layer_types has sliding_attention layers but sliding_window is not set")
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type == "qwen3_moe":  # every layer, when use_sliding_window is on
        if not cfg.get("use_sliding_window", False) or window is None:
            return ()
        out = (int(window),) * n_layers
    elif model_type == "ministral":  # the layers layer_types names, by default all where there is a window
        types = cfg.get("layer_types")
        if types is None:
            return () if window is None else (int(window),) * n_layers
        _checked_types(types, n_layers)
        if window is None and "sliding_attention" in types:
            raise UnsupportedModel("layer_types has sliding_attention layers but sliding_window is not set")
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type in ("mistral", "ministral3", "phi3", "mixtral", "starcoder2"):
        if window is None:
            return ()
        out = (int(window),) * n_layers
    elif model_type == "smollm3":  # windows only where use_sliding_window; by default on the NoPE layers
        if not cfg.get("use_sliding_window", False) or window is None:
            return ()
        types = cfg.get("layer_types")
        if types is None:
            nope = _nope_layers(cfg, n_layers) or (False,) * n_layers
            types = ["sliding_attention" if n else "full_attention" for n in nope]
        _checked_types(types, n_layers)
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type in ("cohere2", "exaone4"):  # the sliding layers (the ones with the rope) see sliding_window
        if model_type == "exaone4" and window is None:  # EXAONE 4 without a window: every layer full, with the rope
            if cfg.get("layer_types") is None:
                raise UnsupportedModel(
                    "an exaone4 config with a null sliding_window needs layer_types (transformers' class cannot "
                    "make them from sliding_window_pattern then)"
                )
            _hybrid_types(cfg, n_layers)  # checked, though every layer sees everything
            return ()
        types = _hybrid_types(cfg, n_layers)
        if window is None and "sliding_attention" in types:
            raise UnsupportedModel("layer_types has sliding_attention layers but sliding_window is not set")
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type in ("gemma2", "gemma3_text", "olmo3"):
        types = cfg.get("layer_types")
        if types is None:  # transformers' default pattern: every n-th layer (from 1) sees everything
            every = {"gemma2": 2, "olmo3": 4}.get(model_type) or int(cfg.get("sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
        _checked_types(types, n_layers)
        twin = cfg.get("sliding_window_size")
        if twin is not None and twin != window:
            raise UnsupportedModel(f"sliding_window_size {twin!r} and sliding_window {window!r} disagree")
        if window is None and "sliding_attention" in types:
            raise UnsupportedModel("layer_types has sliding_attention layers but sliding_window is not set")
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    else:
        return ()
    if any(w is not None and w < 1 for w in out):
        raise UnsupportedModel(f"sliding_window {window!r} must be a positive number of tokens")
    return out if any(w is not None for w in out) else ()


def _layer_type_ropes(cfg: dict, fam: Family, head_dim: int, max_pos: int) -> tuple[Rope, Rope]:
    """The two ropes of Gemma 3 and OLMo 3, (full-attention layers', sliding-window layers'), from either
    spelling: `rope_parameters` keyed by layer type (current transformers), or `rope_theta` +
    `rope_scaling` for the full layers and for the sliding ones a default rope of Gemma 3's
    `rope_local_base_freq` or OLMo 3's `rope_theta` (LAYER_TYPE_ROPES)."""
    theta = cfg.get("rope_theta", DEFAULT_THETA[fam.model_type])
    local_field = LAYER_TYPE_ROPES[fam.model_type]
    local_theta = theta if local_field is None else cfg.get(local_field[0], local_field[1])
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        extra = sorted(set(params) - {"full_attention", "sliding_attention"})
        if extra or _is_set(cfg.get("rope_scaling")):
            raise UnsupportedModel(
                f"rope_parameters {params}: expected only full_attention and sliding_attention entries"
                + (" (and no rope_scaling beside them)" if not extra else "")
            )
        full = {"rope_theta": theta, **(params.get("full_attention") or {})}
        local = {"rope_theta": local_theta, **(params.get("sliding_attention") or {})}
    else:
        full = {**(params or {}), **(cfg.get("rope_scaling") or {})}
        full.setdefault("rope_theta", theta)
        local = {"rope_type": "default", "rope_theta": local_theta}
    return _rope_of(full, cfg, fam, head_dim, max_pos), _rope_of(local, cfg, fam, head_dim, max_pos)


def _rope_from_hf(cfg: dict, fam: Family, head_dim: int, max_pos: int) -> Rope:
    if _is_set(cfg.get("rope_scaling")) and _is_set(cfg.get("rope_parameters")):
        if cfg["rope_scaling"] != {k: v for k, v in cfg["rope_parameters"].items() if k in cfg["rope_scaling"]}:
            raise UnsupportedModel(
                f"config has both rope_scaling {cfg['rope_scaling']} and rope_parameters "
                f"{cfg['rope_parameters']}, and they disagree"
            )
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(
            f"rope_parameters {params}: per-layer-type rope parameters are not used by {fam.model_type} models"
        )
    return _rope_of(params, cfg, fam, head_dim, max_pos)


def _rope_of(params: dict, cfg: dict, fam: Family, head_dim: int, max_pos: int) -> Rope:
    """One rope from its parameters (rope_type, rope_theta, its kind's fields)."""
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if fam.model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # transformers' Phi-3 reads these names as LongRoPE
    if kind not in ROPE_KINDS:
        raise UnsupportedModel(
            f"rope type {kind!r} (rope_parameters.rope_type) is not supported; supported: {', '.join(ROPE_KINDS)}"
        )
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", DEFAULT_THETA.get(fam.model_type, 10000.0))))
    if fam.model_type == "hunyuan_v1_dense" and kind == "dynamic" and params.get("alpha"):
        kind, theta = "default", _ntk_alpha_theta(params, theta, head_dim)
    default_partial = DEFAULT_PARTIAL_ROTARY.get(fam.model_type, 1.0)
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial))
    if partial is None:
        partial = default_partial
    if partial != 1.0 and not fam.partial_rotary:
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not used by {fam.model_type} models")
    dim = int(head_dim * partial)
    if dim % 2 or dim <= 2:
        raise UnsupportedModel(
            f"rotary dimension {dim} (head_dim {head_dim} × partial_rotary_factor {partial}) must be even"
        )
    extra = sorted(set(params) - ROPE_FIELDS[kind])
    if extra:
        raise UnsupportedModel(
            f"rope_parameters field(s) {', '.join(extra)} are not used by rope type {kind!r} "
            f"(it reads {', '.join(sorted(ROPE_FIELDS[kind])) or 'only rope_theta'})"
        )
    kw: dict = {
        "kind": kind,
        "theta": theta,
        "dim": dim,
        "interleaved": fam.interleaved_rope,
        "fp32": fam.fp32_rope,
        "fp32_tables": fam.fp32_rope_tables,
    }
    if kind in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in cfg:  # transformers lets the top-level value win
            orig = cfg["original_max_position_embeddings"]
        else:
            orig = params.get("original_max_position_embeddings", max_pos)
        kw["original_max"] = int(orig)
    try:
        if kind in ("linear", "dynamic", "llama3"):
            kw["factor"] = float(params["factor"])
        if kind == "dynamic":
            kw["max_positions"] = int(max_pos)
        if kind == "llama3":
            kw["low_freq_factor"] = float(params["low_freq_factor"])
            kw["high_freq_factor"] = float(params["high_freq_factor"])
    except KeyError as e:
        raise UnsupportedModel(f"rope type {kind!r} needs rope_parameters.{e.args[0]}") from None
    if kind == "yarn":
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_pos / kw["original_max"]
        kw["factor"] = factor
        kw["attention_factor"] = _yarn_attention_factor(factor, params)
        kw["beta_fast"] = float(params.get("beta_fast") or 32)
        kw["beta_slow"] = float(params.get("beta_slow") or 1)
        kw["truncate"] = bool(params.get("truncate", True))
    if kind == "longrope":
        try:
            short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
        except (KeyError, TypeError, ValueError):
            raise UnsupportedModel("rope type 'longrope' needs lists short_factor and long_factor") from None
        if len(short) != dim // 2 or len(long) != dim // 2:
            raise UnsupportedModel(f"longrope short_factor/long_factor must have {dim // 2} entries each")
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_pos / kw["original_max"]
        att = params.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(kw["original_max"]))
        kw |= {"short_factor": short, "long_factor": long, "factor": factor, "attention_factor": float(att)}
    return Rope(**kw)


# What Hunyuan's config.json carries beside its alpha, which transformers' fixed NTK-alpha rope does not read
NTK_ALPHA_UNREAD = frozenset(
    {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings"}
)


def _ntk_alpha_theta(params: dict, theta: float, head_dim: int) -> float:
    """Hunyuan's rope "dynamic" with an `alpha`, as transformers runs it (its "ntk_alpha"): θ · alpha^(d / (d − 2))
    over head_dim d, the same at every length (params: alpha and the fields it leaves unread are removed)."""
    alpha = params.pop("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or math.isinf(alpha):
        raise UnsupportedModel(f"rope_parameters.alpha must be a positive number, got {alpha!r}")
    for key in NTK_ALPHA_UNREAD:
        params.pop(key, None)
    return theta * alpha ** (head_dim / (head_dim - 2))


def _yarn_attention_factor(factor: float, params: dict) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


__all__ = [
    "ModelArgs",
    "Rope",
    "Family",
    "text_model_config",
    "TEXT_MODELS",
    "Matrix",
    "FAMILIES",
    "SUPPORTED",
    "UnsupportedModel",
    "GROUP_ORDER",
]
