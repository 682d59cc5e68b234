"""Offline half of BitDelta: fine-tune → delta file (`compress`) and back (`apply`).

Both stream one tensor at a time, so a 7B pair needs about one model's worth
of RAM for the two readers' current tensors plus the 1/32-size signs, not
three copies of the model.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from bitdelta.arch import ModelArgs, text_model_config
from bitdelta.checkpoint import CheckpointReader, fingerprint, read_config, save_checkpoint
from bitdelta.format import CompressedWeight, Delta, DeltaMeta, SignPlane, check_arch, load_delta, save_delta
from bitdelta.model_files import JINJA_NAME, own_eos, own_serving, own_tokenizer
from bitdelta.planes import PlaneConfig, chain, embedding_moments, spend
from bitdelta_kernels.bits import pack_signs, unpack_signs

EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
# Header bytes a byte budget keeps free for the record scale distillation writes into the file
# afterwards (`bitdelta.distill`: its settings, final loss and the α's left untrained, ~400 bytes
# as the escaped JSON string it is stored as), so the distilled file meets the budget too and
# holds the same planes as the undistilled one (it was 120 bytes over 1/16 before the reserve).
RECORD_RESERVE = 1024


def is_compressed(name: str, args: ModelArgs, embeddings: str) -> bool:
    """Which parameters become signs + α: the attention/MLP matrices as the family stores them
    (split q/k/v or fused qkv, ...) always, the embeddings and LM head when `embeddings == "sign"`.
    Everything else that changed (norms, biases) is stored dense."""
    if name in EMBEDDINGS:
        return embeddings == "sign"
    return name in args.compressed_names()


def same_model(base_cfg: dict, ft_cfg: dict, finetuned: Path, base: Path) -> tuple[ModelArgs, int]:
    """The base's description and the fine-tune's vocabulary size; the fine-tune's config must
    describe the same forward pass, but for a vocabulary that grew (tokens added: its embedding and
    LM head resized)."""
    args, ft = ModelArgs.from_hf(base_cfg), ModelArgs.from_hf(ft_cfg)
    if ft.vocab_size < args.vocab_size:
        raise ValueError(
            f"{finetuned} has a vocabulary of {ft.vocab_size} rows, fewer than the base's {args.vocab_size}: "
            "a vocabulary cut short is not served (one that grew is)"
        )
    differ = [
        k
        for k in args.__dataclass_fields__
        if k not in ("bos_token_id", "eos_token_id", "max_seq_len", "vocab_size") and getattr(args, k) != getattr(ft, k)
    ]
    if differ:
        raise ValueError(
            f"{finetuned} is not a fine-tune of {base}: its config differs in "
            + ", ".join(f"{k} ({getattr(ft, k)} != {getattr(args, k)})" for k in differ)
        )
    return args, ft.vocab_size


def compress_weight(delta: torch.Tensor, alpha_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Δ [d_out, d_in] -> (signs uint8 [d_out, ceil(d_in/8)], α fp32 [d_out], [1] or [d_in]).

    α = mean|Δ| over the row (per-row: the L2-optimal scale for fixed signs), over the whole
    matrix (per-matrix, the paper's choice) or over the column (per-column).
    """
    delta = delta.float()
    if alpha_mode == "row":
        alpha = delta.abs().mean(dim=1)
    elif alpha_mode == "matrix":
        alpha = delta.abs().mean().reshape(1)
    elif alpha_mode == "col":
        alpha = delta.abs().mean(dim=0)
    else:
        raise ValueError(f"alpha_mode must be 'row', 'matrix' or 'col', not {alpha_mode!r}")
    return pack_signs(delta), alpha


def compress(
    base: str | os.PathLike,
    finetuned: str | os.PathLike,
    out: str | os.PathLike,
    alpha_mode: str = "row",
    variant: str | None = None,
    embeddings: str = "dense",
    progress: bool = True,
    planes: PlaneConfig | None = None,
    calibration: torch.Tensor | None = None,
) -> Path:
    """Write the BitDelta of `finetuned` against `base` to `out` (atomically).

    planes: compression beyond one sign plane per weight (`bitdelta.planes`: residual planes,
    low-rank, per-column or chosen α, a byte budget for the whole file, its header and
    RECORD_RESERVE bytes for a later distillation record included (`check_budget`);
    `drop`: the budget spent by the measured KL per byte of each kind of weight's plane 1 and
    second option, `planes.spend`, which may leave weights out; `feedback`: the signs by error
    feedback, `planes.feedback_plane`, the embeddings' under `planes.embedding_moments`); its `alpha` replaces `alpha_mode`, and
    compressed embeddings compete for the budget like the projections.
    calibration: 1-D token ids whose inputs weigh each option's gain (`planes.input_power`) and,
    with `feedback`, give the second moments the signs are fitted under (`planes.input_moments`,
    whose diagonal then weighs the gains)."""
    base, finetuned, out = Path(base), Path(finetuned), Path(out)
    planes = planes if planes is not None else PlaneConfig(alpha=alpha_mode)
    base_cfg = read_config(base)
    args, vocab = same_model(base_cfg, read_config(finetuned), finetuned, base)
    tokenizer = own_tokenizer(base, finetuned, vocab)  # served with its own where it differs
    if vocab > args.vocab_size and (tokenizer is None or embeddings != "dense"):
        raise ValueError(
            f"{finetuned}'s vocabulary grew from {args.vocab_size} to {vocab} rows: it is served with its own "
            + (
                "tokenizer.json, which it needs to ship"
                if tokenizer is None
                else "embedding rows, stored dense (not --embeddings sign)"
            )
        )
    eos = own_eos(base, finetuned, vocab)
    template, sampling = own_serving(base, finetuned)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    compressed: dict[str, CompressedWeight] = {}
    chains = {}
    power = moments = None
    meta_extra: dict[str, str] = {}
    if planes.feedback and calibration is None:
        raise ValueError("error-feedback signs (feedback) need calibration tokens for their inputs")
    if calibration is not None and not planes.plain:
        from bitdelta.model import load_model
        from bitdelta.planes import input_moments, input_power

        model = load_model(base)  # dropped before the tensors are read
        if planes.feedback:  # one calibration pass: E[x²] is the second moments' diagonal
            moments = input_moments(model, calibration)
            power = {k: m.diagonal() for k, m in moments.items()}
        else:
            power = input_power(model, calibration)
        del model
    tied = bool(base_cfg.get("tie_word_embeddings"))
    with CheckpointReader(base) as rb, CheckpointReader(finetuned) as rf:
        names = rf.keys()
        for name in tqdm(names, desc=f"compress {finetuned.name}", unit="tensor", disable=not progress):
            w_ft = rf.get(name)
            if name not in rb:
                if name == "lm_head.weight" and tied:
                    w_base = rb.get("model.embed_tokens.weight")
                else:
                    raise ValueError(f"{finetuned} has tensor {name!r}, which the base lacks")
            else:
                w_base = rb.get(name)
            grown = name in EMBEDDINGS and vocab > args.vocab_size
            if w_base.shape != w_ft.shape and not (grown and w_ft.shape == (vocab, *w_base.shape[1:])):
                raise ValueError(f"{name}: fine-tune shape {tuple(w_ft.shape)} != base {tuple(w_base.shape)}")
            if grown:  # its rows stored whole: the added tokens' rows have no base to be a delta of
                tensors[name] = w_ft.contiguous()
                continue
            if torch.equal(w_base, w_ft):
                continue  # unchanged: not stored
            if is_compressed(name, args, embeddings):
                shapes[name] = list(w_ft.shape)
                d = w_ft.float() - w_base.float()
                if planes.plain:
                    signs, alpha = compress_weight(d, alpha_mode if name in EMBEDDINGS else planes.alpha)
                    axis = alpha_mode if name in EMBEDDINGS else planes.alpha
                    compressed[name] = CompressedWeight([SignPlane(signs, alpha, axis)], tuple(w_ft.shape))
                else:
                    # a (tied) embedding's error reaches the logits through the head: weighed by its inputs;
                    # its α's scale rows (tokens): one per column gives every token the changed tokens'
                    # scale, which on the hard member made the head's logits noise (ppl 82, the base 56).
                    # Error feedback weighs a head's error by its inputs and a tied table's by those
                    # and by the lookup's own row error (embedding_moments)
                    w = None if power is None else power.get("lm_head.weight" if name in EMBEDDINGS else name)
                    if name in EMBEDDINGS:
                        h = None if moments is None else embedding_moments(name, moments["lm_head.weight"], tied)
                        cfg = replace(planes, alpha="row", feedback=h is not None)
                    else:
                        h, cfg = None if moments is None else moments[name], planes
                    chains[name] = chain(d, cfg, w, h)
            else:
                tensors[name] = w_ft.contiguous()
    budget = None
    if chains:
        fixed = sum(cw.nbytes for cw in compressed.values()) + sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        if planes.budget is not None and planes.budget < fixed:
            raise ValueError(
                f"a budget of {planes.budget} bytes is less than the delta's dense tensors ({fixed} bytes)"
            )
        budget = None if planes.budget is None else planes.budget - fixed
        if planes.drop and calibration is None:
            raise ValueError("leaving kinds of weight out (drop) needs calibration tokens to measure their KL")
    plain_weights = dict(compressed)
    kl = None  # what each kind of weight's plane 1 and second option are worth (drop: measured once)
    if chains and planes.drop and budget is not None:
        from bitdelta.model import load_model
        from bitdelta.planes import kind_kl

        kl = kind_kl(load_model(base), load_model(finetuned), chains, calibration)
        meta_extra["kl_without_plane1"] = json.dumps({k: round(v.plane1, 5) for k, v in kl.items()})
        meta_extra["kl_second_option"] = json.dumps(
            {k: round(v.second, 5) for k, v in kl.items() if v.second is not None}
        )
    header = 0  # what the file holds beyond its tensors (its JSON header): the budget pays it too
    while True:
        if chains:
            compressed = {**plain_weights, **spend(chains, None if budget is None else budget - header, kl)}
            if kl is not None:
                meta_extra["left_out"] = json.dumps([name for name in chains if name not in compressed])
        meta = DeltaMeta(
            variant=variant or finetuned.name,
            base_model=base_cfg.get("_name_or_path") or base.name,
            base_fingerprint=fingerprint(base),
            alpha_mode=alpha_mode if planes.plain else planes.alpha,
            shapes={k: v for k, v in shapes.items() if k in compressed},
            architecture=args.model_type,
            layout=args.layout,
            extra={"embeddings": embeddings},
            eos_token_ids=eos,
            chat_template=template,
            sampling_defaults=sampling,
            vocab_size=vocab if vocab > args.vocab_size else 0,
        )
        if not planes.plain:
            meta.extra["planes"] = f"planes={planes.planes} rank={planes.rank} budget={planes.budget}"
            if planes.feedback:
                meta.extra["signs"] = "feedback"  # named only when on: sign(Δ) files are as they were
            meta.extra.update(meta_extra)
        save_delta(out, Delta(meta, compressed, tensors, {} if tokenizer is None else {"tokenizer.json": tokenizer}))
        over = out.stat().st_size + RECORD_RESERVE - planes.budget if chains and planes.budget is not None else 0
        if over <= 0:
            return out
        header += over


def check_budget(path: str | os.PathLike, budget: int | None) -> None:
    """ValueError when the delta file at `path` is over `budget` bytes (None: no budget): what a
    record added after compression must not do (RECORD_RESERVE)."""
    size = Path(path).stat().st_size
    if budget is not None and size > budget:
        raise ValueError(
            f"{path} is {size} bytes, {size - budget} over its budget of {budget}: the records added after "
            f"compression need more than the {RECORD_RESERVE} bytes the budget keeps for them (RECORD_RESERVE)"
        )


def bf16_bytes(base: str | os.PathLike) -> int:
    """What the base's parameters take in bf16 (the budget fractions' unit)."""
    with CheckpointReader(Path(base)) as rb:
        n = 0
        for name in rb.keys():
            t = rb.get(name)
            n += t.numel()
    return n * 2


def apply(
    base: str | os.PathLike, delta_path: str | os.PathLike, out: str | os.PathLike, progress: bool = True
) -> Path:
    """Write the dense checkpoint W_base + α ⊙ S (and the dense replacements) to `out`."""
    base = Path(base)
    delta = load_delta(delta_path, base_fingerprint=fingerprint(base))
    cfg = text_model_config(read_config(base))  # a multimodal wrapper's text model: what was compressed
    check_arch(delta.meta.variant, delta.meta.architecture, delta.meta.layout, ModelArgs.from_hf(cfg))
    state = {}
    with CheckpointReader(base) as rb:
        for name in tqdm(rb.keys(), desc=f"apply {delta.meta.variant}", unit="tensor", disable=not progress):
            state[name] = reconstruct(name, rb.get(name), delta)
        for name in delta.dense.keys() - set(state):
            state[name] = delta.dense[name]  # e.g. an untied LM head
        for name in delta.compressed.keys() - set(state):
            if name == "lm_head.weight":
                state[name] = reconstruct(name, rb.get("model.embed_tokens.weight"), delta)
    if "lm_head.weight" in state and cfg.get("tie_word_embeddings"):
        cfg = {**cfg, "tie_word_embeddings": False}
    if delta.meta.vocab_size:  # tokens added: the resized embedding (and head) are the delta's, whole
        cfg = {**cfg, "vocab_size": delta.meta.vocab_size}
    # the fine-tune's own EOS, sampling defaults and chat template, as the worker and the gateway serve it
    meta, gen = delta.meta, base / "generation_config.json"
    generation = None
    if meta.eos_token_ids or meta.sampling_defaults:
        generation = {**(json.loads(gen.read_text()) if gen.is_file() else {}), **meta.sampling_defaults}
    if meta.eos_token_ids:
        ids = list(meta.eos_token_ids)
        cfg = {**cfg, "eos_token_id": ids[0] if len(ids) == 1 else ids}
        generation["eos_token_id"] = cfg["eos_token_id"]
    files = {JINJA_NAME: meta.chat_template.source} if meta.chat_template is not None else {}
    if "tokenizer.json" in delta.files:  # the fine-tune's own tokenizer, as the worker serves it
        files["tokenizer.json"] = delta.files["tokenizer.json"].decode("utf-8")
    return save_checkpoint(state, out, cfg, side_files_from=base, generation_config=generation, files=files)


def reconstruct(name: str, w_base: torch.Tensor, delta) -> torch.Tensor:
    """The variant's value of one parameter, in the base's dtype (math in fp32)."""
    if name in delta.dense:
        return delta.dense[name]
    cw = delta.compressed.get(name)
    if cw is None:
        return w_base
    if not cw.plain:
        return (w_base.float() + cw.dense()).to(w_base.dtype)
    s = unpack_signs(cw.signs, cw.shape[1], torch.float32)
    alpha = cw.alpha.float().reshape(-1, 1)
    return (w_base.float() + alpha * s).to(w_base.dtype)
