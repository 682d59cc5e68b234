"""LoRA adapters as plain data, read and written in the PEFT layout without PEFT.

A directory holds `adapter_config.json` and `adapter_model.safetensors` with
keys `base_model.model.<module>.lora_A.weight` [r, d_in] and
`...lora_B.weight` [d_out, r]. The adapter's task vector for a module is the
dense update

    Δ = scale · B @ A          # [d_out, d_in]; scale = lora_alpha / r (rsLoRA: / √r)

Everything here works on the factors: inner products, norms, cosine
similarities and weighted sums re-factorised to a rank are computed through
r×r matrices, never the dense Δ (which is 576×1536 per MLP module on the
real model and much larger on real ones).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bitdelta.checkpoint import atomic_dir

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"  # older PEFT's torch.save file, read without unpickling code
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<name>[^.]+))?\.weight$")
# what a full read (load_adapter(full=True)) also takes: embedding LoRA's factors (no `.weight`),
# lora_bias's bias of B, and any other tensor, a whole parameter under its PEFT module path
_EMBED_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_embedding_(?P<which>[AB])(?:\.(?P<name>[^.]+))?$")
_BIAS_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_B(?:\.(?P<name>[^.]+))?\.bias$")
# LoraConfig fields whose adapters are not a plain B·A on each module (truthy: refused)
_REFUSED = {
    "use_dora": "DoRA adapters are not supported (their magnitude vector is not a plain BA)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D) adapters are not supported",
    "use_qalora": "QA-LoRA adapters (A over pooled input groups) are not supported",
    "kasa_config": "KaSA adapters (a learned diagonal between A and B, and a truncated base) are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA: the adapter acts only after its invocation tokens) is not supported",
    "monteclora_config": "MonteCLoRA adapters (sampled factors) are not supported",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) adapters are not supported",
    "layer_replication": "layer_replication (a stack of layers other than the base's) is not supported",
    "target_parameters": "LoRA on bare parameters (target_parameters, e.g. MoE experts) is not supported",
    "trainable_token_indices": "trainable_token_indices (PEFT's trainable tokens) is not supported",
    "arrow_config": "Arrow routing over adapters is not supported",
}


@dataclass
class LoraModule:
    """One module's factors: Δ = scale · B @ A."""

    A: torch.Tensor  # [r, d_in]
    B: torch.Tensor  # [d_out, r]
    scale: float
    bias: torch.Tensor | None = None  # lora_bias: B's own bias [d_out]; the module's bias gains scale · bias

    def __post_init__(self):
        if self.A.dim() != 2 or self.B.dim() != 2 or self.A.shape[0] != self.B.shape[1]:
            raise ValueError(f"LoRA factors do not fit: A {tuple(self.A.shape)}, B {tuple(self.B.shape)}")

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape[0], self.A.shape[1]

    @property
    def nbytes(self) -> int:
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def delta(self) -> torch.Tensor:
        """The dense update scale · B A in fp32: [d_out, d_in]."""
        return (self.B.float() @ self.A.float()) * self.scale


def module_inner(x: LoraModule, y: LoraModule) -> float:
    """⟨Δx, Δy⟩_F without forming either: tr(Aᵀ Bᵀ B' A') = Σ (BᵀB') ∘ (A A'ᵀ)."""
    if x.shape != y.shape:
        raise ValueError(f"modules of different shapes {x.shape} vs {y.shape}")
    bb = x.B.float().T @ y.B.float()  # [r, r']
    aa = x.A.float() @ y.A.float().T  # [r, r']
    return float((bb * aa).sum()) * x.scale * y.scale


@dataclass
class LoraAdapter:
    """A LoRA adapter: per-module factors plus the PEFT config it came with."""

    modules: dict[str, LoraModule]  # "model.layers.0.self_attn.q_proj" -> factors
    name: str = ""
    config: dict = field(default_factory=dict)
    # what only a full read takes (load_adapter(full=True)): embedding LoRA ("model.embed_tokens" ->
    # A [r, vocab], B [dim, r]: the embedding gains (scale · B A)ᵀ), and whole tensors by their PEFT
    # path ("lm_head.weight" a modules_to_save copy, "model.embed_tokens.base_layer.weight" the
    # wrapped module's own parameter, "...q_proj.base_layer.bias" a trained bias)
    embeddings: dict[str, LoraModule] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored factors (what an edge device must hold)."""
        return sum(m.nbytes for m in self.modules.values())

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def norm(self) -> float:
        """‖τ‖: the Frobenius norm of all modules' Δ together."""
        return math.sqrt(max(0.0, sum(module_inner(m, m) for m in self.modules.values())))

    def dense(self) -> dict[str, torch.Tensor]:
        return {k: m.delta() for k, m in self.modules.items()}

    def to(self, dtype: torch.dtype) -> LoraAdapter:
        if self.embeddings or self.params or any(m.bias is not None for m in self.modules.values()):
            raise ValueError("only an adapter of factors alone converts (merging's adapters)")
        mods = {k: LoraModule(m.A.to(dtype), m.B.to(dtype), m.scale) for k, m in self.modules.items()}
        return LoraAdapter(mods, self.name, dict(self.config))


def similarity(x: LoraAdapter, y: LoraAdapter) -> float:
    """K-Merge's similarity: the mean over modules of cos(flatten(Δx), flatten(Δy)).

    The mean runs over the union of both adapters' modules; a module one of
    them lacks (or whose Δ is zero) counts as cosine 0.
    """
    names = sorted(set(x.modules) | set(y.modules))
    if not names:
        return 0.0
    total = 0.0
    for k in names:
        a, b = x.modules.get(k), y.modules.get(k)
        if a is None or b is None:
            continue
        na, nb = module_inner(a, a), module_inner(b, b)
        if na <= 0 or nb <= 0:
            continue
        total += module_inner(a, b) / math.sqrt(na * nb)
    return total / len(names)


def lowrank_sum(terms: list[tuple[float, LoraModule]], rank: int | None) -> LoraModule:
    """The best rank-`rank` factorisation of Σ w_i · Δ_i, computed from the factors.

    Stack B̂ = [w_1 s_1 B_1 … w_n s_n B_n] [d_out, R] and Â = [A_1; …; A_n] [R, d_in],
    so Σ w_i Δ_i = B̂ Â. With B̂ = Q_b R_b and Âᵀ = Q_a R_a (reduced QR), the sum is
    Q_b (R_b R_aᵀ) Q_aᵀ; the SVD of the small R×R core gives the exact singular
    triplets, and truncating them is the Eckart–Young optimum. rank=None keeps
    all R (exact). The result has scale 1 and √σ on both sides.
    """
    terms = [(w, m) for w, m in terms if w != 0]
    if not terms:
        raise ValueError("lowrank_sum of nothing")
    shape = terms[0][1].shape
    if any(m.shape != shape for _, m in terms):
        raise ValueError("lowrank_sum over modules of different shapes")
    b_hat = torch.cat([m.B.float() * (w * m.scale) for w, m in terms], dim=1)  # [d_out, R]
    a_hat = torch.cat([m.A.float() for _, m in terms], dim=0)  # [R, d_in]
    qb, rb = torch.linalg.qr(b_hat)  # [d_out, R'], [R', R]
    qa, ra = torch.linalg.qr(a_hat.T)  # [d_in, R''], [R'', R]
    u, s, vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)  # core [R', R'']
    k = s.shape[0] if rank is None else max(1, min(rank, s.shape[0]))
    root = s[:k].sqrt()
    B = (qb @ u[:, :k]) * root  # [d_out, k]
    A = root[:, None] * (vh[:k] @ qa.T)  # [k, d_in]
    return LoraModule(A.contiguous(), B.contiguous(), 1.0)


def dense_to_lora(delta: torch.Tensor, rank: int) -> LoraModule:
    """Best rank-`rank` factors of a dense update (truncated SVD, fp32)."""
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    k = max(1, min(rank, s.shape[0]))
    root = s[:k].sqrt()
    return LoraModule((root[:, None] * vh[:k]).contiguous(), (u[:, :k] * root).contiguous(), 1.0)


# ----------------------------------------------------------------------------- PEFT layout


def _scale(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    # PEFT's rule: a key matches a module name that equals it or ends with ".key".
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _weights(file: Path):
    """(name, () -> tensor) of an adapter's weights file: safetensors, or older PEFT's torch.save
    file, loaded with weights_only (tensors and plain containers: no code from the file runs)."""
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, lambda key=key: f.get_tensor(key)
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle's or torch's: the file is not a plain state dict
        raise ValueError(f"{file}: not a state dict of tensors ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{file}: not a state dict of tensors")
    for key, t in state.items():
        yield key, lambda t=t: t


def load_adapter(path: str | os.PathLike, name: str | None = None, full: bool = False) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory (no PEFT import): adapter_model.safetensors, or older
    PEFT's adapter_model.bin (torch.load with weights_only: no code from the file runs).

    Raises ValueError for what is not a plain B·A per module (DoRA, fan_in_fan_out, QA-LoRA, KaSA,
    aLoRA, MonteCLoRA, BD-LoRA, layer replication, target_parameters, trainable tokens, Arrow).
    Without `full` (merging, which works on factors only) also for trained biases, modules_to_save
    and embedding LoRA; with it those come in the adapter's `embeddings`, `params` and modules' `bias`.
    """
    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not weights.is_file() and (path / LEGACY_WEIGHTS_FILE).is_file():
        weights = path / LEGACY_WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{path} is not a LoRA adapter directory: need {CONFIG_FILE} and {WEIGHTS_FILE} (or {LEGACY_WEIGHTS_FILE})"
        )
    cfg = json.loads(cfg_file.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: {CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in _REFUSED.items():
        if cfg.get(key):
            raise ValueError(f"{path}: {why} ({key} is set)")
    if cfg.get("modules_to_save") and not full:
        raise ValueError(f"{path}: modules_to_save {cfg['modules_to_save']} (whole trained modules) are not supported")
    try:
        r_default, alpha_default = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: {CONFIG_FILE} needs an integer r (and a number lora_alpha)") from None
    rslora = bool(cfg.get("use_rslora", False))

    factors: dict[str, dict[str, torch.Tensor]] = {}
    embedding: dict[str, dict[str, torch.Tensor]] = {}
    biases: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for key, get in _weights(weights):
        if m := _KEY.match(key):
            factors.setdefault(m["module"], {})[m["which"]] = get()
        elif full and (m := _EMBED_KEY.match(key)):
            embedding.setdefault(m["module"], {})[m["which"]] = get()
        elif full and (m := _BIAS_KEY.match(key)):
            biases[m["module"]] = get()
        elif full and key.startswith(PREFIX) and "lora_" not in key:
            params[key[len(PREFIX) :]] = get()
        else:
            raise ValueError(
                f"{path}: tensor {key!r} is not a lora_A/lora_B weight "
                "(biases, embeddings and DoRA vectors are not supported)"
            )

    def module_of(module: str, ab: dict[str, torch.Tensor], prefix: str, bias: torch.Tensor | None) -> LoraModule:
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module} has {prefix}{''.join(ab)} only")
        r = ab["A"].shape[0]
        try:
            declared = int(_pattern_value(cfg.get("rank_pattern"), module, r_default))
            alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha_default))
        except (AttributeError, TypeError, ValueError, re.error):
            raise ValueError(f"{path}: rank_pattern / alpha_pattern are not maps of module -> number") from None
        if declared != r:
            raise ValueError(f"{path}: {module} has rank {r} but the config says {declared}")
        return LoraModule(ab["A"], ab["B"], _scale(alpha, r, rslora), bias)

    if unpaired := sorted(set(biases) - set(factors)):
        raise ValueError(f"{path}: lora_B biases of {unpaired}, which have no lora_A/lora_B weights")
    modules = {k: module_of(k, ab, "lora_", biases.get(k)) for k, ab in sorted(factors.items())}
    embeddings = {k: module_of(k, ab, "lora_embedding_", None) for k, ab in sorted(embedding.items())}
    if not modules and not embeddings and not params:
        raise ValueError(f"{path}: no LoRA weights")
    return LoraAdapter(modules, name or path.name, cfg, embeddings, params)


def save_adapter(
    adapter: LoraAdapter,
    out: str | os.PathLike,
    base_model: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write `adapter` as a PEFT LoRA directory, atomically.

    The config's r / lora_alpha reproduce every module's scale: the most common
    (rank, scale) becomes the default and the others go into rank_pattern /
    alpha_pattern under their full module names. `extra_files` (name -> text)
    are written beside (e.g. the task's held-out text).
    """
    out = Path(out)
    mods = adapter.modules
    if not mods:
        raise ValueError("cannot save an adapter without modules")
    common: dict[tuple[int, float], int] = {}
    for m in mods.values():
        common[(m.rank, m.scale)] = common.get((m.rank, m.scale), 0) + 1
    (r0, s0) = max(common, key=common.get)
    rank_pattern, alpha_pattern = {}, {}
    for k, m in mods.items():
        if m.rank != r0:
            rank_pattern[k] = m.rank
        if m.scale * m.rank != s0 * r0:
            alpha_pattern[k] = m.scale * m.rank
    targets = sorted({k.rsplit(".", 1)[-1] for k in mods})
    keep = {k: v for k, v in adapter.config.items() if k in ("task_type", "base_model_name_or_path", "lora_dropout")}
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **keep,
        "r": r0,
        "lora_alpha": s0 * r0,
        "target_modules": targets,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    cfg.setdefault("lora_dropout", 0.0)
    if base_model is not None:
        cfg["base_model_name_or_path"] = base_model
    tensors = {}
    for k, m in mods.items():
        tensors[f"{PREFIX}{k}.lora_A.weight"] = m.A.contiguous()
        tensors[f"{PREFIX}{k}.lora_B.weight"] = m.B.contiguous()
    with atomic_dir(out) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
    return out
