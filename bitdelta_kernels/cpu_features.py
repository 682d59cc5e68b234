"""What this CPU can do natively, as the kernels and the precision rule need it: read once.

`native_bf16()` decides two things from the same facts: the project's precision rule
(`bitdelta.precision`: train and serve in bf16 only where it is native) and how the CPU
prefill multiplies bf16 matrices (`cpu_ops.mm_nt`: torch's bf16 GEMM where it is native,
else widened to fp32, which an AVX2 CPU runs several times faster than torch's emulated bf16).

x86 needs the avx512_bf16 or amx_bf16 flag AND torch dispatching to its AVX-512 kernels
(`ATEN_CPU_CAPABILITY=avx2` or an old torch leaves bf16 emulated even on such a CPU); Arm
needs the bf16 feature.
"""

from __future__ import annotations

import functools
from pathlib import Path

# CPU flags (/proc/cpuinfo "flags" on x86, "Features" on Arm) that mean native bf16 dot products.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags, or None where /proc/cpuinfo is unreadable (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def torch_capability() -> str:
    """torch's own view of the CPU's SIMD level ("AVX512", "AVX2", "DEFAULT", …)."""
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # an old or unusual torch: the flags decide alone
        return "unknown"


@functools.lru_cache(maxsize=1)
def native_bf16() -> tuple[bool, str]:
    """(whether this CPU has native bf16 dot products that torch uses, why), checked once per process."""
    cap = torch_capability()
    flags = cpu_flags()
    if flags is None:
        return False, f"CPU flags unreadable (torch capability {cap}); assuming no native bf16"
    found = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    x86 = "sse2" in flags or "avx2" in flags or any(f.startswith("avx512") for f in flags)
    if found and x86 and not cap.upper().startswith(("AVX512", "AMX")):
        return False, f"no native bf16 in torch here (CPU has {', '.join(found)} but torch dispatches {cap})"
    if found:
        return True, f"native bf16 on this CPU ({cap}; {', '.join(found)})"
    return False, f"no native bf16 on this CPU ({cap}; no {'/'.join(NATIVE_BF16_FLAGS[:2])} flag)"
