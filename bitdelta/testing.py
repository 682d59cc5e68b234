"""Tiny random Llama families for tests and quick demos.

`make_tiny_family(root)` writes a base checkpoint (HF layout, with a byte-level
tokenizer) and fine-tuned variants whose every weight moved, as real full
fine-tunes do. Nothing here is a mock: the files are real checkpoints that
every tool and service reads like any other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bitdelta.checkpoint import save_checkpoint
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


def make_base(out: Path, args: ModelArgs | None = None, seed: int = 0) -> Path:
    args = args or tiny_args()
    model = init_random(args, seed=seed)
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


def make_tiny_family(root: Path, n_variants: int = 3, args: ModelArgs | None = None) -> tuple[Path, list[Path]]:
    root = Path(root)
    base = make_base(root / "base", args)
    variants = [make_finetune(base, root / f"variant{i}", seed=100 + i) for i in range(n_variants)]
    return base, variants
