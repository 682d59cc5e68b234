"""BitDelta scale distillation: train only the α's so the compressed model's
logits match the fine-tuned model's (AdamW, cosine schedule after an optional linear warmup).

The loss (`DistillConfig.loss`): "mse", the paper's MSE on logits, or "kl", KL(fine-tune ‖
compressed) of the next-token distributions per token (`bitdelta.evaluate.kl_per_token`), the
metric the quality report scores fidelity by.

The paper's code accidentally trains embeddings and norms too; here exactly
the α's require gradients (every sign plane's, and the low-rank factors of a delta that has
them, jointly: `BitDeltaLinear.trainable`), everything else is frozen. The forward passes run
in `bitdelta.precision`'s choice for the CPU (bf16 autocast only where the CPU
has native bf16, fp32 otherwise); α and the optimizer stay fp32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bitdelta import precision
from bitdelta.evaluate import kl_per_token
from bitdelta.format import Delta
from bitdelta.model import BitDeltaLinear, Llama, attach_delta, load_model


@dataclass
class DistillConfig:
    steps: int = 150
    lr: float = 1e-5  # 1e-4 (the paper's) overshoots on small models: α roughly doubles
    batch: int = 4
    seq_len: int = 128
    seed: int = 0  # the calibration windows drawn (token_windows)
    warmup: int = 0  # linear warmup steps before the cosine decay
    loss: Literal["mse", "kl"] = "mse"  # see the module docstring

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")


LOSSES = ("mse", "kl")


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, loss: str) -> torch.Tensor:
    """The distillation loss of logits [B, T, V]: mean logit MSE, or mean KL(teacher ‖ student)
    per token (computed in fp32)."""
    if loss == "mse":
        return F.mse_loss(student, teacher)
    return kl_per_token(teacher.float().log_softmax(-1), student.float().log_softmax(-1)).mean()


def token_windows(tokens: torch.Tensor, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """n random windows [n, seq_len] from a 1-D token stream."""
    if tokens.numel() < seq_len + 1:
        raise ValueError(f"calibration text has {tokens.numel()} tokens; need more than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len, (n,), generator=g)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def tokenize_files(tokenizer_dir: str | os.PathLike, files: list[str | os.PathLike]) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(Path(f).read_text(errors="replace")).ids)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def heldout_loss(teacher: Llama, student: Llama, windows: torch.Tensor, loss: str, batch: int = 4) -> float:
    """The distillation loss (`distill_loss`) over windows [n, seq_len], per token (fp32)."""
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        total += distill_loss(student(x), teacher(x), loss).item() * x.numel()
        n += x.numel()
    return total / n


def compressed_layers(model: Llama) -> dict[str, BitDeltaLinear]:
    """param name ("….weight") -> its BitDeltaLinear."""
    return {name + ".weight": m for name, m in model.named_modules() if isinstance(m, BitDeltaLinear)}


def distill(
    base: str | os.PathLike,
    finetuned: str | os.PathLike,
    delta: Delta,
    calibration: torch.Tensor,
    cfg: DistillConfig,
    heldout: torch.Tensor | None = None,
    progress: bool = True,
) -> tuple[Delta, dict]:
    """Return a copy of `delta` with distilled α's, and a record of the run.

    calibration: 1-D token ids; windows of cfg.seq_len are drawn from it.
    heldout: optional [n, seq_len] windows on which the loss is reported before and after
    ("heldout_<loss>_before", "heldout_<loss>_after").
    """
    prec = precision.cpu_precision()
    if progress:
        print(f"[distill] {delta.meta.variant}: {prec.describe()}", flush=True)
    teacher = load_model(finetuned)
    student = attach_delta(load_model(base), delta, trainable_alpha=True)
    layers = compressed_layers(student)
    params = [t for m in layers.values() for t in m.trainable()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    windows = token_windows(calibration, cfg.seq_len, cfg.steps * cfg.batch, cfg.seed)
    record = {
        "steps": cfg.steps,
        "lr": cfg.lr,
        "batch": cfg.batch,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "loss": cfg.loss,
        "warmup": cfg.warmup,
        "schedule": "cosine",
        "trained": "alpha only" if all(m.u is None for m in layers.values()) else "alpha and low-rank factors",
        "precision": prec.record(),
    }
    if heldout is not None:
        record[f"heldout_{cfg.loss}_before"] = heldout_loss(teacher, student, heldout, cfg.loss)
    bar = tqdm(range(cfg.steps), desc=f"distill {delta.meta.variant}", disable=not progress)
    loss_val = float("nan")
    for step in bar:
        x = windows[step * cfg.batch : (step + 1) * cfg.batch]
        with precision.autocast("cpu"):
            with torch.no_grad():
                target = teacher(x)
            loss = distill_loss(student(x), target, cfg.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_val = loss.item()
        bar.set_postfix(loss=f"{loss_val:.3e}")
    record[f"final_train_{cfg.loss}"] = loss_val
    if heldout is not None:
        record[f"heldout_{cfg.loss}_after"] = heldout_loss(teacher, student, heldout, cfg.loss)

    compressed = {k: layers[k].compressed() if k in layers else cw for k, cw in delta.compressed.items()}
    meta = type(delta.meta)(**{**delta.meta.__dict__, "distilled": record})
    return Delta(meta, compressed, delta.dense, delta.files), record


def save(delta: Delta, out: str | os.PathLike) -> Path:
    """Write an in-memory delta to a file (atomically)."""
    from bitdelta.format import save_delta

    save_delta(out, delta)
    return Path(out)
