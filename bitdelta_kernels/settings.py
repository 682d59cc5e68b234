"""How the kernels run in this process: one typed settings object, resolved at the edge.

`current()` is the process's `KernelSettings`: what an entry point set with `configure()`,
or else, the first time a kernel asks, the environment's documented aliases read once
(`KernelSettings.from_env`). No kernel call reads the environment. A caller that has its
own configuration passes it down instead (the worker's `--kernel-backend` reaches every
kernel call as `backend=`).

    field                variable (alias)                     default
    backend              BITDELTA_KERNEL_BACKEND=auto|triton|cpu|torch   auto (dispatch.backend_for)
    interpret_max_work   BITDELTA_INTERPRET_MAX_WORK=N         2^24 multiply-adds
    cpu_kernels          BITDELTA_CPU_KERNELS=0|1              1 (0: never build the C kernels)
    cpu_isa              BITDELTA_CPU_ISA=native|avx512bf16|avx512|avx2|scalar   native (cpu_build)
    build_dir            BITDELTA_KERNELS_BUILD_DIR=DIR        the checkout's build/, else ~/.cache
    prebuilt_dir         BITDELTA_KERNELS_PREBUILT_DIR=DIR     none (libraries built ahead of time by
                                                               `python -m bitdelta_kernels.cpu_build --prebuild`)
    configs_file         BITDELTA_KERNEL_CONFIGS=FILE          bitdelta_kernels/configs.json (configs)
    cc                   CC=compiler                           cc, then gcc, then clang
    batch_invariant      BITDELTA_BATCH_INVARIANT=0|1          0 (1: a row's numbers never depend on its
                                                               batch: the CPU kernels' per-row paths at every
                                                               row count; docs/kernels.md, "Batch invariance")

Triton's own `TRITON_INTERPRET` is not a setting: Triton reads it when the kernels are
defined (`configs.interpreting`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("auto", "triton", "cpu", "torch")
ISAS = ("native", "avx512bf16", "avx512", "avx2", "scalar")
# Largest M·N·K run by the Triton interpreter through the public functions (≈0.1–1 s): the
# interpreter costs ~1 ms per program × K-step, so a real model layer would take seconds.
INTERPRET_MAX_WORK = 1 << 24
ENV = {
    "backend": "BITDELTA_KERNEL_BACKEND",
    "interpret_max_work": "BITDELTA_INTERPRET_MAX_WORK",
    "cpu_kernels": "BITDELTA_CPU_KERNELS",
    "cpu_isa": "BITDELTA_CPU_ISA",
    "build_dir": "BITDELTA_KERNELS_BUILD_DIR",
    "prebuilt_dir": "BITDELTA_KERNELS_PREBUILT_DIR",
    "configs_file": "BITDELTA_KERNEL_CONFIGS",
    "cc": "CC",
    "batch_invariant": "BITDELTA_BATCH_INVARIANT",
}


@dataclass(frozen=True)
class KernelSettings:
    """The kernels' configuration (table above); checked when built."""

    backend: str = "auto"
    interpret_max_work: int = INTERPRET_MAX_WORK
    cpu_kernels: bool = True
    cpu_isa: str = "native"
    build_dir: Path | None = None
    prebuilt_dir: Path | None = None
    configs_file: Path | None = None
    cc: str | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.cpu_isa not in ISAS:
            raise ValueError(f"CPU ISA {self.cpu_isa!r}: use one of {', '.join(ISAS)}")
        if self.interpret_max_work < 0:
            raise ValueError(f"interpret_max_work must be >= 0, got {self.interpret_max_work}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings the environment's aliases give (unset or empty: the default); a bad
        value is a ValueError naming its variable."""
        env = os.environ if env is None else env
        values = {}
        for name, var in ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                if name == "interpret_max_work":
                    values[name] = int(raw)
                elif name in ("cpu_kernels", "batch_invariant"):
                    if raw not in ("0", "1"):
                        raise ValueError("use 0 or 1")
                    values[name] = raw == "1"
                elif name in ("build_dir", "prebuilt_dir", "configs_file"):
                    values[name] = Path(raw).expanduser()
                elif name in ("backend", "cpu_isa"):
                    values[name] = raw.lower()
                else:
                    values[name] = raw
                cls(**{name: values[name]})  # each value checked on its own, so the error names its variable
            except ValueError as e:
                raise ValueError(f"{var}={raw!r}: {e}") from None
        return cls(**values)


_current: KernelSettings | None = None


def current() -> KernelSettings:
    """The process's settings (from the environment, once, unless `configure` set them)."""
    global _current
    if _current is None:
        _current = KernelSettings.from_env()
    return _current


def configure(settings: KernelSettings) -> KernelSettings:
    """Make `settings` the process's (an entry point, from its configuration); returns the
    previous ones. The C library is loaded again for new CPU settings on its next use."""
    global _current
    previous = current()
    _current = settings
    return previous


@contextlib.contextmanager
def configured(**changes) -> Iterator[KernelSettings]:
    """The process's settings with `changes` for the block, then the previous ones again.
    For tests and benchmarks that compare backends or builds in one process."""
    previous = configure(dataclasses.replace(current(), **changes))
    try:
        yield current()
    finally:
        configure(previous)
