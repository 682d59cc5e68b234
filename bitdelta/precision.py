"""Which floating-point precision torch computes in on this machine: one rule for
every place that trains or runs a model (fine-tuning, distillation, the quality
report, the worker's `--dtype auto`, the benchmarks).

The rule: bf16 only where the hardware does bf16 natively, fp32 otherwise.

- CUDA: bf16 (every GPU this project targets has bf16 tensor cores).
- CPU: bf16 autocast only when the CPU has native bf16 dot products (x86:
  AVX-512 BF16 or AMX-BF16; Arm: the BF16 extension), read once from the CPU
  flags; elsewhere fp32. Without hardware support torch emulates bf16: on a
  2-core AVX2 EPYC a 512×576·576×1536 matmul took 15 ms in fp32 and 963 ms in
  bf16, and one fine-tuning step of SmolLM2-135M 135 s instead of ~5 s
  (REFERENCES.md, "CPU portability").
- The choice `fp32|bf16|auto` overrides the CPU rule (auto: the rule): the
  `bitdelta --cpu-precision` flag, whose alias is `BITDELTA_CPU_PRECISION`. fp32
  emulates a CPU without bf16 on one that has it (CI does so); bf16 on a CPU
  without it is allowed but slow, and says so.

The process's choice is set once at the edge (`configure`, by the CLI from its flag);
a process that sets none reads `BITDELTA_CPU_PRECISION` once, the first time it is
needed (`process_choice`). Every function below also takes the choice explicitly.

Training autocasts its forward/backward to `cpu_precision().name`; weights,
gradients and optimizer state stay fp32 either way, so the choice changes the
numerics of matmuls only. Every build record and report states the choice.

Serving (`serving_dtype`, the worker's `--dtype auto`) follows the same rule: bf16 weights on a
CPU with native bf16 (half the memory traffic of fp32; the C kernels widen them in registers and
accumulate in fp32), fp32 elsewhere, so a CPU without bf16 never serves emulated bf16.

    >>> from bitdelta.precision import cpu_precision, autocast
    >>> cpu_precision()
    Precision(name='fp32', reason='no native bf16 on this CPU (AVX2; no avx512_bf16/amx_bf16 flag)', source='cpu flags')
    >>> with autocast("cpu"):
    ...     loss = model(x)

Only the standard library is imported at module level; torch is imported by the
functions that need it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV = "BITDELTA_CPU_PRECISION"
CHOICES = ("auto", "fp32", "bf16")
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Precision:
    """A precision choice: `name` ("fp32" | "bf16"), why, and where the decision came from
    ("env", "cpu flags", "cuda", "serving default")."""

    name: str
    reason: str
    source: str

    @property
    def dtype(self):
        """The torch dtype (torch.float32 or torch.bfloat16)."""
        import torch

        return getattr(torch, _TORCH_NAMES[self.name])

    @property
    def torch_name(self) -> str:
        """ "float32" | "bfloat16" (the worker's --dtype spelling)."""
        return _TORCH_NAMES[self.name]

    def describe(self) -> str:
        """One line for logs and the reports' "made on" line: `fp32 (no native bf16 …)`."""
        return f"{self.name} ({self.reason})"

    def record(self) -> dict:
        """What build stamps and reports store."""
        return {"precision": self.name, "reason": self.reason, "source": self.source}


def native_bf16() -> tuple[bool, str]:
    """(whether this CPU has native bf16 dot products that torch uses, why), checked once per process
    (`bitdelta_kernels.cpu_features.native_bf16`: the same fact decides how the CPU prefill multiplies
    bf16 matrices)."""
    from bitdelta_kernels.cpu_features import native_bf16 as native

    return native()


def check_choice(value: str, where: str = "cpu precision") -> str:
    """`value` as a choice ("auto" | "fp32" | "bf16"; case and blanks ignored, empty: auto), or a
    ValueError naming `where` (the flag or the variable it came from)."""
    choice = value.strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{where}={value!r}: use one of {', '.join(CHOICES)}")
    return choice


def choice_from_env(env: Mapping[str, str] | None = None) -> str:
    """The choice the environment's `BITDELTA_CPU_PRECISION` gives (unset: auto)."""
    env = os.environ if env is None else env
    return check_choice(env.get(ENV, "auto"), ENV)


_choice: str | None = None  # the process's choice: set by configure(), else read once by process_choice()


def configure(choice: str) -> None:
    """Set the process's choice (an entry point, from its flag or config)."""
    global _choice
    _choice = check_choice(choice)


def process_choice() -> str:
    """The process's choice: what `configure` set, else `BITDELTA_CPU_PRECISION` (read once)."""
    global _choice
    if _choice is None:
        _choice = choice_from_env()
    return _choice


def cpu_precision(choice: str | None = None) -> Precision:
    """The precision for training and running torch models on this CPU (the rule above), under
    `choice` (default: the process's)."""
    choice = _resolve(choice)
    native, why = native_bf16()
    if choice == "fp32":
        return Precision("fp32", f"forced by {ENV}=fp32; {why}", "env")
    if choice == "bf16":
        note = "" if native else " (emulated: slow)"
        return Precision("bf16", f"forced by {ENV}=bf16; {why}{note}", "env")
    return Precision("bf16" if native else "fp32", why, "cpu flags")


def _resolve(value: str | None) -> str:
    return process_choice() if value is None else check_choice(value)


def precision_for(device, choice: str | None = None) -> Precision:
    """The training precision on `device` (a torch.device or "cpu"/"cuda"); `choice` as in
    `cpu_precision`."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        return Precision("bf16", "CUDA: bf16 tensor cores", "cuda")
    if kind != "cpu":
        return Precision("fp32", f"{kind}: no bf16 rule for this device", "default")
    return cpu_precision(choice)


def autocast(device, choice: str | None = None):
    """torch.autocast to `precision_for(device, choice)`: bf16 autocast where the rule says
    bf16, a disabled autocast (plain fp32) otherwise."""
    import torch

    kind = getattr(device, "type", None) or str(device).split(":")[0]
    p = precision_for(kind, choice)
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=p.name == "bf16")


def serving_dtype(device, choice: str | None = None) -> Precision:
    """The weights' dtype for the worker's `--dtype auto` (and the benchmarks' default): the same
    rule as training (`precision_for`): bf16 on CUDA; on CPU bf16 where the CPU has native bf16
    (the C kernels' GEMVs read bf16 weights at their bandwidth, half of fp32's bytes; they
    accumulate in fp32), fp32 elsewhere; the choice (default: the process's) overrides."""
    return precision_for(device, choice)


__all__ = [
    "ENV",
    "Precision",
    "autocast",
    "check_choice",
    "choice_from_env",
    "configure",
    "cpu_precision",
    "native_bf16",
    "precision_for",
    "process_choice",
    "serving_dtype",
]
