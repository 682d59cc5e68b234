"""Sampling defaults from `generation_config.json` files, as vLLM's server takes them
(`--generation-config auto`, its default): a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset gets the model's value, and a chat request without max_tokens the model's
max_new_tokens (cut to the context the prompt leaves). The base's file serves every model; a variant
named in `--variant-generation-configs` has its own (a full fine-tune's directory usually ships one,
and served by vLLM on its own it would get its own). `--generation-config vllm`: none (OpenAI's and
vLLM's neutral values).

    configs = GenerationConfigs.from_config(config)      # GenerationConfigError: the process exits 2
    api.parse_chat(body, configs.for_model(model))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bitdelta.generation import SamplingDefaults
from bitdelta.model_files import GENERATION_NAME as FILE
from bitdelta.model_files import ModelFileError, read_sampling
from services.gateway.config import GatewayConfig
from services.gateway.protocol import NEUTRAL


class GenerationConfigError(ValueError):
    """A generation config that cannot be read or sets a value out of its field's rule (names the file)."""


def load(path: Path) -> SamplingDefaults:
    """The defaults of a generation_config.json, or of the one in directory `path` (which must have one)."""
    path = Path(path)
    try:
        found = read_sampling(path)
    except ModelFileError as e:
        raise GenerationConfigError(str(e)) from None
    if found is None:
        raise GenerationConfigError(f"cannot read {path / FILE}: there is no such file")
    return SamplingDefaults.from_config(found)


@dataclass(frozen=True)
class GenerationConfigs:
    """The base's defaults and the variants' own; `origin` says where the base's came from (logged)."""

    base: SamplingDefaults = NEUTRAL
    variants: dict[str, SamplingDefaults] = field(default_factory=dict)
    origin: str = "none (neutral sampling defaults)"

    def for_model(self, model: str, own: SamplingDefaults | None = None) -> SamplingDefaults:
        """The flags' defaults of `model`, else its own (its delta's), else the base's."""
        if model in self.variants:
            return self.variants[model]
        return own if own is not None else self.base

    @classmethod
    def from_config(cls, config: GatewayConfig) -> GenerationConfigs:
        """--generation-config: `auto`, the base's directory's file (--tokenizer's, else --chat-template's
        when that is a directory) if it has one; `vllm`: none; else that file or directory's (which must
        have one). GenerationConfigError names the file."""
        choice = config.generation_config
        base, origin = NEUTRAL, cls.origin
        if choice == "auto":
            dirs = [d for d in (config.tokenizer, config.chat_template) if d is not None and Path(d).is_dir()]
            found = next((Path(d) / FILE for d in dirs if (Path(d) / FILE).is_file()), None)
            if found is not None:
                base, origin = load(found), str(found)
        elif choice != "vllm":
            base, origin = load(Path(choice).expanduser()), choice
        variants = {name: load(path) for name, path in config.variant_generation_config_paths().items()}
        return cls(base, variants, origin)
