"""`bitdelta merge {monosoup,svd-soup,opcm,train-lora,adapters,report}` and `bitdelta kmerge`.

Registered by `bitdelta.cli` through `register(subparsers)`; heavy imports
happen inside the commands.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bitdelta.cli_error import CliError
from bitdelta.units import parse_bytes


def _need_dir(path: Path, what: str) -> None:
    if not (path / "config.json").is_file():
        raise CliError(f"{what} {path} is not a checkpoint directory (no config.json)")


def cmd_monosoup(a: argparse.Namespace) -> None:
    from bitdelta.merge.monosoup import monosoup_checkpoint

    _need_dir(a.base, "--base")
    _need_dir(a.finetuned, "--finetuned")
    out, record = monosoup_checkpoint(a.base, a.finetuned, a.out, rule=a.rule, energy=a.energy)
    done = [r for r in record.values() if not r["skipped"]]
    kept = len(record) - len(done)
    if done:
        ks = sorted(r["k"] for r in done)
        lam = sum(r["lambda_high"] for r in done) / len(done)
        print(
            f"{len(done)} matrices re-weighted (rank rule {a.rule}): k median {ks[len(ks) // 2]} "
            f"(min {ks[0]}, max {ks[-1]}), mean λ_high {lam:.3f}; {kept} parameters kept the fine-tuned values"
        )
    print(f"wrote {out}")


def cmd_svd_soup(a: argparse.Namespace) -> None:
    from bitdelta.merge.svdsoup import svd_soup_checkpoints

    _need_dir(a.base, "--base")
    for c in a.checkpoints:
        _need_dir(c, "--checkpoints")
    if a.rank < 1:
        raise CliError("--rank must be ≥ 1")
    print(f"wrote {svd_soup_checkpoints(a.base, a.checkpoints, a.rank, a.out)}")


def cmd_opcm(a: argparse.Namespace) -> None:
    from bitdelta.merge.opcm import opcm_checkpoints

    _need_dir(a.base, "--base")
    for c in a.checkpoints:
        _need_dir(c, "--checkpoints")
    print(f"wrote {opcm_checkpoints(a.base, a.checkpoints, a.out, alpha=a.alpha)}")


def _lora_cfg(a: argparse.Namespace):
    from bitdelta.merge.lora import LoraConfig

    given = {
        "rank": a.rank,
        "alpha": a.lora_alpha,
        "targets": tuple(a.targets) if a.targets else None,
        "steps": a.steps,
        "lr": a.lr,
        "batch": a.batch,
        "seq_len": a.seq_len,
        "seed": a.seed,
    }
    return LoraConfig(**{k: v for k, v in given.items() if v is not None})


def cmd_train_lora(a: argparse.Namespace) -> None:
    from bitdelta.evaluate import tokenize
    from bitdelta.merge import lora
    from bitdelta.merge.adapter import save_adapter
    from bitdelta.model import load_model

    _need_dir(a.base, "--base")
    text = "\n\n".join(Path(f).read_text(errors="replace") for f in a.text)
    model = load_model(a.base)
    adapter, record = lora.train(model, tokenize(a.base, text), _lora_cfg(a), desc=a.out.name)
    extra = {"training.json": json.dumps(record, indent=2)}
    if a.heldout:
        extra["heldout.txt"] = Path(a.heldout).read_text(errors="replace")
    save_adapter(adapter, a.out, base_model=str(a.base), extra_files=extra)
    print(f"loss {record['loss_first']:.3f} -> {record['loss_last_5']:.3f} in {record['seconds']} s; wrote {a.out}")


def cmd_adapters(a: argparse.Namespace) -> None:
    from bitdelta.merge import report

    report.train_adapters(_lora_cfg(a), tasks=a.tasks, out=a.out, force=a.force)


def cmd_report(a: argparse.Namespace) -> None:
    from bitdelta.merge import report

    report.run(out=a.out, parts=a.parts, n_windows=a.windows, seq_len=a.seq_len)


def cmd_kmerge(a: argparse.Namespace) -> None:
    from bitdelta.merge.adapter import load_adapter
    from bitdelta.merge.kmerge import AdapterPool, mean_score, scores, stream

    _need_dir(a.base, "--base")
    if a.k is None and a.budget is None:
        a.k = 5
    own = {}
    for d in a.adapters:
        try:
            ad = load_adapter(d)
        except (FileNotFoundError, ValueError) as e:
            raise CliError(str(e)) from None
        if ad.name in own:
            raise CliError(f"two adapters are named {ad.name!r}: task names come from directory names")
        own[ad.name] = ad
    heldout = {t: Path(d) / "heldout.txt" for t, d in zip(own, a.adapters)}
    for spec in a.heldout or []:
        task, _, path = spec.partition("=")
        if task not in own or not path:
            raise CliError(f"--heldout {spec!r}: expected TASK=FILE with TASK one of {sorted(own)}")
        heldout[task] = Path(path)
    missing = [t for t, p in heldout.items() if not p.is_file()]
    if missing:
        raise CliError(
            f"no held-out text for {missing}: put heldout.txt in the adapter directory or pass --heldout TASK=FILE"
        )
    from bitdelta.merge.evaluate import adapter_evaluator

    texts = {t: p.read_text(errors="replace") for t, p in heldout.items()}
    evaluate, _ = adapter_evaluator(a.base, texts, a.windows, a.seq_len)
    pool = AdapterPool(
        k=a.k,
        budget_bytes=a.budget,
        threshold=a.threshold,
        merge=a.merge,
        merge_rank=a.merge_rank,
        gate=a.gate,
        evaluate=evaluate if a.gate is not None else None,
    )
    decisions = stream(pool, list(own.items()))
    per_task = scores(pool, own, evaluate)
    if a.json:
        print(
            json.dumps(
                {
                    "decisions": [d.__dict__ for d in decisions],
                    "scores": per_task,
                    "mean_score": mean_score(per_task),
                    "slots": len(pool.slots),
                    "bytes": pool.nbytes,
                },
                indent=2,
            )
        )
        return
    limit = " and ".join(x for x in (f"K={a.k}" if a.k else "", f"B={a.budget} bytes" if a.budget else "") if x)
    print(f"pool: {limit}, merge={a.merge}, threshold={a.threshold}, gate={a.gate}")
    for d in decisions:
        print(f"  {d.task:<18} {d.action:<6} slot {'-' if d.slot is None else d.slot}  ({d.reason})")
    print(f"{len(pool.slots)} slots, {pool.nbytes:,} bytes")
    print(f"{'task':<18} {'slot':>4} {'own acc':>8} {'pool acc':>8} {'base acc':>8} {'score':>6} {'base':>6}")
    for t, s in per_task.items():
        print(
            f"{t:<18} {'-' if s['slot'] is None else s['slot']:>4} {s['own']:>8.4f} {s['pool']:>8.4f} "
            f"{s['base']:>8.4f} {s['score']:>6.3f} {s['base_score']:>6.3f}"
        )
    print(f"mean score (pool acc / own acc): {mean_score(per_task):.3f}")


def _lora_args(c: argparse.ArgumentParser) -> None:
    # Defaults are LoraConfig's (bitdelta.merge.lora), filled in by _lora_cfg so
    # that building the parser does not import torch.
    c.add_argument("--rank", type=int, help="LoRA rank (default 8)")
    c.add_argument("--lora-alpha", type=float, help="LoRA alpha; scale = alpha / rank (default 16)")
    c.add_argument("--targets", nargs="+", help="projection names to adapt (default q_proj v_proj)")
    c.add_argument("--steps", type=int, help="optimiser steps (default 24)")
    c.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-3)")
    c.add_argument("--batch", type=int, help="sequences per step (default 4)")
    c.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    c.add_argument("--seed", type=int, help="seed of A's initialisation, shared by all tasks (default 0)")


def register(sub) -> None:
    m = sub.add_parser("merge", help="merge task vectors: MonoSoup, the brief's SVD soup, OPCM; LoRA training; report")
    msub = m.add_subparsers(dest="merge_command", required=True, metavar="METHOD")

    c = msub.add_parser("monosoup", help="MonoSoup of ONE fine-tune (arXiv:2602.09689): spectral re-weighting of Δ")
    c.add_argument("--base", required=True, type=Path)
    c.add_argument("--finetuned", required=True, type=Path)
    c.add_argument("--out", required=True, type=Path)
    c.add_argument(
        "--rule",
        choices=["entropy", "energy"],
        default="entropy",
        help="rank k: ⌈exp(entropy of σ/Σσ)⌉ (the paper's default) or the energy threshold",
    )
    c.add_argument("--energy", type=float, default=0.8, help="energy fraction for --rule energy")
    c.set_defaults(func=cmd_monosoup)

    c = msub.add_parser(
        "svd-soup", help="the brief's soup: mean of rank-r truncated task vectors of several checkpoints"
    )
    c.add_argument("--base", required=True, type=Path)
    c.add_argument("--checkpoints", required=True, nargs="+", type=Path)
    c.add_argument("--rank", required=True, type=int)
    c.add_argument("--out", required=True, type=Path)
    c.set_defaults(func=cmd_svd_soup)

    c = msub.add_parser("opcm", help="OPCM (arXiv:2501.09522): sequential orthogonal-projection merge, in order")
    c.add_argument("--base", required=True, type=Path)
    c.add_argument("--checkpoints", required=True, nargs="+", type=Path)
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--alpha", type=float, default=0.5, help="share of the merged spectrum protected")
    c.set_defaults(func=cmd_opcm)

    c = msub.add_parser("train-lora", help="train one LoRA adapter on text (PEFT layout output)")
    c.add_argument("--base", required=True, type=Path)
    c.add_argument("--text", required=True, nargs="+", type=Path, help="training text file(s)")
    c.add_argument("--heldout", type=Path, help="held-out text, copied into the adapter dir as heldout.txt")
    c.add_argument("--out", required=True, type=Path, help="adapter directory (its name is the task name)")
    _lora_args(c)
    c.set_defaults(func=cmd_train_lora)

    c = msub.add_parser("adapters", help="train the project's LoRA task set on the model family (data/adapters/)")
    c.add_argument("--tasks", nargs="+", help="a subset of the task names (default: all)")
    c.add_argument("--out", type=Path, help="directory for the adapters (default: <data>/adapters)")
    c.add_argument("--force", action="store_true", help="retrain adapters that exist")
    _lora_args(c)
    c.set_defaults(func=cmd_adapters)

    c = msub.add_parser("report", help="evaluate MonoSoup and K-Merge on the real family; write reports/merging")
    c.add_argument("--out", type=Path, default=Path("reports/merging"))
    c.add_argument(
        "--parts",
        nargs="*",
        choices=["monosoup", "kmerge"],
        default=["monosoup", "kmerge"],
        help="what to (re)compute; --parts with none only redraws plots and README from results.json",
    )
    c.add_argument("--windows", type=int, default=16, help="held-out windows per split")
    c.add_argument("--seq-len", type=int, default=128)
    c.set_defaults(func=cmd_report)

    c = sub.add_parser("kmerge", help="run LoRA adapters through a K-Merge pool; print merged ÷ own score per task")
    c.add_argument("--base", required=True, type=Path)
    c.add_argument(
        "--adapters",
        required=True,
        nargs="+",
        type=Path,
        help="PEFT adapter directories, in arrival order (directory name = task)",
    )
    c.add_argument("--k", type=int, help="at most K slots (default 5 when no --budget)")
    c.add_argument("--budget", type=parse_bytes, help="byte budget for the stored factors, e.g. 2MiB")
    c.add_argument(
        "--threshold", type=float, help="K-Merge++: open a free slot only below this similarity (paper: 0.02-0.03)"
    )
    c.add_argument("--merge", choices=["mean", "opcm"], default="mean")
    c.add_argument("--merge-rank", type=int, help="rank of merged adapters (default: the slot's rank)")
    c.add_argument("--gate", type=float, help="keep a merge only if every task keeps ≥ GATE × its own accuracy")
    c.add_argument("--heldout", nargs="+", metavar="TASK=FILE", help="evaluation text (default: <adapter>/heldout.txt)")
    c.add_argument("--windows", type=int, default=8)
    c.add_argument("--seq-len", type=int, default=128)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_kmerge)
