"""Build (once) and load the C CPU kernels in `csrc/bitdelta_cpu.c`.

Why a plain C library through ctypes rather than a torch C++ extension: it
compiles in about a second (torch/extension.h alone costs ~40 s per build),
does not depend on the torch ABI (the same source serves torch 2.11 and 2.13),
and ctypes releases the GIL during the call. The library is compiled for the
host CPU (-march=native) into a directory keyed by a hash of the source, the
flags, the compiler and the CPU's feature flags, so a copied build directory
never runs code for the wrong CPU. The setting `cpu_isa="avx2"` builds the AVX2
path instead (-march=x86-64-v3: AVX2 + FMA, no AVX-512) on a host that has
AVX-512, so the code an AVX2-only machine runs is tested everywhere (the tests
also load it explicitly with `load_variant("avx2")`); `scalar` builds the
portable C path (-march=x86-64). Writes go to a temporary file that is then
renamed, so concurrent first builds (pytest workers, server processes) are safe.

If no compiler is found or the build fails, `load_cpu_lib()` returns None and
logs ONE warning; callers then use the pure-torch path.

Settings (`kernels.settings`, with their environment aliases):
    cpu_kernels=False   BITDELTA_CPU_KERNELS=0          never build/load (force the torch path)
    cpu_isa             BITDELTA_CPU_ISA=native|avx2|scalar   which SIMD path to build (default
                                    native: whatever the host has; the others must run here)
    build_dir           BITDELTA_KERNELS_BUILD_DIR=DIR  where to cache the library
    cc                  CC=...                          the C compiler (default: cc, then gcc)
The process's library is the one for the current settings: new CPU settings
(`kernels.settings.configure`) load theirs on next use.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401  # loads libgomp.so.1 first so the library shares torch's OpenMP runtime

from kernels.settings import ENV, KernelSettings, current

log = logging.getLogger("kernels")

SOURCE = Path(__file__).with_name("csrc") / "bitdelta_cpu.c"
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
COMPILE_TIMEOUT_S = 120

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
ISA_ENV = ENV["cpu_isa"]
# Build request -> target flags. x86-64-v3 is the AVX2 level (AVX2, FMA, F16C, BMI1/2,
# MOVBE): what an AVX2-only EPYC or Core runs. x86-64 is the baseline (SSE2): the
# library's portable C loops, which the compiler may still vectorise with SSE2.
ISA_MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3", "scalar": "-march=x86-64"}
# CPU flags (/proc/cpuinfo) a build needs at run time; checked before loading so a
# forced build never dies of SIGILL on a CPU without them.
ISA_NEEDS = {"native": (), "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"), "scalar": ()}

_lock = threading.Lock()
# The settings the process's library was loaded (or found unavailable) for, and the result.
_loaded_for: KernelSettings | None = None
_lib: ctypes.CDLL | None = None
unavailable_reason: str | None = None


def _default_build_dir() -> Path:
    if current().build_dir is not None:
        return current().build_dir
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").exists() and os.access(repo, os.W_OK):  # a checkout: its ignored /build/
        return repo / "build" / "kernels_cpu"
    return Path.home() / ".cache" / "bitdelta" / "kernels_cpu"  # an installed package


def _cpu_fingerprint() -> str:
    """The host's ISA flags: a -march=native binary is only valid where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (current().cc, "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _check_host(isa: str) -> None:
    """Refuse a forced build the host cannot run (it would crash with SIGILL, not fail)."""
    import platform

    if isa == "native":
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"{ISA_ENV}={isa} is an x86-64 build; this host is {platform.machine()}")
    flags = set(_cpu_fingerprint().split(":", 1)[-1].split())
    missing = [f for f in ISA_NEEDS[isa] if f not in flags]
    if missing:
        raise RuntimeError(f"{ISA_ENV}={isa} needs CPU flags this host lacks: {', '.join(missing)}")


def _build(cc: str, build_dir: Path, isa: str = "native") -> Path:
    _check_host(isa)
    flags = [*CFLAGS, ISA_MARCH[isa]]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_fingerprint()]).encode()
    ).hexdigest()[:16]
    lib_path = build_dir / f"libbitdelta_cpu_{isa}_{key}.so"
    if lib_path.exists():
        return lib_path
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib_path)
        log.info("kernels: built %s", lib_path)
        for old in build_dir.glob(f"libbitdelta_cpu_{isa}_*.so"):  # builds of older sources (a running
            if old != lib_path:  # process keeps its mapping of a removed file)
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib_path


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.bd_isa.restype = i32
    lib.bd_isa.argtypes = []
    # x, M, ldx, s, d_out, d_in, lds, alpha, alpha_stride, y, ldy, method, n_threads
    lib.bd_delta_gemv.restype = i32
    lib.bd_delta_gemv.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, p, i64, i32, i32]
    # w, w_dtype, ldw, s, lds, alpha, alpha_stride, r0, r1, d_in, out, out_dtype, ldo, n_threads
    lib.bd_merge.restype = None
    lib.bd_merge.argtypes = [p, i32, i64, p, i64, p, i64, i64, i64, i64, p, i32, i64, i32]
    # x, M, ldx, s, stride_sv, d_out, d_in, lds, alpha, stride_av, alpha_stride, row_variant, y, ldy, n_threads
    lib.bd_delta_batched.restype = i32
    lib.bd_delta_batched.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, i64, i64, p, p, i64, i32]
    # x, M, ldx, w, w_dtype, ldw, s, d_out, d_in, lds, alpha, alpha_stride, y, ldy, n_threads
    lib.bd_linear_gemv.restype = i32
    lib.bd_linear_gemv.argtypes = [p, i64, i64, p, i32, i64, p, i64, i64, i64, p, i64, p, i64, i32]


def load_variant(isa: str) -> ctypes.CDLL:
    """Build (once) and load the library for one ISA ("native", "avx2", "scalar") apart
    from the process-wide one; raises when that is impossible here. For tests and
    benchmarks that compare the SIMD paths on one machine."""
    if isa not in ISA_MARCH:
        raise ValueError(f"unknown ISA {isa!r}: use one of {', '.join(ISA_MARCH)}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    lib = ctypes.CDLL(str(_build(cc, _default_build_dir(), isa)))
    _declare(lib)
    return lib


def load_cpu_lib() -> ctypes.CDLL | None:
    """The compiled library for the current settings (`cpu_isa`'s build, native by default),
    building it on first use; None if unavailable (one warning per settings)."""
    global _lib, _loaded_for, unavailable_reason
    settings = current()
    if _loaded_for is settings:
        return _lib
    with _lock:
        if _loaded_for is settings:
            return _lib
        lib, unavailable_reason = None, None
        try:
            if not settings.cpu_kernels:
                raise RuntimeError(f"disabled (cpu_kernels=False, {ENV['cpu_kernels']}=0)")
            lib = load_variant(settings.cpu_isa)
            log.info("kernels: C CPU kernels loaded (%s)", ISA_NAMES.get(lib.bd_isa(), "?"))
        except Exception as e:  # any failure means: use the torch path
            unavailable_reason = str(e)
            log.warning("kernels: C CPU kernels unavailable (%s); using the pure-torch unpack path (slow)", e)
        _lib, _loaded_for = lib, settings
        return _lib


def cpu_isa() -> str:
    """'avx512' | 'avx2' | 'scalar' for the loaded library, 'torch' without one."""
    lib = load_cpu_lib()
    return "torch" if lib is None else ISA_NAMES.get(lib.bd_isa(), "?")
