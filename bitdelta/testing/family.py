"""Tiny random Llama families, used by tests and bench/.

`make_base` writes a base checkpoint (HF layout, with a byte-level tokenizer),
`make_finetune` a variant of it whose every weight moved, as real full fine-tunes
do; `make_test_family` a serving family: a base whose greedy outputs vary (so
"same tokens" is a meaningful assertion) and its delta files (good, for another
base, corrupted), with the dense references W_base + α·S. Nothing here is a mock:
the files are real checkpoints and delta files that every tool and service reads
like any other.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from bitdelta.checkpoint import save_checkpoint
from bitdelta.compress import apply, compress
from bitdelta.format import DELTA_SUFFIX as SUFFIX  # the delta store's object suffix; the local source reads it too
from bitdelta.format import read_header
from bitdelta.model import ModelArgs, init_random, state_dict_for_save

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_args(**overrides) -> ModelArgs:
    kw = dict(
        vocab_size=256 + len(SPECIALS),
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=172,
        max_seq_len=256,
        tie_embeddings=True,
        bos_token_id=256,
        eos_token_id=256,
    )
    kw.update(overrides)
    return ModelArgs(**kw)


def write_byte_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode for sorting the alphabet by byte value.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


# std 0.02 (init_random's default) makes a tiny random model repeat one token under greedy
# decoding; at 0.2 its outputs vary from token to token (the serving tests' families).
VARIED_STD = 0.2
FT_SCALE = 0.02


def make_base(out: Path, args: ModelArgs | None = None, seed: int = 0, std: float = 0.02) -> Path:
    args = args or tiny_args()
    model = init_random(args, seed=seed, std=std)
    save_checkpoint(state_dict_for_save(model), out, args.to_hf())
    write_byte_tokenizer(out)
    return out


def make_finetune(base: Path, out: Path, seed: int, scale: float = 0.004, touch_norms: bool = True) -> Path:
    """A 'fine-tune' of `base`: every weight moves by Laplace-ish noise of size `scale`,
    plus a structured low-rank shift so the variant behaves differently."""
    from bitdelta.checkpoint import CheckpointReader, read_config

    g = torch.Generator().manual_seed(seed)
    state = {}
    with CheckpointReader(base) as r:
        for name, t in r:
            if name in r.implied:  # OLMo 1's norms: no weights to move
                continue
            t = t.float()
            if t.dim() == 2:
                noise = (
                    (torch.rand(t.shape, generator=g) - 0.5).sign()
                    * torch.empty(t.shape).exponential_(generator=g)
                    * scale
                )
                u = torch.randn(t.shape[0], 2, generator=g)
                v = torch.randn(2, t.shape[1], generator=g)
                t = t + noise + scale * 0.5 * (u @ v)
            elif touch_norms:
                t = t + 0.01 * torch.randn(t.shape, generator=g)
            state[name] = t
    save_checkpoint(state, out, read_config(base), side_files_from=base)
    return out


def make_lora(base: Path, out: Path, rank: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter directory of rank `rank` on every projection of `base`: random (seeded)
    bf16 factors of PEFT's usual init scale (A ~ 1/√d_in, B small), scale 2 (lora_alpha = 2r).
    The benches' LoRA variant (bench/variant_step.py, bench/peer_cpu.py)."""
    from bitdelta.arch import ModelArgs
    from bitdelta.checkpoint import CheckpointReader, read_config
    from bitdelta.merge.adapter import LoraAdapter, LoraModule, save_adapter

    args = ModelArgs.from_hf(read_config(base))
    g = torch.Generator().manual_seed(seed)
    mods = {}
    with CheckpointReader(base) as rb:
        for name in args.compressed_names():
            d_out, d_in = rb.shape(name)
            a = torch.randn(rank, d_in, generator=g) / d_in**0.5
            b = torch.randn(d_out, rank, generator=g) * 0.01
            mods[name.removesuffix(".weight")] = LoraModule(a.bfloat16(), b.bfloat16(), 2.0)
    return save_adapter(LoraAdapter(mods), out, base_model=str(base))


@dataclass
class WorkerFamily:
    base: Path
    deltas: Path  # directory of <name>.safetensors
    variants: list[str]  # names of good deltas
    merged: dict[str, Path]  # name -> dense checkpoint W_base + α·S (bitdelta.compress.apply)
    other_base: str  # a delta built against a different base
    corrupt: str  # a delta with one flipped data byte

    def delta_path(self, name: str) -> Path:
        return self.deltas / f"{name}{SUFFIX}"


def make_test_family(
    root: Path, n_variants: int = 3, args: ModelArgs | None = None, merged: bool = True, seed: int = 1
) -> WorkerFamily:
    root = Path(root)
    args = args or tiny_args()
    base = make_base(root / "base", args, seed, std=VARIED_STD)
    deltas = root / "deltas"
    names, dense = [], {}
    for i in range(n_variants):
        name = f"v{i}"
        ft = make_finetune(base, root / f"ft{i}", seed=100 + i, scale=FT_SCALE)
        # one variant with a per-matrix α, the others per row: both paths are served
        compress(
            base, ft, deltas / f"{name}{SUFFIX}", alpha_mode="matrix" if i == 2 else "row", variant=name, progress=False
        )
        shutil.rmtree(ft)
        if merged:
            dense[name] = apply(base, deltas / f"{name}{SUFFIX}", root / f"merged{i}", progress=False)
        names.append(name)
    other = make_base(root / "other_base", args, seed + 1000, std=VARIED_STD)
    oft = make_finetune(other, root / "other_ft", seed=7, scale=FT_SCALE)
    compress(other, oft, deltas / f"otherbase{SUFFIX}", variant="otherbase", progress=False)
    shutil.rmtree(oft)
    # corrupt: a copy of v0 with one byte of a sign tensor flipped (header and size intact)
    bad = deltas / f"corrupt{SUFFIX}"
    shutil.copy(deltas / f"v0{SUFFIX}", bad)
    header = read_header(bad)
    t = next(t for t in header.tensors if t.name.endswith(".sign"))
    with open(bad, "r+b") as f:
        f.seek(t.start + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.start + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    return WorkerFamily(base, deltas, names, dense, "otherbase", "corrupt")
