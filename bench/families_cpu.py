"""Single-stream CPU decode of other families' real shapes: the C decode layers against the
layer-by-layer path (each projection still a C GEMV, the rest torch ops), in one process, the two in
turns, each as a fraction of the weights' bytes limit measured in the same run.

    python bench/families_cpu.py [--members gemma3-270m,qwen3-0.6b] [--dtype bfloat16] [--reps 3] [--out FILE]

Random weights of the published shapes (written once with transformers' own config classes under
build/bench_bases/, a byte tokenizer beside them): speed does not depend on the values. The worker is
the in-process `Worker` on one thread (`--threads`); each cell is the decode phase's rate
(`bench/worker.py`'s decode_rate) of one greedy stream. The limit: the bytes a decode step reads (every
weight once, the embedding's row aside) ÷ the read bandwidth (`read_bandwidth`, best of the run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from worker import decode_rate, read_bandwidth  # noqa: E402  (bench/worker.py)

PROMPT = "Once upon a time, in a small village by the sea, there lived"
# Published shapes (the models' config.json), random weights.
MEMBERS = {
    "gemma3-270m": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
            layer_types=["sliding_attention"] * 5
            + ["full_attention"]
            + ["sliding_attention"] * 5
            + ["full_attention"]
            + ["sliding_attention"] * 5
            + ["full_attention"],
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
        ),
    ),
    # GLM's interleaved rope pairs, rotated in fp32 and rounded once; transformers' class defaults are
    # ERNIE-4.5-0.3B's published config.json
    "ernie4.5-0.3b": ("Ernie4_5Config", {}),
    # LayerNorms with biases, q/k/v biases, a quarter of each head rotating (StableLM 2 1.6B's config.json)
    "stablelm-2-1.6b": (
        "StableLmConfig",
        dict(
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            use_qkv_bias=True,
            partial_rotary_factor=0.25,
            tie_word_embeddings=False,
        ),
    ),
    # a parallel block summed (attention + MLP) + x, gelu_new, a biased head (run by the runner after the C
    # call) (Phi-1.5's config.json)
    "phi-1.5": (
        "PhiConfig",
        dict(
            vocab_size=51200,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            max_position_embeddings=2048,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
        ),
    ),
    # GPT-NeoX's parallel block with the MLP's own norm, its exact GELU one value at a time (erff) in the C layers,
    # stored fused and head-interleaved (Pythia-410M's config.json)
    "pythia-410m": (
        "GPTNeoXConfig",
        dict(
            vocab_size=50304,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            max_position_embeddings=2048,
            rotary_pct=0.25,
            rotary_emb_base=10000,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
    ),
}


def base_of(name: str) -> Path:
    """The member's random base (written once)."""
    from bitdelta.testing.family import write_byte_tokenizer

    out = ROOT / "build" / "bench_bases" / name
    if (out / "config.json").exists():
        return out
    here = str(
        Path(__file__).resolve().parent
    )  # bench/kernels.py would shadow the `kernels` package transformers imports
    sys.path[:] = [p for p in sys.path if str(Path(p).resolve()) != here]
    import transformers as tf

    cls, kw = MEMBERS[name]
    print(f"writing a random {name} base to {out}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(
        getattr(tf, cls)(**kw, bos_token_id=2, eos_token_id=1), dtype=torch.bfloat16
    )
    model.save_pretrained(out)
    write_byte_tokenizer(out)
    return out


async def measure(name: str, args) -> tuple[list[float], list[float], float]:
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    torch.set_num_threads(args.threads)
    base = base_of(name)
    empty = ROOT / "build" / "bench_bases" / "no_deltas"
    empty.mkdir(parents=True, exist_ok=True)
    worker = Worker(WorkerConfig(base=base, delta_dir=str(empty), dtype=args.dtype, device="cpu", kv_cache=64 << 20))
    await worker.start()
    runner = worker.runner
    b = runner.base
    weights = b.nbytes - b.embed.numel() * b.embed.element_size() * (b.head is not b.embed)
    c, ops = [], []
    try:
        await decode_rate(worker, [""], PROMPT, 4)  # warm: the C library, the first step's buffers
        for _ in range(args.reps):  # in turns
            for layered, out in ((False, c), (True, ops)):
                runner.__dict__.pop("_c_group_shapes", None)  # a cached property: recomputed, or pinned to None
                if layered:
                    runner.__dict__["_c_group_shapes"] = None
                out.append(await decode_rate(worker, [""], PROMPT, args.new_tokens))
        print(f"{name}: C layers {max(c):.1f}, layer by layer {max(ops):.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        runner.__dict__.pop("_c_group_shapes", None)
        await worker.close()
    return c, ops, weights


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=lambda v: v.split(","), default=list(MEMBERS))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    rows = [(m, *asyncio.run(measure(m, args))) for m in args.members]
    bw = max(read_bandwidth(torch.device("cpu")) for _ in range(3))
    lines = [
        f"single-stream decode, {args.dtype}, {args.threads} thread(s), {args.new_tokens} tokens, best of {args.reps} "
        f"in turns; read bandwidth {bw / 1e9:.1f} GB/s (best of the run)",
        "| member | weights read a step | limit, tok/s | C layers, tok/s (÷ limit) | layer by layer, tok/s (÷ limit) "
        "| C ÷ layer by layer |",
        "|---|---|---|---|---|---|",
    ]
    for m, c, ops, weights in rows:
        limit = bw / weights
        lines.append(
            f"| {m} | {weights / 1e6:.0f} MB | {limit:.1f} | {max(c):.1f} ({max(c) / limit:.2f}) "
            f"| {max(ops):.1f} ({max(ops) / limit:.2f}) | {max(c) / max(ops):.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
