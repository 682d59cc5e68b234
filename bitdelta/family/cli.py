"""`bitdelta family {build,status,paths}` and `bitdelta quality` (registered by bitdelta.cli)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bitdelta.cli_error import CliError


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def cmd_build(a: argparse.Namespace) -> None:
    from dataclasses import replace

    from bitdelta.family.build import build
    from bitdelta.family.finetune import FinetuneConfig

    cfg = FinetuneConfig()
    if a.steps is not None:
        if a.quick:
            raise CliError("--quick sets the steps itself; give --quick or --steps, not both")
        cfg = replace(cfg, steps=a.steps)
    _check_variants(a.variants)
    build(a.variants, cfg, force=a.force, root=a.data, deltas=not a.no_deltas, quick=a.quick, threads=a.threads)


def _check_variants(variants):
    from bitdelta.family import MEMBERS

    bad = sorted(set(variants or ()) - set(MEMBERS))
    if bad:
        raise CliError(f"unknown variant(s) {', '.join(bad)}; the family is {', '.join(MEMBERS)}")


def cmd_status(a: argparse.Namespace) -> None:
    from bitdelta.family.build import status

    st = status(a.data)
    for name, s in st.items():
        print(f"{s:10s} {name}")
    if any(s != "ok" for s in st.values()):
        raise CliError("the family is not completely built: run `bitdelta family build`", code=3)


def cmd_paths(a: argparse.Namespace) -> None:
    from bitdelta.family import paths

    p = paths(a.data)
    print(
        json.dumps(
            {
                "root": str(p.root),
                "base": str(p.base),
                "variants": {
                    v: {
                        "corpus": p.corpus[v],
                        "finetuned": str(p.finetuned[v]),
                        "delta": str(p.deltas[v]),
                        "train": str(p.train[v]),
                        "heldout": str(p.heldout[v]),
                    }
                    for v in p.variants
                },
            },
            indent=2,
        )
    )


def cmd_quality(a: argparse.Namespace) -> None:
    from bitdelta.family.modes import MODES
    from bitdelta.family.quality import QualityConfig
    from bitdelta.reports import run_reports

    _check_variants(a.variants)
    bad = sorted(set(a.modes or ()) - set(MODES))
    if bad:
        raise CliError(f"unknown mode(s) {', '.join(bad)}; the modes are {', '.join(MODES)}")
    cfg = QualityConfig(
        eval_windows=a.windows, math_problems=a.math_problems, humaneval=a.humaneval, distill_steps=a.distill_steps
    )
    if a.modes:
        from dataclasses import replace

        cfg = replace(cfg, modes=tuple(a.modes))
    run_reports(a.report_dir, variants=a.variants, cfg=cfg, root=a.data, skip_build=a.skip_build, threads=a.threads)


def register(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("family", help="the real model family (SmolLM2-135M base, its fine-tunes, their deltas)")
    fs = f.add_subparsers(dest="family_command", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data", type=Path, default=None, help="data directory (default: $BITDELTA_DATA or ./data)")
    torch_jobs = argparse.ArgumentParser(add_help=False)
    torch_jobs.add_argument(
        "--threads",
        type=_positive_int,
        default=os.environ.get("BITDELTA_THREADS") or None,  # argparse parses a text default like the flag
        help="cap torch's CPU threads (default: $BITDELTA_THREADS, else torch's choice; 1 on a shared machine)",
    )

    c = fs.add_parser(
        "build",
        parents=[common, torch_jobs],
        help="convert the base, fine-tune the variants, compress them (skips what is built and verified)",
    )
    c.add_argument("--variants", nargs="+", help="only these (default: all)")
    c.add_argument("--steps", type=int, help="fine-tuning steps per variant (default: the recipe's)")
    c.add_argument(
        "--quick",
        action="store_true",
        help="the first run's smaller family (fewer fine-tuning steps; what is already "
        "built with the full recipe is kept); without it, the full family that reports/ describe",
    )
    c.add_argument("--force", action="store_true", help="rebuild even what is up to date")
    c.add_argument("--no-deltas", action="store_true", help="stop after the fine-tunes")
    c.set_defaults(func=cmd_build)

    c = fs.add_parser("status", parents=[common], help="which artifacts exist and match their checksums")
    c.set_defaults(func=cmd_status)

    c = fs.add_parser("paths", parents=[common], help="print the family's paths as JSON")
    c.set_defaults(func=cmd_paths)

    q = sub.add_parser(
        "quality",
        parents=[common, torch_jobs],
        help="build the family if needed, then write the quality and memory reports",
    )
    q.add_argument("--report-dir", type=Path, default=Path("reports"), help="where the reports go (default: reports/)")
    q.add_argument("--variants", nargs="+", help="only these (default: all)")
    q.add_argument("--windows", type=int, default=16, help="held-out windows of 128 tokens per variant (default 16)")
    q.add_argument("--math-problems", type=int, default=40, help="held-out math problems for exact match")
    q.add_argument("--humaneval", type=int, default=20, help="HumanEval problems for the coder (0: skip; 164: all)")
    q.add_argument(
        "--distill-steps",
        type=int,
        default=None,
        help="distillation steps for every distilled mode (default: each mode's own: the build's 30, the -kl modes 100)",
    )
    q.add_argument("--modes", nargs="+", help="only these compression modes (default: all of bitdelta.family.modes)")
    q.add_argument("--skip-build", action="store_true", help="fail instead of building what is missing")
    q.set_defaults(func=cmd_quality)
