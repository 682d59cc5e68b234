"""A PEFT LoRA adapter as a delta file, served exactly: vLLM multi-LoRA families on this system.

A LoRA adapter's update of a module is already low-rank, Δ = scale · B · A, which is a delta
file's low-rank part (format v3: `P.lowrank_u` fp16 [d_out, r], `P.lowrank_v` fp16 [r, d_in]) with
no sign plane at all. So the file holds U = scale · B and V = A, each rounded once to fp16 (what
the format stores; an adapter is usually trained in bf16, which fp16 holds with 3 more bits), and
the worker adds (x · Vᵀ) · Uᵀ to its module's output in fp32, as it does for any low-rank residual,
in the same mixed batches as BitDelta variants. Nothing is compressed: the file is the adapter's
own size (fp16), and the variant is the adapter up to that one rounding.

What `bitdelta.merge.adapter.load_adapter` cannot represent faithfully is refused there (DoRA,
trained biases, modules_to_save, embedding LoRA, fan_in_fan_out); a module this base does not have,
a shape that does not fit, or factors beyond fp16's range are refused here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bitdelta.arch import ModelArgs
from bitdelta.checkpoint import CheckpointReader, fingerprint, read_config
from bitdelta.format import CompressedWeight, Delta, DeltaMeta, save_delta
from bitdelta.merge.adapter import load_adapter

FP16_MAX = torch.finfo(torch.float16).max


def import_lora(
    base: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike, variant: str | None = None
) -> Path:
    """Write the delta file of the PEFT adapter directory `adapter` for `base` to `out` (atomically)."""
    base, adapter, out = Path(base), Path(adapter), Path(out)
    lora = load_adapter(adapter, name=variant)
    cfg = read_config(base)
    args = ModelArgs.from_hf(cfg)
    projections = set(args.compressed_names())
    compressed: dict[str, CompressedWeight] = {}
    with CheckpointReader(base) as rb:
        for module, m in lora.modules.items():
            param = module + ".weight"
            if param not in projections:
                what = "is not a parameter of this base" if param not in rb else "is not a projection the worker serves"
                raise ValueError(f"{adapter}: the adapter changes {module}, which {what} ({base})")
            if tuple(rb.shape(param)) != m.shape:
                raise ValueError(f"{adapter}: {module} is {list(m.shape)} in the adapter, {rb.shape(param)} in {base}")
            u, v = m.B.float() * m.scale, m.A.float()
            big = max(u.abs().max().item(), v.abs().max().item())
            if big > FP16_MAX:
                raise ValueError(f"{adapter}: {module}'s factors reach {big:.3g}, beyond float16's range")
            compressed[param] = CompressedWeight([], m.shape, u.half(), v.half())
    meta = DeltaMeta(
        variant=lora.name,
        base_model=cfg.get("_name_or_path") or base.name,
        base_fingerprint=fingerprint(base),
        alpha_mode="row",
        shapes={k: list(w.shape) for k, w in compressed.items()},
        architecture=args.model_type,
        layout=args.layout,
        extra={"source": "lora", "lora_rank": str(lora.rank)},
    )
    save_delta(out, Delta(meta, compressed, {}))
    return out
