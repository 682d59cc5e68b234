"""Held-out scoring for merges: perplexity and next-token accuracy on fixed windows.

Windows are spread evenly over the token stream (not random), so every model
is scored on the same tokens and a rerun gives the same numbers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bitdelta.model import Llama


def tokenize(tokenizer_dir: str | os.PathLike, text: str) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def windows(tokens: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """n windows [n, seq_len + 1] at evenly spaced starts (the +1 is the last target)."""
    span = seq_len + 1
    if tokens.numel() < span:
        raise ValueError(f"{tokens.numel()} tokens is too little text for a window of {span}")
    last = tokens.numel() - span
    n = min(n, last // span + 1) if last >= 0 else 1  # no overlap when the text is short
    starts = torch.linspace(0, last, n).long().tolist()
    return torch.stack([tokens[s : s + span] for s in starts])


@torch.no_grad()
def score(model: Llama, wins: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Mean next-token NLL, perplexity and top-1 accuracy over all predicted tokens."""
    nll, correct, count = 0.0, 0, 0
    for i in range(0, len(wins), batch):
        x = wins[i : i + batch]  # [b, seq_len + 1]
        logits = model(x[:, :-1])  # [b, seq_len, vocab]
        target = x[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    mean = nll / count
    return {"nll": mean, "ppl": math.exp(mean), "acc": correct / count, "tokens": count}


def adapter_evaluator(base: str | os.PathLike, heldout: dict[str, str], n_windows: int, seq_len: int):
    """(acc, full): `acc(adapter | None, task)` is the next-token accuracy of the base with
    `adapter` applied on the task's held-out text; `full` returns every metric of `score`.
    Results are cached per (adapter object, task); the adapters are kept alive so their ids
    stay valid keys."""
    from bitdelta.merge.lora import applied
    from bitdelta.model import load_model

    model = load_model(base)
    wins = {t: windows(tokenize(base, text), seq_len, n_windows) for t, text in heldout.items()}
    cache: dict[tuple[int, str], dict] = {}
    keep = []

    def full(adapter, task):
        key = (id(adapter), task)
        if key not in cache:
            keep.append(adapter)
            with applied(model, adapter):
                cache[key] = score(model, wins[task])
        return cache[key]

    return (lambda adapter, task: full(adapter, task)["acc"]), full
