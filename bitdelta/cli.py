"""`bitdelta`: the offline toolkit (compress, apply, inspect, verify, ...).

Each subcommand is a small function taking parsed arguments; heavy modules are
imported inside them so `bitdelta --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bitdelta import inspect_report
from bitdelta.cli_error import CliError


def cmd_compress(a: argparse.Namespace) -> None:
    from bitdelta import distill as d
    from bitdelta.compress import bf16_bytes, check_budget, compress
    from bitdelta.planes import PlaneConfig
    from bitdelta.units import parse_bytes

    budget = None
    if a.budget:
        try:
            num, _, den = a.budget.partition("/")
            budget = int(bf16_bytes(a.base) * int(num) / int(den)) if den else parse_bytes(a.budget)
        except ValueError:
            raise CliError(
                f"--budget must be a size (16MiB, 17000000) or a fraction of the base's bf16 bytes (1/16), not {a.budget!r}"
            ) from None
    embeddings_alpha = a.alpha if a.alpha in ("row", "matrix") else "row"
    try:
        planes = PlaneConfig(
            alpha=a.alpha,
            planes=a.planes,
            rank=a.rank,
            rank_step=a.rank_step,
            budget=budget,
            drop=a.drop,
            feedback=a.feedback,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        cfg = d.DistillConfig(steps=a.steps, lr=a.lr, batch=a.batch, seq_len=a.seq_len, seed=a.seed, loss=a.loss)
    except ValueError as e:
        raise CliError(str(e)) from None
    tokens = d.tokenize_files(a.base, a.calib) if a.calib else None
    # Hold out the stream's last tenth to report the logit MSE on unseen text.
    cut = int(len(tokens) * 0.9) if tokens is not None else 0
    try:
        out = compress(
            a.base,
            a.finetuned,
            a.out,
            alpha_mode=embeddings_alpha,
            variant=a.variant,
            embeddings=a.embeddings,
            planes=planes,
            calibration=None if tokens is None else tokens[:cut],
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if a.distill:
        if not a.calib:
            raise CliError("--distill needs calibration text: --calib FILE [FILE ...]")
        from bitdelta.format import load_delta

        heldout = d.token_windows(tokens[cut:], cfg.seq_len, 4, seed=1) if len(tokens) - cut > cfg.seq_len else None
        delta, record = d.distill(a.base, a.finetuned, load_delta(out), tokens[:cut], cfg, heldout)
        d.save(delta, out)
        try:
            check_budget(out, budget)
        except ValueError as e:
            raise CliError(str(e)) from None
        if heldout is not None:
            what = {"mse": "logit MSE", "kl": "KL(fine-tune ‖ ·) per token"}[cfg.loss]
            before, after = record[f"heldout_{cfg.loss}_before"], record[f"heldout_{cfg.loss}_after"]
            print(f"held-out {what}: {before:.4e} -> {after:.4e}")
    print(f"wrote {out}")
    print(inspect_report.text(out), end="")


def cmd_import_lora(a: argparse.Namespace) -> None:
    from bitdelta.lora_import import import_lora

    try:
        out = import_lora(a.base, a.adapter, a.out, variant=a.variant)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    print(f"wrote {out}")
    print(inspect_report.text(out), end="")


def cmd_apply(a: argparse.Namespace) -> None:
    from bitdelta.compress import apply

    print(f"wrote {apply(a.base, a.delta, a.out)}")


def cmd_inspect(a: argparse.Namespace) -> None:
    for f in a.files:
        if a.json:
            print(json.dumps(inspect_report.info(Path(f)), indent=2))
        else:
            print(inspect_report.text(Path(f)), end="")


def cmd_verify(a: argparse.Namespace) -> None:
    from bitdelta.arch import ModelArgs
    from bitdelta.checkpoint import fingerprint, read_config
    from bitdelta.format import check_arch, verify

    fp = fingerprint(a.base) if a.base else None
    args = ModelArgs.from_hf(read_config(a.base)) if a.base else None
    failed = False
    for f in a.files:
        try:
            h = verify(f, fp)
            if args is not None:
                check_arch(h.meta.variant, h.meta.architecture, h.meta.layout, args)
        except (ValueError, OSError) as e:  # DeltaFormatError, BaseMismatchError/ArchMismatchError, missing file
            print(f"FAIL {f}: {e}", file=sys.stderr)
            failed = True
            continue
        extra = " and matches the base" if fp else ""
        print(f"OK   {f}: {len(h.tensors)} tensors verified{extra}")
    if failed:
        raise CliError("verification failed", code=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitdelta", description=__doc__.splitlines()[0])
    p.add_argument(
        "--cpu-precision",
        metavar="auto|fp32|bf16",
        help="precision of torch on the CPU for training and evaluation (bitdelta.precision; "
        "default: $BITDELTA_CPU_PRECISION, else auto: bf16 only where the CPU has native bf16)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("compress", help="fine-tuned checkpoint -> BitDelta file")
    c.add_argument("--base", required=True, type=Path, help="base checkpoint directory (HF layout)")
    c.add_argument("--finetuned", required=True, type=Path, help="fine-tuned checkpoint directory")
    c.add_argument("--out", required=True, type=Path, help="delta file to write (.bitdelta.safetensors)")
    c.add_argument(
        "--alpha",
        choices=["row", "matrix", "col", "auto"],
        default="row",
        help="one scale per output row, per matrix, per input column, or per plane the one of least error "
        "(col and auto: projections only; the embeddings take row)",
    )
    c.add_argument("--planes", type=int, default=1, help="at most this many residual sign planes per matrix")
    c.add_argument("--rank", type=int, default=0, help="at most this rank of fp16 low-rank residual per matrix")
    c.add_argument("--rank-step", type=int, default=8, help="the budget buys rank in steps of this many")
    c.add_argument(
        "--budget",
        help="bytes for the whole delta file (16MiB, 17000000) or a fraction of the base's bf16 bytes "
        "(1/16), spent greedily on the planes and rank that lower the output error most per byte "
        "(default: every matrix gets --planes and --rank); --calib weighs the error by the layers' inputs",
    )
    c.add_argument(
        "--drop",
        action="store_true",
        help="spend --budget by the KL(fine-tune ‖ ·) per byte measured on --calib per kind of weight (its "
        "plane 1, its plane 2 or first rank chunk): may leave whole kinds out (all layers' q_proj, say), as it "
        "must when --budget is below one sign plane per weight",
    )
    c.add_argument(
        "--feedback",
        action="store_true",
        help="choose the signs by error feedback under --calib's input second moments (GPTQ's update on the "
        "delta; a compressed tied embedding/LM head's under its head's inputs and its own rows) and fit the row "
        "α's to the output error: the same bytes and file (with --alpha row); at 1/16 on the hard family member "
        "the undistilled held-out KL 0.0677 -> 0.0326 (the projections' alone)",
    )
    c.add_argument(
        "--embeddings",
        choices=["dense", "sign"],
        default="dense",
        help="store changed embeddings / LM head whole (dense) or as signs + α too",
    )
    c.add_argument("--variant", help="variant name (default: the fine-tune's directory name)")
    c.add_argument("--distill", action="store_true", help="tune the α's on calibration text (scale distillation)")
    c.add_argument(
        "--calib", nargs="+", type=Path, help="calibration text files for --distill, --budget and --feedback"
    )
    c.add_argument("--steps", type=int, default=150)
    c.add_argument("--lr", type=float, default=1e-5)
    c.add_argument("--batch", type=int, default=4)
    c.add_argument("--seq-len", type=int, default=128)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--loss",
        default="mse",
        help="the distillation's loss (bitdelta.distill.LOSSES): mse on logits (the paper's) or kl, KL(fine-tune ‖ ·) of the next-token "
        "distributions (on the hard family member at 1/16, 30 steps: held-out KL 0.025 with kl at --lr 3e-4, "
        "0.065 with mse at 1e-5)",
    )
    c.set_defaults(func=cmd_compress)

    c = sub.add_parser(
        "import-lora",
        help="PEFT LoRA adapter -> delta file served exactly (factors in fp16; saved modules, biases dense)",
    )
    c.add_argument("--base", required=True, type=Path, help="the base checkpoint the adapter was trained on")
    c.add_argument("--adapter", required=True, type=Path, help="PEFT adapter directory (adapter_config.json, ...)")
    c.add_argument("--out", required=True, type=Path, help="delta file to write (.bitdelta.safetensors)")
    c.add_argument("--variant", help="variant name (default: the adapter's directory name)")
    c.set_defaults(func=cmd_import_lora)

    c = sub.add_parser("apply", help="base + delta -> dense fine-tuned checkpoint")
    c.add_argument("--base", required=True, type=Path)
    c.add_argument("--delta", required=True, type=Path)
    c.add_argument("--out", required=True, type=Path)
    c.set_defaults(func=cmd_apply)

    c = sub.add_parser("inspect", help="print a delta's metadata, sizes and compression ratio")
    c.add_argument("files", nargs="+", type=Path)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_inspect)

    c = sub.add_parser("verify", help="check every hash (and the base fingerprint with --base)")
    c.add_argument("files", nargs="+", type=Path)
    c.add_argument("--base", type=Path, help="base checkpoint the deltas must match")
    c.set_defaults(func=cmd_verify)

    for register in _extensions():
        register(sub)
    return p


def _extensions():
    """The `register` of each module contributing subcommands (family, quality, plan, merge, ...)."""
    from bitdelta import client_cli, plan, traces
    from bitdelta.family import cli as family_cli
    from bitdelta.merge import cli as merge_cli

    return (family_cli.register, plan.register, merge_cli.register, client_cli.register, traces.register)


def main(argv: list[str] | None = None) -> int:
    from bitdelta import precision

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        precision.configure(
            precision.choice_from_env()
            if args.cpu_precision is None
            else precision.check_choice(args.cpu_precision, "--cpu-precision")
        )
    except ValueError as e:
        parser.error(str(e))
    try:
        args.func(args)
    except CliError as e:
        print(f"bitdelta: {e}", file=sys.stderr)
        return e.code
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"bitdelta {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
