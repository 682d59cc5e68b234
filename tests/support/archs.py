"""Tiny random bases of every supported family, built with transformers' own config classes
and saved by transformers itself, so the reference is the outside implementation, not ours.

    base = make_hf_base(tmp_path / "qwen3", "qwen3")      # config.json, model.safetensors, tokenizer.json
    ref = hf_model(base)                                   # transformers.AutoModelForCausalLM, fp32

Every config is small (2 layers, dim 32) but exercises what its family adds; the rope
variants that depend on length have an original context of ORIGINAL tokens, so a test at
LONG tokens runs past it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bitdelta.testing.family import SPECIALS, write_byte_tokenizer

ORIGINAL = 16  # the rope's "original" context of the long-context configs
LONG = 40  # a context past it
VOCAB = 256 + len(SPECIALS)
EOS = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
    bos_token_id=EOS,
    eos_token_id=EOS,
    pad_token_id=EOS + 1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}


def hf_config(name: str):
    """The transformers config of one named tiny family member."""
    import transformers as tf

    if name == "llama-3.1":  # llama3 rope, written as current transformers writes it (rope_parameters)
        return tf.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)
    if name == "llama-3.2":  # tied embeddings, the older rope_scaling spelling
        rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling=rope, rope_theta=500000.0)
    if name == "llama-linear":
        return tf.LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})
    if name == "llama-dynamic":
        return tf.LlamaConfig(
            **{**COMMON, "max_position_embeddings": ORIGINAL}, rope_scaling={"type": "dynamic", "factor": 2.0}
        )
    if name == "llama-yarn":
        return tf.LlamaConfig(
            **COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
        )
    if name == "llama-bias":  # attention_bias (q, k, v, o) and mlp_bias
        return tf.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)
    if name == "qwen2.5":  # q/k/v biases
        return tf.Qwen2Config(**COMMON, rope_theta=1000000.0)
    if name == "qwen2-swa":  # use_sliding_window: layers from max_window_layers on see 8 tokens
        return tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if name == "qwen3":  # per-head q/k norm, head_dim != hidden / heads
        return tf.Qwen3Config(**COMMON, head_dim=16)
    if name == "mistral":  # sliding window of 8 tokens (Mistral v0.1)
        return tf.MistralConfig(**COMMON, sliding_window=8, head_dim=8)
    if name == "phi3-mini":  # fused qkv_proj / gate_up_proj
        return tf.Phi3Config(**COMMON)
    if name == "phi3-longrope":  # LongRoPE short/long factors, partial rotary factor
        n = int(8 * 0.5) // 2
        return tf.Phi3Config(
            **COMMON,
            original_max_position_embeddings=ORIGINAL,
            partial_rotary_factor=0.5,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(n)],
                "long_factor": [1.0 + 0.7 * i for i in range(n)],
            },
        )
    if name == "gemma":  # (1 + w) norms, √dim embeddings, tanh GELU, tied head
        return tf.GemmaConfig(**COMMON, head_dim=8, hidden_act="gelu_pytorch_tanh")
    if name == "gemma2":  # sandwich norms, soft-capped scores and logits, every other layer windowed
        return tf.Gemma2Config(
            **COMMON,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=8,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
        )
    if name == "gemma3":  # + q/k norms, a rope per layer type (linear on the full layer)
        return tf.Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    if name == "granite":  # Llama's layer with its four scalars, none of them 1
        return tf.GraniteConfig(
            **COMMON, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0
        )
    if name == "ernie4.5":  # every projection biased, an interleaved rope in fp32 (one rounding), tied head
        return tf.Ernie4_5Config(**COMMON, head_dim=16, use_bias=True, tie_word_embeddings=True)
    if name == "seed-oss":  # q/k/v biases, o's by its own switch, an MLP with biases
        return tf.SeedOssConfig(**COMMON, head_dim=16, attention_out_bias=True, mlp_bias=True)
    if name == "glm":  # the MLP's gate and up fused, q/k/v biases, an interleaved rope over half of each head
        return tf.GlmConfig(**COMMON, head_dim=16)
    if name == "glm4":  # GLM's layer in a sandwich of norms under GLM-4's names
        return tf.Glm4Config(**COMMON, head_dim=16)
    if name == "olmo3":  # OLMo 2's layer, a window of 8 on the first layer, yarn on the full one's rope only
        return tf.Olmo3Config(
            **COMMON,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": ORIGINAL,
                    "rope_theta": 500_000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    if name == "smollm3":  # the second layer without the rope (NoPE) and sliding over 8 tokens, the first full
        return tf.SmolLM3Config(**COMMON, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8)
    if name == "olmo":  # OLMo 1: LayerNorms without parameters (none stored), q, k and v clipped to ±1 (a third
        # of this model's values)
        return tf.OlmoConfig(**COMMON, clip_qkv=1.0)
    if name in ("gpt-neox", "gpt-neox-seq"):  # stored fused and head-interleaved under its own names; LayerNorms
        # with biases, the exact GELU, half of each 8-wide head rotating (rotary_pct); a parallel block whose MLP
        # reads its own norm, or (-seq) Llama's sequential layer with unbiased attention (a wider MLP: with 48
        # columns this seed's greedy tokens repeat one word)
        seq = name == "gpt-neox-seq"
        common = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}  # no grouped KV
        common |= {"intermediate_size": 64} if seq else {}
        return tf.GPTNeoXConfig(**common, rotary_pct=0.5, use_parallel_residual=not seq, attention_bias=not seq)
    if name == "gptj":  # stored under its own names; Phi's parallel block, a biased head, gelu_new; GLM's interleaved
        # rope over rotary_dim = half of each 8-wide head
        common = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "intermediate_size")}
        return tf.GPTJConfig(**common, n_inner=80, rotary_dim=4)  # 80: 48 repeats one word at this seed
    if name.startswith("falcon"):  # stored fused under its own names; LayerNorms with biases, the exact GELU, a tied
        # head. -7b: multi-query (all q heads, then one k, one v), a parallel block under one norm; -40b: the new
        # decoder architecture, q/k/v grouped per KV head (2), its parallel block's two norms (ln_attn, ln_mlp);
        # -seq: every head its own q, k, v, the sequential layer, an untied head
        common = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "intermediate_size")}
        layout = {
            "falcon-7b": dict(multi_query=True),
            "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=2),
            "falcon-seq": dict(multi_query=False, parallel_attn=False, tie_word_embeddings=False),
        }[name]
        return tf.FalconConfig(**common, ffn_hidden_size=48, **layout)
    if name == "olmo2":  # norms after the sublayers only, q and k normed whole
        return tf.Olmo2Config(**COMMON)
    if name == "olmo2-1kv":  # one KV head (on two tensor-parallel ranks: replicated, its k counted once)
        return tf.Olmo2Config(**{**COMMON, "num_key_value_heads": 1})
    if name == "mixtral":  # a sparse layer of 4 experts, 2 per token (renormalised), windows of 8
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    if name == "qwen3-moe":  # Qwen3's attention, 4 experts of 24, 2 per token, not renormalised
        return tf.Qwen3MoeConfig(
            **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False
        )
    if name == "qwen2-moe":  # q/k/v biases, 4 experts of 24, 2 per token, a shared expert of 40 and its gate
        return tf.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
        )
    if name == "olmoe":  # OLMo's whole-projection q/k norms before the heads, 4 experts, 2 per token, q and k
        # (after their norms) and v clipped to ±1.5
        return tf.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, clip_qkv=1.5)
    if name == "ministral3":  # yarn from an original context of 16, Llama 4's attention temperature past it
        return tf.Ministral3Config(**COMMON, head_dim=8, rope_parameters=MINISTRAL3_ROPE)
    if name == "cohere":  # a parallel block under one LayerNorm, every projection of attention biased, an
        # interleaved rope in fp32 from tables in the model's dtype, the logits × logit_scale, a tied head
        return tf.CohereConfig(**COMMON, attention_bias=True, logit_scale=0.25)
    if name == "cohere-qk":  # Command R+: + q and k normed per head by LayerNorms of their own
        return tf.CohereConfig(**COMMON, logit_scale=0.25, use_qk_norm=True)
    if name == "cohere2":  # Cohere's layer, the first layer sliding over 8 tokens with the rope, the second full
        # without it (NoPE)
        return tf.Cohere2Config(
            **COMMON, sliding_window=8, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5
        )
    if name == "exaone4":  # OLMo 2's post-norms rounded as Llama's, per-head q/k norms, the first layer sliding
        # over 8 tokens with the rope, the second full without it (NoPE)
        return tf.Exaone4Config(**COMMON, head_dim=16, sliding_window=8, sliding_window_pattern=2)
    if name == "ministral":  # Mistral's layer with a window of 8 on the layers layer_types names (the second)
        return tf.MinistralConfig(
            **COMMON, head_dim=8, sliding_window=8, layer_types=["full_attention", "sliding_attention"]
        )
    if name == "internlm3":  # Llama's layer, every projection biased (its qkv_bias and bias spellings)
        return tf.InternLM3Config(**COMMON, head_dim=16, qkv_bias=True, bias=True)
    if name == "stablelm":  # LayerNorms with biases, q/k/v biases, the rope over a quarter of each 16-wide head
        return tf.StableLmConfig(**{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, use_qkv_bias=True)
    if name == "stablelm-parallel":  # + the parallel residual (the MLP from the input norm)
        return tf.StableLmConfig(**hf_config("stablelm").to_dict() | {"use_parallel_residual": True})
    if name == "stablelm-qk":  # StableLM 2 12B's: q and k normed per head by LayerNorms of their own (stored one per
        # head, no bias), the parallel residual, 4 query heads over 2 KV heads
        return tf.StableLmConfig(**COMMON, qk_layernorm=True, use_parallel_residual=True, partial_rotary_factor=0.5)
    if name == "starcoder2":  # every projection and LayerNorm biased, an ungated GELU MLP, windows of 8 (untied:
        # tied, this random base's greedy tokens repeat)
        return tf.Starcoder2Config(**COMMON, sliding_window=8, tie_word_embeddings=False)
    if name == "nemotron":  # LayerNorm1P (w + 1, biases), Llama's attention biased, the rope over half of each
        # 16-wide head, an ungated relu² MLP with biases
        return tf.NemotronConfig(**COMMON, head_dim=16, attention_bias=True, mlp_bias=True)
    if name == "arcee":  # Llama's layer with an ungated relu² MLP, a yarn rope from an original context of 16
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
        return tf.ArceeConfig(**COMMON, rope_parameters=rope)
    if name == "hunyuan":  # Llama's layer, q and k normed per head after the rope, θ stretched by an NTK alpha
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
        return tf.HunYuanDenseV1Config(**COMMON, head_dim=16, rope_parameters=rope)
    if name == "phi":  # Phi-2's layer: a parallel block under one biased LayerNorm, every projection and the head
        # biased, an ungated gelu_new MLP, half of each head rotating
        return tf.PhiConfig(**COMMON)
    if name == "ministral3-mm":  # Ministral 3 as it ships (Mistral3ForConditionalGeneration, a Pixtral tower)
        text = {**hf_config("ministral3").to_dict(), "tie_word_embeddings": False}
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
        return tf.Mistral3Config(
            text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14}, tie_word_embeddings=False
        )
    if name == "gemma3-mm":  # Gemma 3 as its multimodal checkpoints ship (Gemma3ForConditionalGeneration)
        text = hf_config("gemma3").to_dict()
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
        return tf.Gemma3Config(text_config=text, vision_config={**vision, "patch_size": 14}, mm_tokens_per_image=1)
    raise KeyError(name)


MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def causal_lm_class(config):
    """transformers' auto class that builds a config's model with its LM head (Mistral 3's wrapper is
    an image-text-to-text model only)."""
    import transformers as tf

    return tf.AutoModelForImageTextToText if config.model_type == "mistral3" else tf.AutoModelForCausalLM


# The members the issue names, one per family feature (each added one last: a test seeds its bases by
# their place here); and the extra rope variants.
FAMILY_MEMBERS = (
    "llama-3.1",
    "llama-3.2",
    "qwen2.5",
    "qwen3",
    "mistral",
    "phi3-mini",
    "phi3-longrope",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3-mm",
    "granite",
    "olmo2",
    "mixtral",
    "qwen3-moe",
    "olmoe",
    "qwen2-moe",
    "ministral3-mm",
    "smollm3",
    "olmo3",
    "glm",
    "glm4",
    "seed-oss",
    "ernie4.5",
    "cohere",
    "cohere2",
    "exaone4",
    "ministral",
    "internlm3",
    "stablelm",
    "starcoder2",
    "cohere-qk",
    "nemotron",
    "arcee",
    "hunyuan",
    "phi",
    "olmo",
    "gpt-neox",
    "gpt-neox-seq",
    "falcon-7b",
    "falcon-40b",
    "falcon-seq",
    "gptj",
    "stablelm-qk",
)
ROPE_MEMBERS = ("llama-linear", "llama-dynamic", "llama-yarn", "llama-bias", "qwen2-swa", "stablelm-parallel")


def make_hf_base(out: Path, name: str, seed: int = 0, std: float = 0.2) -> Path:
    """A random base of family member `name`, saved by transformers (safetensors) with a byte
    tokenizer. std 0.2 makes greedy outputs vary from token to token (see gpu_worker.testing)."""
    config = hf_config(name)
    torch.manual_seed(seed)
    model = causal_lm_class(config).from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else std * noise)
    model.save_pretrained(out)
    write_byte_tokenizer(Path(out))
    return Path(out)


def hf_model(ckpt: Path):
    """transformers' own model of a checkpoint (fp32, eval), fresh: its dynamic rope keeps state."""
    from transformers import AutoConfig

    return causal_lm_class(AutoConfig.from_pretrained(ckpt)).from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_greedy(ckpt: Path, prompt: list[int], n: int, stop_at_eos: bool = True) -> list[int]:
    """transformers' greedy continuation of `prompt`: n tokens, or up to and including EOS."""
    model = hf_model(ckpt)
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=EOS + 1)
    return out[0, len(prompt) :].tolist()
