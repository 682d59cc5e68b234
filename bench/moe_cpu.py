"""Single-stream CPU decode of a mixture of experts: the base and a variant, each as a fraction of the
bytes a step must read (the experts its token chose, not all of them), measured in the same run.

    python bench/moe_cpu.py [--layers 4] [--dtype bfloat16] [--reps 3] [--out FILE]

Random weights of Qwen3-30B-A3B's shapes (128 experts of 768 columns, 8 per token, dim 2048, its
attention and vocabulary) with fewer layers (`--layers` of its 48: the memory here), written once with
transformers' own config class under build/bench_bases/, a byte tokenizer beside them; the variant's
delta is random signs and α for every matrix (the router and every expert included), which is what a
compressed fine-tune reads: speed does not depend on the values. The worker is the in-process `Worker`
on one thread (`--threads`); each cell is the decode phase's rate of one greedy stream
(`bench/worker.py`'s decode_rate). The limit: the bytes one token's step reads (attention, router, its
experts, norms, the head; a variant's signs and α of the same) ÷ the read bandwidth (best of the run).
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
# Qwen3-30B-A3B's config.json but for the number of layers
SHAPE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
)
VARIANT = "v0"


def base_of(layers: int) -> Path:
    """The random base of `layers` layers (written once)."""
    from bitdelta.testing.family import write_byte_tokenizer

    out = ROOT / "build" / "bench_bases" / f"qwen3-30b-a3b-{layers}l"
    if (out / "config.json").exists():
        return out
    here = str(Path(__file__).resolve().parent)  # bench/kernels.py would shadow the `kernels` package
    sys.path[:] = [p for p in sys.path if str(Path(p).resolve()) != here]
    import transformers as tf

    print(f"writing a random {layers}-layer Qwen3-30B-A3B base to {out}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(**{**SHAPE, "num_hidden_layers": layers}, bos_token_id=2, eos_token_id=1)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    model.save_pretrained(out)
    write_byte_tokenizer(out)
    return out


def delta_of(base: Path) -> Path:
    """A delta of random signs and α (per row) for every matrix of `base` (written once)."""
    from bitdelta.arch import ModelArgs
    from bitdelta.checkpoint import fingerprint, read_config
    from bitdelta.format import CompressedWeight, Delta, DeltaMeta, SignPlane, save_delta

    out = base.parent / f"{base.name}-deltas" / f"{VARIANT}.bitdelta.safetensors"
    if out.exists():
        return out.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ModelArgs.from_hf(read_config(base))
    g = torch.Generator().manual_seed(1)
    compressed = {}
    for i in range(args.n_layers):
        for m in args.matrices():
            signs = torch.randint(0, 256, (m.d_out, (m.d_in + 7) // 8), generator=g, dtype=torch.uint8)
            alpha = 1e-3 * torch.rand(m.d_out, generator=g)
            compressed[f"model.layers.{i}.{m.name}.weight"] = CompressedWeight(
                [SignPlane(signs, alpha, "row")], (m.d_out, m.d_in)
            )
    meta = DeltaMeta(
        variant=VARIANT,
        base_model=base.name,
        base_fingerprint=fingerprint(base),
        alpha_mode="row",
        architecture=args.model_type,
        layout=args.layout,
        shapes={k: list(v.shape) for k, v in compressed.items()},
    )
    save_delta(out, Delta(meta, compressed, {}))
    return out.parent


def step_bytes(runner, variant: bool) -> int:
    """What one token's decode step reads: every weight but the experts it did not choose (and the
    embedding's other rows); a variant's signs and α of the same matrices."""
    a, b = runner.args, runner.base
    size = b.embed.element_size()
    n = b.head.numel() + b.final_norm.numel()
    for layer, norms in zip(b.layers, b.norms):
        experts = sum(t.numel() for g, t in layer.items() if g.startswith(("gate_up.", "down.")))
        n += sum(t.numel() for t in layer.values()) - experts + experts * a.experts_per_token // a.n_experts
        n += sum(t.numel() for t in norms.values())
    total = n * size
    if variant:  # one sign bit per weight of the layers (the head is the base's) and an fp32 α per row
        layers = (n - b.head.numel() - b.final_norm.numel()) // a.n_layers
        rows = sum(o for g, (o, _) in a.group_shapes().items() if not g.startswith(("gate_up.", "down.")))
        rows += sum(o for g, (o, _) in a.group_shapes().items() if g.startswith(("gate_up.", "down."))) // (
            a.n_experts // a.experts_per_token
        )
        total += a.n_layers * (layers // 8 + 4 * rows)
    return total


async def measure(args) -> dict[str, list[float]]:
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    torch.set_num_threads(args.threads)
    base = base_of(args.layers)
    deltas = delta_of(base)
    worker = Worker(
        WorkerConfig(
            base=base, delta_dir=str(deltas), dtype=args.dtype, device="cpu", kv_cache=64 << 20, delta_budget=2 << 30
        )
    )
    await worker.start()
    out: dict[str, list[float]] = {"": [], VARIANT: []}
    try:
        for m in out:  # warm: the C library, the first step's buffers, the variant's load
            await decode_rate(worker, [m], PROMPT, 4)
        for _ in range(args.reps):  # in turns
            for m, rates in out.items():
                rates.append(await decode_rate(worker, [m], PROMPT, args.new_tokens))
        out["bytes"] = [step_bytes(worker.runner, False), step_bytes(worker.runner, True)]
    finally:
        await worker.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    res = asyncio.run(measure(args))
    bw = max(read_bandwidth(torch.device("cpu")) for _ in range(3))
    lines = [
        f"single-stream decode of Qwen3-30B-A3B's shapes, {args.layers} of its 48 layers, {args.dtype}, "
        f"{args.threads} thread(s), {args.new_tokens} tokens, best of {args.reps} in turns; read bandwidth "
        f"{bw / 1e9:.1f} GB/s (best of the run)",
        "| model | bytes a step reads | limit, tok/s | tok/s (÷ limit) |",
        "|---|---|---|---|",
    ]
    for (m, label), nbytes in zip((("", "base"), (VARIANT, "variant")), res["bytes"]):
        limit = bw / nbytes
        best = max(res[m])
        lines.append(f"| {label} | {nbytes / 1e6:.0f} MB | {limit:.1f} | {best:.2f} ({best / limit:.2f}) |")
    base, var = max(res[""]), max(res[VARIANT])
    lines.append(f"variant ÷ base {var / base:.2f} (its bytes' limit {res['bytes'][0] / res['bytes'][1]:.2f})")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
