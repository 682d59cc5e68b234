"""The memory report: what a variant costs as a BitDelta file against a full copy.

Reads only file headers (`bitdelta.format.read_header`), so it is instant.
Bytes are decimal (MB = 10⁶ B). The base is counted in bf16, the serving
dtype, although data/base stores fp32 (the dequantised GGUF, bit-exact).
"""

from __future__ import annotations

import math
import time

from bitdelta import inspect_report
from bitdelta.family import SERVING_MODE, FamilyPaths

FLEET_SIZES = (1, 4, 14, 100)
# One plane of per-row α with the fine-tuned embedding table stored dense (for comparison).
DENSE_EMB_MODE = "row-distilled"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def base_params(p: FamilyPaths) -> int:
    """Parameters stored in the base checkpoint (a tied LM head is the embedding table: counted once)."""
    from bitdelta.checkpoint import CheckpointReader

    n = 0
    with CheckpointReader(p.base) as r:
        for name in r.keys():
            n += math.prod(r.shape(name))
    return n


def delta_rows(p: FamilyPaths, variants: list[str]) -> list[dict]:
    from bitdelta.format import read_header

    rows = []
    for v in variants:
        for mode in (SERVING_MODE, DENSE_EMB_MODE):
            path = p.delta_mode(v, mode)
            if not path.is_file():
                continue
            h = read_header(path)
            roles = h.bytes_by_role()
            rows.append(
                {
                    "variant": v,
                    "mode": mode,
                    "path": path,
                    "signs": roles["sign"],
                    "alpha": roles["alpha"],
                    "dense": roles["dense"],
                    "header": h.header_bytes,
                    "total": h.file_size,
                    "dense_names": sorted({t.param for t in h.tensors if t.role == "dense"}),
                }
            )
    return rows


def memory_markdown(p: FamilyPaths, variants: list[str], command: str) -> str:
    from bitdelta.family.quality import machine

    n_params = base_params(p)
    base_bf16 = 2 * n_params
    rows = delta_rows(p, variants)
    lines = [
        "# Memory report: the SmolLM2-135M family as BitDelta files",
        "",
        f"Made {time.strftime('%Y-%m-%d %H:%M %Z')} on {machine()}.",
        f"Command: `{command}`",
        "",
        f"Base: {n_params:,} parameters = {_mb(base_bf16)} MB in bf16 "
        f"({_mb((p.base / 'model.safetensors').stat().st_size)} MB on disk as fp32).",
        "",
        "## One delta per variant",
        "",
        f"`{SERVING_MODE}` is the serving default (data/deltas/): per-row α, the tied embedding/LM head "
        "compressed to signs + α like the projections (every sign chosen by error feedback: the same "
        f"bytes); only the RMSNorm weights are stored dense. `{DENSE_EMB_MODE}` is one plane of per-row α "
        "with the changed embedding table stored dense, in the fine-tune's fp32 (data/deltas-modes/). Target: "
        "about 1/16 of the base's bf16 bytes (1 bit against 16 per weight), 16×.",
        "",
        "| variant | mode | signs MB | α MB | dense MB | file MB | base bf16 ÷ delta |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['mode']} | {_mb(r['signs'])} | {_mb(r['alpha'])} | {_mb(r['dense'])} | "
            f"{_mb(r['total'])} | {base_bf16 / r['total']:.1f}× |"
        )
    serving = next((r for r in rows if r["mode"] == SERVING_MODE), None)
    if serving:
        names = serving["dense_names"]
        what = "the RMSNorm weights" if all(n.endswith("norm.weight") for n in names) else ", ".join(names[:4])
        lines += [
            "",
            f"Dense tensors of a serving delta: {len(names)} ({what}). "
            f"It is {base_bf16 / serving['total']:.1f}× smaller than the bf16 base: the signs alone are "
            f"{base_bf16 / serving['signs']:.1f}×; the fp32 per-row α's ({_mb(serving['alpha'])} MB, "
            "one per output row and one per vocabulary row) and the norms make up the rest.",
        ]
    dense_example = next((r for r in rows if r["mode"] == DENSE_EMB_MODE), None)
    if dense_example:
        lines += [
            "",
            f"Dense tensors of a {DENSE_EMB_MODE} delta: {len(dense_example['dense_names'])} "
            f"(the embedding table and the RMSNorm weights; full fine-tuning moved them, so they are "
            f"stored whole). At this size the embedding table (49152 × 576) is {49152 * 576 / n_params:.0%} "
            "of the parameters, so it dominates a dense-embedding delta (and it is stored in the "
            "fine-tune's fp32: 113 MB; 57 MB in bf16). On Llama-2-70B the embedding and head are 0.8 % "
            "of the parameters, on Llama-3-70B 3 % (a 128k vocabulary).",
        ]
    lines += [
        "",
        "## A fleet of N variants: N full copies against base + N deltas (bf16 base)",
        "",
        f"| N | N full copies MB | base + N {SERVING_MODE} (serving) MB | base + N {DENSE_EMB_MODE} MB |",
        "|---:|---:|---:|---:|",
    ]

    def mean_total(mode):
        t = [r["total"] for r in rows if r["mode"] == mode]
        return sum(t) / len(t) if t else float("nan")

    def fleet(d: float, n: int) -> str:
        return _mb(base_bf16 + n * d) if d == d else "– (not built)"  # NaN: no delta of that mode

    d_serving, d_dense = mean_total(SERVING_MODE), mean_total(DENSE_EMB_MODE)
    for n in FLEET_SIZES:
        lines.append(f"| {n} | {_mb(n * base_bf16)} | {fleet(d_serving, n)} | {fleet(d_dense, n)} |")
    lines += [
        "",
        "(mean delta size over the variants; 100 is extrapolated.) For the 70B arithmetic and GPU "
        "placement, see `bitdelta plan` and reports/plan-70b.md.",
        "",
        "## `bitdelta inspect` on each delta",
        "",
    ]
    for r in rows:
        lines += ["```", inspect_report.text(r["path"]).rstrip().replace(str(p.root), "$BITDELTA_DATA"), "```", ""]
    return "\n".join(lines)
