"""The Triton delta kernels' main loops as an NVIDIA GPU would run them, measured without a GPU.

    python bench/kernels_sass.py                      # sm_90 (H100/H200), bf16, the H200 blocks
    python bench/kernels_sass.py --device A100 --arch 80

Each kernel is compiled by Triton's real compiler for `--arch`, with the launch blocks that
`configs.json` gives `--device`, down to a cubin, and disassembled with the `cuobjdump` that Triton
ships. The report counts the instructions of each kernel's K loop (its heaviest backward branch)
and prints them per weight the loop covers: thread-instructions per sign weight for the batched
delta (BGMV, SGMV: one row, or the tile's rows sharing each expanded bit), per (weight, sign
weight) pair for the fused linear. An SM issues at most 4 warp-instructions (128
thread-instructions) a cycle, so 128 ÷ that figure bounds the weights an SM can cover a cycle;
beside it, the weights its share of HBM delivers a cycle (`--bandwidth`, `--sms`, `--clock`;
defaults: the H200 of 2026-12-04, bench/results/2026-12-04-NVIDIA-H200). A loop whose issue
bound is below its bytes' rate cannot reach the bandwidth whatever its blocks: the H200 runs'
"bound by unpacking the bits". A static measure: it ignores latency, occupancy and caches, and
Triton here may not be the GPU image's (the report names both).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ISSUE_PER_SM_CYCLE = 128  # 4 schedulers × one warp-instruction of 32 threads
CLASSES = {
    "mma": ("HMMA", "HGMMA", "IMMA", "WARPGROUP"),
    "shuffle": ("SHFL",),
    "shared": ("LDS", "STS", "LDSM", "BAR"),
    "global": ("LDG", "STG", "LDGSTS", "LDGDEPBAR"),
    "spill": ("LDL", "STL"),
}


# What a real launch specializes (Triton's JIT): column strides of 1 become constants, pointers and
# sizes that are multiples of 16 carry that divisibility (which lets loads vectorize); a launch on
# 7B/70B shapes has both. The strides of the slot table rows and column-α groups are small numbers.
UNIT_STRIDES = ("stride_xk", "stride_wk", "stride_yn", "stride_an")
SMALL_STRIDES = ("stride_rm", "stride_tp", "stride_cg", "stride_ap", "stride_av", "stride_cv", "stride_cp")


@dataclass(frozen=True)
class Loop:
    instructions: int
    ops: collections.Counter


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_sass(fn, consts: dict, pointers: dict, arch: int, num_warps: int, num_stages: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = consts | {k: 1 for k in UNIT_STRIDES if k in fn.arg_names}  # a launch specializes a 1
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp32" if name == "alpha_ptr" else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations: 16-byte aligned
        else:
            sig[name] = "i32"
            if name in ("N", "K") or (name.startswith("stride_") and name not in SMALL_STRIDES):
                attrs[(i,)] = [["tt.divisibility", 16]]  # a model's sizes and row strides
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    cubin = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump()), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def _opcode(body: str) -> str:
    body = re.sub(r"^@!?U?P\w+\s+", "", body.strip())  # a predicate guard
    return body.split()[0].split(".")[0]


def main_loop(sass: str) -> tuple[Loop, collections.Counter]:
    """The heaviest backward branch's body, and the whole kernel's opcodes."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    whole = collections.Counter(_opcode(b) for _, b in ins)
    best = Loop(0, collections.Counter())
    for addr, body in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", body)
        if m and int(m.group(1), 16) < addr:
            inside = [b for a, b in ins if int(m.group(1), 16) <= a <= addr]
            if len(inside) > best.instructions:
                best = Loop(len(inside), collections.Counter(_opcode(b) for b in inside))
    return best, whole


def cases(cfg: dict, dtype: str):
    """(name, kernel, constexprs, blocks, weights per K-step) of each kernel at cfg's blocks, as a
    launch in `dtype` on a GPU would compile it (`triton_linear.uses_fp32_dot`, `dot_one`)."""
    import torch

    from bitdelta_kernels.triton_bgmv import _bitdelta_bgmv_kernel
    from bitdelta_kernels.triton_linear import _bitdelta_linear_kernel, dot_one, uses_fp32_dot
    from bitdelta_kernels.triton_sgmv import _bitdelta_sgmv_kernel

    t = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    plain = dict(PLANES=1, HAS_COL=False, GROUPS=1)
    dots = dict(DOT_FP32=uses_fp32_dot(t), PRECISION="ieee", COL_PRECISION="tf32x3", ONE=dot_one(t), **plain)
    b = cfg["bgmv"]
    yield (
        "bgmv",
        _bitdelta_bgmv_kernel,
        dict(BLOCK_N=b["BLOCK_N"], BLOCK_K=b["BLOCK_K"], **plain),
        b,
        b["BLOCK_N"] * b["BLOCK_K"],
    )
    s = cfg["sgmv"]
    consts = dict(BLOCK_M=s["BLOCK_M"], BLOCK_N=s["BLOCK_N"], BLOCK_K=s["BLOCK_K"], **dots)
    yield f"sgmv {s['BLOCK_M']} rows", _bitdelta_sgmv_kernel, consts, s, s["BLOCK_N"] * s["BLOCK_K"]
    for bucket in cfg["linear"]:
        bm, bn, bk = bucket["BLOCK_M"], bucket["BLOCK_N"], bucket["BLOCK_K"]
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=bucket["GROUP_M"], SPLIT_K=1, **dots)
        rows = f"M ≤ {bucket['max_m']}" if bucket.get("max_m") else "larger M"
        yield f"linear {rows}", _bitdelta_linear_kernel, consts, bucket, bn * bk


def main(argv=None) -> int:
    import triton

    from bitdelta_kernels.configs import device_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="H200", help="configs.json entry whose blocks to compile")
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: Hopper)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="HBM bytes/s (the 2026-12-04 H200 runs)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock", type=float, default=1.98e9, help="SM clock, Hz")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    cfg = device_config(args.device)
    es = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    bytes_per_sm_cycle = args.bandwidth / (args.sms * args.clock)
    pointers = {k: f"*{args.dtype}" for k in ("x_ptr", "w_ptr", "y_ptr")} | {"s_ptr": "*u8", "col_ptr": "*fp32"}
    lines = [
        f"# bench/kernels_sass.py --device {args.device} --arch {args.arch} --dtype {args.dtype}; triton {triton.__version__}",
        f"# issue bound: {ISSUE_PER_SM_CYCLE} thread-instructions per SM-cycle; bytes: {bytes_per_sm_cycle:.1f} B per SM-cycle"
        f" ({args.bandwidth / 1e12:.2f} TB/s over {args.sms} SMs at {args.clock / 1e9:.2f} GHz)",
        "| kernel | blocks | loop instructions | thread-instr / weight | weights / SM-cycle: issue | bytes | issue ÷ bytes"
        " | shuffle, shared, global, mma per step | spills (kernel) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, fn, consts, blocks, weights in cases(cfg, args.dtype):
        warps, stages = blocks["num_warps"], blocks["num_stages"]
        loop, whole = main_loop(compile_sass(fn, consts, pointers, args.arch, warps, stages))
        per = loop.instructions * 32 * warps / weights
        issue = ISSUE_PER_SM_CYCLE / per
        # bytes a weight costs: a sign bit (1/8 B), plus its base weight in the fused linear
        wbytes = 1 / 8 + (es if name.startswith("linear") else 0)
        rate = bytes_per_sm_cycle / wbytes
        cls = {c: sum(loop.ops[o] for o in ops) for c, ops in CLASSES.items()}
        tile = "x".join(str(consts[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in consts)
        lines.append(
            f"| {name} | {tile}, {warps} warps, {stages} stages | {loop.instructions} | {per:.2f} | {issue:.1f} | {rate:.1f}"
            f" | {issue / rate:.2f} | {cls['shuffle']}, {cls['shared']}, {cls['global']}, {cls['mma']}"
            f" | {sum(whole[o] for o in CLASSES['spill'])} |"
        )
        print(lines[-1], flush=True)  # a row as its kernel compiles
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
