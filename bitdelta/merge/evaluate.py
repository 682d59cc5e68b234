"""Held-out scoring of LoRA adapters for merging, on the project's one evaluator
(`bitdelta.evaluate`: the same windows and Score as the quality report)."""

from __future__ import annotations

import os

from bitdelta.evaluate import Score, score, tokenize, windows


def adapter_evaluator(base: str | os.PathLike, heldout: dict[str, str], n_windows: int, seq_len: int):
    """(acc, full): `acc(adapter | None, task)` is the next-token accuracy of the base with
    `adapter` applied on the task's held-out text; `full` returns its whole `Score`.
    Results are cached per (adapter object, task); the adapters are kept alive so their ids
    stay valid keys."""
    from bitdelta.merge.lora import applied
    from bitdelta.model import load_model

    model = load_model(base)
    wins = {t: windows(tokenize(base, text), n_windows, seq_len) for t, text in heldout.items()}
    cache: dict[tuple[int, str], Score] = {}
    keep = []

    def full(adapter, task) -> Score:
        key = (id(adapter), task)
        if key not in cache:
            keep.append(adapter)
            with applied(model, adapter):
                cache[key] = score(model, wins[task], batch=8)[0]
        return cache[key]

    return (lambda adapter, task: full(adapter, task).acc), full
