"""What `bitdelta inspect` says of a delta file, from its header alone: `info` (the numbers, as
`--json` prints them) and `text` (the lines a person reads). The family's memory report quotes
`text` for each of its deltas."""

from __future__ import annotations

import json
from pathlib import Path

from bitdelta.units import human_bytes


def info(path: Path) -> dict:
    """The header's facts and the file's bytes by part (signs, α, low-rank factors, dense tensors)."""
    from bitdelta.format import read_header

    h = read_header(path)
    meta = h.meta
    roles = h.bytes_by_role()
    params = sum(d_out * d_in for d_out, d_in in meta.shapes.values())
    bf16_equiv = params * 2 + roles["dense"]
    return {
        "file": str(path),
        "variant": meta.variant,
        "base_model": meta.base_model,
        "base_fingerprint": meta.base_fingerprint,
        "format_version": h.metadata["format_version"],
        "architecture": meta.architecture or "llama/mistral (format v1)",
        "layout": meta.layout,
        "alpha_mode": meta.alpha_mode,
        "distilled": meta.distilled,
        # how the signs were chosen where the header says (files before 2026-12-05 never do)
        "signs_by": "error feedback" if meta.extra.get("signs") == "feedback" else None,
        # an imported LoRA adapter's factors, served as they are (`bitdelta import-lora`)
        "lora_rank": int(meta.extra["lora_rank"]) if meta.extra.get("source") == "lora" else None,
        "tool_version": meta.tool_version,
        "eos_token_ids": list(meta.eos_token_ids),  # the fine-tune's own; empty: the base's
        "chat_template_chars": len(meta.chat_template.source) if meta.chat_template else 0,  # 0: the base's
        "sampling_defaults": meta.sampling_defaults,  # the fine-tune's own; empty: the base's
        "tokenizer_sha256": meta.tokenizer_sha256,  # the fine-tune's own tokenizer.json's; "": the base's
        "vocab_size": meta.vocab_size,  # a grown vocabulary (tokens added); 0: the base's
        "compressed_weights": len(meta.shapes),
        "compressed_params": params,
        "dense_tensors": sum(t.role == "dense" for t in h.tensors),
        "dense_biases": sum(t.role == "dense" and t.param.endswith(".bias") for t in h.tensors),
        "bytes": {
            "signs": roles["sign"],
            "alpha": roles["alpha"],
            "lowrank": roles["lowrank"],
            "dense": roles["dense"],
            "files": roles["file"],
            "header": h.header_bytes,
            "total": h.file_size,
        },
        "bytes_by_plane": h.bytes_by_plane(),
        "weights_by_plane": {i: sum(len(meta.axes(p)) >= i for p in meta.shapes) for i in h.bytes_by_plane()},
        "rank_total": sum(meta.rank(p) for p in meta.shapes),
        "ratio_vs_bf16": round(bf16_equiv / h.file_size, 2) if h.file_size else None,
        "ratio_compressed_part": round(params * 2 / max(1, roles["sign"] + roles["alpha"] + roles["lowrank"]), 2),
    }


def text(path: Path) -> str:
    """`info(path)` as `bitdelta inspect` prints it: one line a fact, ending with a newline."""
    i = info(path)
    b = i["bytes"]
    lines = [
        f"{path}: BitDelta v{i['format_version']} variant {i['variant']!r} of base {i['base_model']!r}",
        f"  base fingerprint  {i['base_fingerprint']}",
        f"  architecture      {i['architecture']}, layout {i['layout']}",
        f"  alpha mode        {i['alpha_mode']}; distilled: {json.dumps(i['distilled']) if i['distilled'] else 'no'}",
        "  ends on           "
        + (f"tokens {i['eos_token_ids']} (the fine-tune's own)" if i["eos_token_ids"] else "the base's EOS tokens"),
        "  chat template     "
        + (f"its own ({i['chat_template_chars']} characters)" if i["chat_template_chars"] else "the base's"),
        "  sampling defaults "
        + (f"its own: {json.dumps(i['sampling_defaults'])}" if i["sampling_defaults"] else "the base's"),
        "  tokenizer         "
        + (
            f"its own (tokenizer.json, {human_bytes(b['files'])}, sha256 {i['tokenizer_sha256'][:16]}…)"
            if i["tokenizer_sha256"]
            else "the base's"
        )
        + (f"; its vocabulary grown to {i['vocab_size']} tokens" if i["vocab_size"] else ""),
        f"  compressed        {i['compressed_weights']} weights, {i['compressed_params']:,} params"
        + (f" (a LoRA adapter of rank {i['lora_rank']}, its factors as they are)" if i["lora_rank"] else ""),
        f"  signs             {human_bytes(b['signs'])}" + (f", chosen by {i['signs_by']}" if i["signs_by"] else ""),
        f"  alpha             {human_bytes(b['alpha'])}",
    ]
    if len(i["bytes_by_plane"]) > 1 or b["lowrank"]:
        lines += [
            f"    plane {plane}         {human_bytes(n)} (signs + alpha) in {i['weights_by_plane'][plane]} weights"
            for plane, n in i["bytes_by_plane"].items()
        ]
        lines.append(f"  low-rank          {human_bytes(b['lowrank'])} (rank {i['rank_total']} over all weights)")
    lines += [
        f"  dense             {human_bytes(b['dense'])} in {i['dense_tensors']} tensors ({i['dense_biases']} of them biases)",
        f"  file              {human_bytes(b['total'])}",
        f"  ratio             {i['ratio_vs_bf16']}x smaller than the same parameters in bf16 "
        f"({i['ratio_compressed_part']}x on the compressed weights alone)",
    ]
    return "\n".join(lines) + "\n"
