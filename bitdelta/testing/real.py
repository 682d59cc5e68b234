"""The real model family for tests and the deploy check (scripts/deploy_check.py): the
converted SmolLM2-135M base's deltas, the family's own when built, otherwise two short real
fine-tunes (a few optimizer steps each), compressed like the serving default.

Tests whose point is the real model use the converted base (converted into the data directory
on first use, ~30 s, as `bitdelta family build` would) and these deltas; nothing is skipped when
data/ is empty. What is built from the real model is cached under <data>/test-cache/, keyed by
everything it is made from, so a second run (or a concurrent one) reuses it.
"""

from __future__ import annotations

import os
from pathlib import Path

TEST_CACHE_VERSION = 1


def cached_real_artifact(name: str, key: dict, build) -> Path:
    """<data>/test-cache/<name>-<hash of key>/, filled by `build(dir)` once. Built in a
    private temporary directory and renamed into place, so concurrent sessions never see
    a half-built entry (the loser of a race discards its copy)."""
    import hashlib
    import json
    import shutil
    import tempfile

    from bitdelta import family

    key = {"cache_version": TEST_CACHE_VERSION, **key}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    final = family.data_dir() / "test-cache" / f"{name}-{digest}"
    if (final / "done.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / "done.json").write_text(json.dumps(key, indent=2, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another session renamed its copy first
            if not (final / "done.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def short_real_finetunes(real_base: Path, corpora_of: dict[str, str], cfg, delta: bool) -> Path:
    """Cached short real fine-tunes of the base, one per variant -> corpus in `corpora_of` (and
    their deltas when `delta`: one plane of sign(Δ) with the embeddings as signs too, the serving
    deltas' format and bytes without their error-feedback signs, which would cost the suite ~1 min a
    variant): the entry's directory, holding finetuned/<variant>/
    and deltas/<variant>.bitdelta.safetensors (all deltas in one directory, as a worker reads them)."""
    from dataclasses import asdict

    from bitdelta import precision
    from bitdelta.checkpoint import fingerprint
    from bitdelta.family import corpora

    def build(root: Path) -> None:
        from bitdelta.compress import compress
        from bitdelta.family.finetune import finetune

        for variant, corpus in corpora_of.items():
            ft = root / "finetuned" / variant
            finetune(real_base, corpus, ft, cfg, progress=False)
            if delta:
                compress(
                    real_base,
                    ft,
                    root / "deltas" / f"{variant}.bitdelta.safetensors",
                    variant=variant,
                    embeddings="sign",
                    progress=False,
                )

    key = {
        "base": fingerprint(real_base),
        "corpora": corpora_of,
        "corpus_sha256": {c: corpora.describe(c)["sha256"] for c in sorted(set(corpora_of.values()))},
        "config": asdict(cfg),
        "delta": delta,
        "precision": precision.cpu_precision().name,
    }
    return cached_real_artifact("short-" + "-".join(corpora_of), key, build)


def real_deltas_of(real_base: Path) -> dict:
    """The family's deltas for `real_base` when at least two are built, else two short real
    fine-tunes' (cached); also the deploy check's family when data/ holds none."""
    from bitdelta import family
    from bitdelta.checkpoint import fingerprint
    from bitdelta.format import read_header

    p = family.paths()
    fp = fingerprint(real_base)
    built = {
        v: p.deltas[v]
        for v in p.variants
        if p.deltas[v].is_file() and read_header(p.deltas[v]).meta.base_fingerprint == fp
    }
    if len(built) >= 2:
        return built
    from bitdelta.family.finetune import FinetuneConfig

    cfg = FinetuneConfig(steps=3, batch=1, seq_len=64, warmup=0, lr=3e-4, eval_windows=1)
    root = short_real_finetunes(real_base, {"math": "arithmetic", "coder": "stdlib"}, cfg, delta=True)
    return {v: root / "deltas" / f"{v}.bitdelta.safetensors" for v in ("math", "coder")}
