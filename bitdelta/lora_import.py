"""A PEFT LoRA adapter as a delta file, served exactly: vLLM multi-LoRA families on this system.

A LoRA adapter's update of a module is already low-rank, Δ = scale · B · A, which is a delta
file's low-rank part (format v3: `P.lowrank_u` fp16 [d_out, r], `P.lowrank_v` fp16 [r, d_in]) with
no sign plane at all. So the file holds U = scale · B and V = A, each rounded once to fp16 (what
the format stores; an adapter is usually trained in bf16, which fp16 holds with 3 more bits), and
the worker adds (x · Vᵀ) · Uᵀ to its module's output in fp32, as it does for any low-rank residual,
in the same mixed batches as BitDelta variants. Nothing is compressed: the file is the adapter's
own size (fp16), and the variant is the adapter up to that one rounding.

What else an adapter carries becomes the file's dense parts, each the parameter's value as PEFT
serves it (`PeftModel.from_pretrained` on the base), in the base's dtype: `modules_to_save` (a
trained LM head, embedding or norm, saved whole), trained biases (`bias="all"`/`"lora_only"`, and
`lora_bias`'s scale · b added to the module's bias), embedding LoRA (the embedding plus
(scale · B A)ᵀ) and LoRA on the LM head (its weight plus scale · B A). On a base whose LM head is
its embedding PEFT keeps one parameter for both and wraps each module on its own: an embedding
changed by modules_to_save or embedding LoRA leaves the head as it was (unless
`ensure_weight_tying`, which saves both), so the file then holds the head too.

What `bitdelta.merge.adapter.load_adapter` cannot represent faithfully is refused there (DoRA,
fan_in_fan_out, QA-LoRA, KaSA, aLoRA, trainable tokens, ...); a module or parameter this base does
not have, a shape that does not fit (a resized vocabulary), a projection saved whole, a bias the
base lacks, or factors beyond fp16's range are refused here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from bitdelta.arch import TEXT_MODELS, ModelArgs
from bitdelta.checkpoint import (
    CheckpointReader,
    StoredForm,
    causal_lm_name,
    fingerprint,
    read_config,
    rows_of,
    stored_form,
)
from bitdelta.format import CompressedWeight, Delta, DeltaMeta, save_delta
from bitdelta.merge.adapter import LoraAdapter, load_adapter
from bitdelta.model_files import own_serving, own_tokenizer
from bitdelta.shard import EMBED, HEAD

FP16_MAX = torch.finfo(torch.float16).max


def import_lora(
    base: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike, variant: str | None = None
) -> Path:
    """Write the delta file of the PEFT adapter directory `adapter` for `base` to `out` (atomically)."""
    base, adapter, out = Path(base), Path(adapter), Path(out)
    lora = load_adapter(adapter, name=variant, full=True)
    template, sampling = own_serving(base, adapter)  # its own chat template, by the gateway
    cfg = read_config(base)
    args = ModelArgs.from_hf(cfg)
    tokenizer = own_tokenizer(base, adapter, args.vocab_size)  # ... and its own tokenizer, by the worker
    if cfg.get("model_type") in TEXT_MODELS:  # a multimodal wrapper's adapter: its text model's part
        lora = _text_model_part(lora)
    form = stored_form(cfg)
    if form is not None:  # GPT-NeoX's names, its fused query_key_value's factors split into q, k, v
        lora = _canonical_part(lora, form)
    projections = set(args.compressed_names())
    compressed: dict[str, CompressedWeight] = {}
    with CheckpointReader(base) as rb:
        dense = _dense_parts(lora, rb, args.tie_embeddings, projections, f"{adapter}", f"{base}")
        for module, m in lora.modules.items():
            param = module + ".weight"
            if param not in projections:
                continue  # a dense part (_dense_parts)
            if tuple(rb.shape(param)) != m.shape:
                raise ValueError(f"{adapter}: {module} is {list(m.shape)} in the adapter, {rb.shape(param)} in {base}")
            u, v = m.B.float() * m.scale, m.A.float()
            big = max(u.abs().max().item(), v.abs().max().item())
            if big > FP16_MAX:
                raise ValueError(f"{adapter}: {module}'s factors reach {big:.3g}, beyond float16's range")
            compressed[param] = CompressedWeight([], m.shape, u.half(), v.half())
    meta = DeltaMeta(
        variant=lora.name,
        base_model=cfg.get("_name_or_path") or base.name,
        base_fingerprint=fingerprint(base),
        alpha_mode="row",
        shapes={k: list(w.shape) for k, w in compressed.items()},
        architecture=args.model_type,
        layout=args.layout,
        extra={"source": "lora", "lora_rank": str(lora.rank)},
        chat_template=template,
        sampling_defaults=sampling,
    )
    save_delta(out, Delta(meta, compressed, dense, {} if tokenizer is None else {"tokenizer.json": tokenizer}))
    return out


def _text_model_part(lora: LoraAdapter) -> LoraAdapter:
    """A multimodal wrapper's adapter (Gemma 3's) as its text model's: its modules and tensors under the
    text model's causal-LM names (bitdelta.checkpoint.causal_lm_name); the vision tower's and the
    projector's left out, as a text prompt never reaches them."""

    def text(d: dict) -> dict:
        return {n: v for k, v in d.items() if (n := causal_lm_name(k)) is not None}

    return dataclasses.replace(
        lora, modules=text(lora.modules), embeddings=text(lora.embeddings), params=text(lora.params)
    )


def _canonical_part(lora: LoraAdapter, form: StoredForm) -> LoraAdapter:
    """An adapter of a family whose checkpoints name and fuse tensors their own way (GPT-NeoX's) under the
    canonical names: each module's factors, B's rows (and a lora_bias's) split as the stored tensor's rows
    are (q, k and v of `query_key_value` share A), and each whole tensor by its PEFT path (a `base_layer`
    kept in the name) split the same way."""

    def modules(d: dict) -> dict:
        out = {}
        for k, m in d.items():
            for param, runs in form.canonical(k + ".weight"):
                bias = None if m.bias is None else rows_of(m.bias, runs)
                out[param.removesuffix(".weight")] = dataclasses.replace(m, B=rows_of(m.B, runs), bias=bias)
        return out

    def params(d: dict) -> dict:
        out = {}
        for path, t in d.items():
            module, _, leaf = path.rpartition(".")
            base_layer = module.endswith(".base_layer")
            outs = form.canonical(f"{module.removesuffix('.base_layer')}.{leaf}")
            if not outs:
                raise ValueError(f"{path}: saved whole, it is one part of a tensor this base stores in parts")
            for param, runs in outs:
                name = param if not base_layer else param.replace(f".{leaf}", f".base_layer.{leaf}")
                out[name] = rows_of(t, runs)
        return out

    return dataclasses.replace(
        lora, modules=modules(lora.modules), embeddings=modules(lora.embeddings), params=params(lora.params)
    )


def _dense_parts(
    lora: LoraAdapter, rb: CheckpointReader, tied: bool, projections: set[str], adapter: str, base: str
) -> dict[str, torch.Tensor]:
    """The parameters other than the projections' weights that the adapter changes, each its value
    as PEFT serves it, in the base's dtype; those equal to the base's are left out."""

    def base_value(param: str) -> torch.Tensor:  # a tied head is the embedding
        if param in rb:
            return rb.get(param)
        if param == HEAD and tied:
            return rb.get(EMBED)
        raise ValueError(f"{adapter}: the adapter changes {param}, which is not a parameter of this base ({base})")

    # whole tensors: a wrapped module's own parameter (`.base_layer.`: what PEFT loads into the
    # base's parameter, which a tied head shares) or a replacement (modules_to_save's copy, a bias)
    own, whole = {}, {}
    for path, t in lora.params.items():
        (own if ".base_layer." in path else whole)[path.replace(".base_layer.", ".")] = t
    if tied and EMBED in own and HEAD in own and not torch.equal(own[EMBED], own[HEAD]):
        raise ValueError(f"{adapter}: the embedding and the LM head are one parameter of this base, saved unequal")
    if tied and (shared := own.get(EMBED, own.get(HEAD))) is not None:
        own[EMBED] = own[HEAD] = shared
    added: dict[str, list[torch.Tensor]] = {}  # param -> LoRA updates on top of its value
    for module, m in lora.modules.items():
        if module + ".weight" not in projections:
            added.setdefault(module + ".weight", []).append(m.delta())
        if m.bias is not None:
            added.setdefault(module + ".bias", []).append(m.bias.float() * m.scale)
    for module, m in lora.embeddings.items():
        added.setdefault(module + ".weight", []).append(m.delta().T)
    for param in (*own, *whole, *added):
        if param in projections:
            raise ValueError(f"{adapter}: {param} is saved whole; this system serves a projection's LoRA factors only")
        if param in whole and param in added:
            raise ValueError(f"{adapter}: {param} is both saved whole and given LoRA factors")
    touched = {*own, *whole, *added}
    if tied and touched & {EMBED, HEAD}:
        touched |= {EMBED, HEAD}

    def value(param: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the parameter's value as PEFT serves it, the base's)"""
        ref = base_value(param)
        v, updates = whole.get(param, own.get(param, ref)), added.get(param, [])
        if wrong := next((t.shape for t in (v, *updates) if t.shape != ref.shape), None):
            resized = " (a resized vocabulary)" if param in (EMBED, HEAD) else ""
            raise ValueError(
                f"{adapter}: {param} is {list(wrong)} in the adapter, {list(ref.shape)} in {base}{resized}"
            )
        return (v.float() + sum(updates)).to(ref.dtype), ref

    values = {p: value(p) for p in sorted(touched)}
    if tied and EMBED in values:
        # the worker's head is the delta's lm_head, else its embedding: the head is stored where
        # it differs from the variant's embedding, not from the base's
        values[HEAD] = (values[HEAD][0], values[EMBED][0])
    return {p: v.contiguous() for p, (v, ref) in values.items() if not torch.equal(v, ref)}
