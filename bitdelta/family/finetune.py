"""Full-parameter fine-tuning of the base on one corpus (every weight moves).

Next-token cross-entropy on random windows of the corpus's train split,
AdamW with linear warm-up and a cosine decay, gradient clipping, fixed seeds.
Weights and optimizer state stay fp32; the forward/backward run in the
precision `bitdelta.precision` picks for the device: bf16 autocast on a GPU or
a CPU with native bf16 (2.4 s per 4×128 step on 2 AVX-512-BF16 cores against
5 s in fp32), plain fp32 elsewhere (emulated bf16 took 135 s per step on an
AVX2-only CPU). The choice is printed and kept in the run's record.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bitdelta import precision
from bitdelta.checkpoint import read_config, save_checkpoint
from bitdelta.family import corpora
from bitdelta.model import Llama, load_model, state_dict_for_save


@dataclass(frozen=True)
class FinetuneConfig:
    # Sized on 2 CPU cores: 64 steps × 4 × 128 tokens ≈ 33k tokens ≈ 2.5 min per
    # variant. Enough for a clear held-out perplexity drop on every corpus (the
    # model learns each corpus's layout and vocabulary first), small enough
    # that four variants build in ~10 minutes.
    steps: int = 64
    batch: int = 4
    seq_len: int = 128
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup: int = 6
    weight_decay: float = 0.01  # also nudges weights whose gradient happens to be zero
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    eval_windows: int = 8  # held-out windows for the before/after loss in the record


def tokenize(tokenizer_dir: str | os.PathLike, texts: list[str], sep_id: int) -> torch.Tensor:
    """One 1-D token stream: the texts' ids joined by `sep_id` (end of document)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep_id)
    return torch.tensor(ids, dtype=torch.long)


def corpus_tokens(tokenizer_dir: str | os.PathLike, corpus: str, split: str, subsets=None) -> torch.Tensor:
    """The token stream of a corpus split (documents in their fixed order); a copy of the stream this
    process tokenized before for the same tokenizer file (path, size, mtime) and config, corpus, split and
    subsets (a family build and its reports read each split once per mode: tokenizing took ~2 s each)."""
    tdir = Path(tokenizer_dir).resolve()
    stats = [(tdir / name).stat() for name in ("tokenizer.json", "config.json")]
    stamp = tuple((s.st_size, s.st_mtime_ns) for s in stats)
    key = (str(tdir), stamp, corpus, split, None if subsets is None else tuple(subsets))
    return _corpus_tokens(*key).clone()


@functools.lru_cache(maxsize=16)
def _corpus_tokens(tdir: str, _stamp: tuple, corpus: str, split: str, subsets: tuple | None) -> torch.Tensor:
    cfg = read_config(tdir)
    sep = cfg.get("unk_token_id", 0) if cfg.get("unk_token_id") is not None else 0  # <|endoftext|> = 0 in SmolLM2
    return tokenize(tdir, [d.text for d in corpora.documents(corpus, split, subsets)], sep)


def windows(tokens: torch.Tensor, length: int, n: int, seed: int) -> torch.Tensor:
    """n random windows [n, length] (seeded) from a 1-D stream."""
    if tokens.numel() < length + 1:
        raise ValueError(f"{tokens.numel()} tokens is too short for windows of {length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - length, (n,), generator=g).tolist()
    return torch.stack([tokens[s : s + length] for s in starts])


def lm_loss(model: Llama, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows x [B, T+1]."""
    logits = model(x[:, :-1])  # [B, T, V] fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@torch.no_grad()
def mean_loss(model: Llama, wins: torch.Tensor, batch: int, device) -> float:
    total = 0.0
    for i in range(0, len(wins), batch):
        x = wins[i : i + batch].to(device)
        with precision.autocast(device):
            total += lm_loss(model, x).item() * len(x)
    return total / len(wins)


def finetune(
    base: str | os.PathLike,
    corpus: str,
    out: str | os.PathLike,
    cfg: FinetuneConfig = FinetuneConfig(),
    subsets=None,
    device: str | None = None,
    progress: bool = True,
) -> dict:
    """Fine-tune every parameter of `base` on the train split of `corpus`; write
    the result to `out` (HF layout, fp32, atomic). Returns a record of the run."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prec = precision.precision_for(dev)
    if progress:
        print(f"[family] finetune {Path(out).name}: {prec.describe()}", flush=True)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    train = corpus_tokens(base, corpus, "train", subsets)
    heldout = corpus_tokens(base, corpus, "heldout", subsets)
    train_w = windows(train, cfg.seq_len + 1, cfg.steps * cfg.batch, cfg.seed)
    eval_w = windows(heldout, cfg.seq_len + 1, cfg.eval_windows, cfg.seed + 1)

    model = load_model(base, torch.float32, dev)
    model.requires_grad_(True).train()
    params = [p for p in model.parameters()]  # tied head: one tensor, listed once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
    )

    def lr_factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    loss_before = mean_loss(model, eval_w, cfg.batch, dev)
    bar = tqdm(range(cfg.steps), desc=f"finetune {Path(out).name} on {corpus}", unit="step", disable=not progress)
    losses = []
    for step in bar:
        x = train_w[step * cfg.batch : (step + 1) * cfg.batch].to(dev)
        with precision.autocast(dev):
            loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
    model.eval()
    loss_after = mean_loss(model, eval_w, cfg.batch, dev)
    model.requires_grad_(False)
    state = {k: v.detach().float().cpu() for k, v in state_dict_for_save(model).items()}
    save_checkpoint(state, out, read_config(base), side_files_from=base)
    return {
        "corpus": corpus,
        "subsets": list(subsets) if subsets else None,
        "config": asdict(cfg),
        "device": str(dev),
        "precision": prec.record(),
        "train_tokens": int(train.numel()),
        "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len,
        "first_train_loss": losses[0],
        "last_train_loss": losses[-1],
        "heldout_loss_before": loss_before,
        "heldout_loss_after": loss_after,
        "heldout_ppl_before": math.exp(loss_before),
        "heldout_ppl_after": math.exp(loss_after),
        "seconds": round(time.time() - t0, 1),
    }
