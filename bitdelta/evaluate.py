"""The one evaluator of the project: held-out windows, a typed score, task accuracy. The quality
report (`bitdelta.family.quality`), the merging report and `bitdelta merge` (`bitdelta.merge`)
all score models with it, so their numbers compare.

- `windows`: n windows of seq_len + 1 tokens at evenly spaced starts of a token stream (fixed,
  not random: every model sees the same tokens and a rerun gives the same numbers), never
  overlapping (fewer windows when the text is short);
- `score` -> `Score`: per-token NLL, perplexity (token-weighted over all windows), top-1
  next-token accuracy and, given a reference's log-probabilities, KL(reference ‖ model);
- `exact_match`: greedy answers of arithmetic problems against their exact answers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bitdelta.model import Llama


def tokenizer(tokenizer_dir: str | os.PathLike):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def tokenize(tokenizer_dir: str | os.PathLike, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(tokenizer_dir).encode(text).ids, dtype=torch.long)


def windows(tokens: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """n windows [n, seq_len + 1] spread evenly over a 1-D stream (deterministic; the +1 is the
    last target); fewer when n would overlap."""
    span = seq_len + 1
    if tokens.numel() < span:
        raise ValueError(f"the text has {tokens.numel()} tokens; need at least {span}")
    last = tokens.numel() - span
    n = min(n, last // span + 1)
    starts = torch.linspace(0, last, n).long().tolist()
    return torch.stack([tokens[s : s + span] for s in starts])


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood: logits [B, T, V], targets [B, T] -> [B, T] (fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(
        targets.shape
    )


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp of the mean negative log-likelihood per token (token-weighted over all windows)."""
    return math.exp(nll_sum / n_tokens)


def kl_per_token(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) for log-probabilities [..., V] -> [...]."""
    return (logp_p.exp() * (logp_p - logp_q)).sum(-1)


def gain_kept(ppl_base: float, ppl_ft: float, ppl_mode: float) -> float:
    """(ppl_base − ppl_mode) / (ppl_base − ppl_ft); NaN when the fine-tune gained nothing."""
    gain = ppl_base - ppl_ft
    return (ppl_base - ppl_mode) / gain if gain > 0 else float("nan")


@dataclass
class Score:
    """A model on a set of windows."""

    ppl: float
    nll: float  # mean per token
    acc: float  # top-1 next-token accuracy
    tokens: int
    kl_from_ref: float | None = None  # mean KL(reference ‖ model) per token, when a reference was given

    def as_dict(self) -> dict:
        """For the reports' JSON (no None fields)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@torch.no_grad()
def score(
    model: Llama, wins: torch.Tensor, batch: int = 4, ref_logp: list[torch.Tensor] | None = None
) -> tuple[Score, list[torch.Tensor]]:
    """`model` on windows [n, T+1]: its Score (with `ref_logp`, the reference's log-probs per
    batch, also the KL from it) and its own log-probs per batch (a reference for others)."""
    nll, n, kl, correct = 0.0, 0, 0.0, 0
    logps = []
    for i, start in enumerate(range(0, len(wins), batch)):
        x = wins[start : start + batch]
        logits = model(x[:, :-1])
        target = x[:, 1:]
        nll += token_nll(logits, target).sum().item()
        correct += int((logits.argmax(-1) == target).sum())
        n += target.numel()
        logp = F.log_softmax(logits.float(), dim=-1)
        if ref_logp is not None:
            kl += kl_per_token(ref_logp[i], logp).sum().item()
        logps.append(logp)
    s = Score(perplexity(nll, n), nll / n, correct / n, n, kl / n if ref_logp is not None else None)
    return s, logps


@torch.no_grad()
def greedy(model: Llama, prompt: list[int], max_new: int, stop) -> list[int]:
    """Greedy decoding with the KV cache; `stop(new_ids) -> bool` ends early."""
    total = len(prompt) + max_new
    model.setup_caches(1, total)
    try:
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)))
        out: list[int] = []
        for i in range(max_new):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if stop(out) or len(out) == max_new:
                break
            p = len(prompt) + i
            logits = model(torch.tensor([[nxt]]), torch.tensor([p]))
        return out
    finally:
        model.clear_caches()


def exact_match(model: Llama, tok, problems: list[tuple[str, str]], max_new: int) -> dict:
    """Share of problems whose first integer after "Answer:" equals the exact answer."""
    newline = tok.encode("\n", add_special_tokens=False).ids[-1]
    correct, samples = 0, []
    for prompt, answer in problems:
        ids = greedy(model, tok.encode(prompt, add_special_tokens=False).ids, max_new, lambda out: out[-1] == newline)
        text = tok.decode(ids)
        m = re.search(r"-?\d+", text.split("\n")[0])
        ok = bool(m) and m.group(0) == answer
        correct += ok
        if len(samples) < 3:
            samples.append({"prompt": prompt, "answer": answer, "output": text.strip(), "correct": ok})
    return {"accuracy": correct / len(problems), "correct": correct, "n": len(problems), "samples": samples}
