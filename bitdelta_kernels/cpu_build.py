"""Build (once) and load the C CPU kernels in `csrc/` (`bitdelta_cpu.c` and the parts it includes).

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
portable C path (-march=x86-64), `avx512` the AVX-512 level (-march=x86-64-v4),
`avx512bf16` that with AVX512-BF16 (-mavx512bf16).
Writes go to a temporary file that is then renamed, so concurrent first builds
(pytest workers, server processes) are safe.

An image without a compiler ships libraries built ahead of time for fixed targets:
`python -m bitdelta_kernels.cpu_build --prebuild DIR --isa avx512bf16 --isa avx512 --isa avx2 --isa scalar`
writes one per ISA into DIR, named by a hash of the source and flags only (a
fixed target does not depend on the build host's CPU). With the setting
`prebuilt_dir` pointing there, the process loads the best of them the CPU can run
(checked against its /proc/cpuinfo flags, ISA_NEEDS; `cpu_isa` other than native
asks for that one), without a compiler; a library of another source is never
loaded, and with none that fits, the build below runs as without the setting.

If no compiler is found or the build fails, `load_cpu_lib()` returns None and
logs ONE warning; callers then use the pure-torch path.

Settings (`bitdelta_kernels.settings`, with their environment aliases):
    cpu_kernels=False   BITDELTA_CPU_KERNELS=0          never build/load (force the torch path)
    cpu_isa             BITDELTA_CPU_ISA=native|avx512bf16|avx512|avx2|scalar   which SIMD path to build (default
                                    native: whatever the host has; the others must run here)
    build_dir           BITDELTA_KERNELS_BUILD_DIR=DIR  where to cache the library
    prebuilt_dir        BITDELTA_KERNELS_PREBUILT_DIR=DIR  libraries built by --prebuild, loaded first
    cc                  CC=...                          the C compiler (default: cc, then gcc)
The process's library is the one for the current settings: new CPU settings
(`bitdelta_kernels.settings.configure`) load theirs on next use.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from bitdelta_kernels.settings import ENV, KernelSettings, current

log = logging.getLogger("bitdelta_kernels")

SOURCE = Path(__file__).with_name("csrc") / "bitdelta_cpu.c"  # includes the other parts of csrc/


def _source_text() -> str:
    """The library's whole source: SOURCE and the parts beside it that it includes (csrc/*.h), in
    name order, for the build's cache key."""
    parts = [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]
    return "\0".join(f"{p.name}\0{p.read_text()}" for p in parts)


CFLAGS = ["-O3", "-pthread", "-shared", "-fPIC", "-std=c11"]
COMPILE_TIMEOUT_S = 120

ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512bf16"}
ISA_ENV = ENV["cpu_isa"]
# Build request -> target flags. x86-64-v3 is the AVX2 level (AVX2, FMA, F16C, BMI1/2,
# MOVBE): what an AVX2-only EPYC or Core runs. x86-64 is the baseline (SSE2): the
# library's portable C loops, which the compiler may still vectorise with SSE2.
# x86-64-v4 adds AVX-512 F, BW, CD, DQ and VL (Skylake-SP and later, Zen 4); avx512bf16 adds
# AVX512-BF16's dot product (Cooper Lake, Sapphire Rapids and later, Zen 4), which the bf16 GEMV
# uses: a host build with it (-march=native there) and one without it round differently.
ISA_MARCH = {
    "native": ("-march=native",),
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16"),
    "avx512": ("-march=x86-64-v4",),
    "avx2": ("-march=x86-64-v3",),
    "scalar": ("-march=x86-64",),
}
# CPU flags (/proc/cpuinfo) a build needs at run time; checked before loading so a
# forced build never dies of SIGILL on a CPU without them.
_AVX2_NEEDS = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
ISA_NEEDS = {
    "native": (),
    "avx512bf16": (*_AVX2_NEEDS, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"),
    "avx512": (*_AVX2_NEEDS, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "avx2": _AVX2_NEEDS,
    "scalar": (),
}
# The fixed targets `--prebuild` can build, best first (the order a prebuilt directory is tried in).
PREBUILT_ISAS = ("avx512bf16", "avx512", "avx2", "scalar")

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


def _host_lacks(isa: str) -> list[str]:
    """The CPU flags `isa`'s build needs that this host lacks (non-x86: all of a fixed target's)."""
    import platform

    if isa == "native":
        return []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"x86-64 (this host is {platform.machine()})"]
    flags = set(_cpu_fingerprint().split(":", 1)[-1].split())
    return [f for f in ISA_NEEDS[isa] if f not in flags]


def _check_host(isa: str) -> None:
    """Refuse a forced build the host cannot run (it would crash with SIGILL, not fail)."""
    missing = _host_lacks(isa)
    if missing:
        raise RuntimeError(f"{ISA_ENV}={isa} needs CPU flags this host lacks: {', '.join(missing)}")


def _compile(cc: str, isa: str, lib_path: Path, source: Path | None = None) -> None:
    """Compile `source` (SOURCE: this checkout's) for `isa` into `lib_path` through a temporary
    file and a rename."""
    source = source or SOURCE
    build_dir = lib_path.parent
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, *ISA_MARCH[isa], "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source}: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o644)  # not mkstemp's 0600: an image's runtime user is not the one that built it
        os.replace(tmp, lib_path)
        log.info("kernels: built %s", lib_path)
        for old in build_dir.glob(f"libbitdelta_cpu_{isa}_*.so"):  # builds of older sources (a running
            if old != lib_path:  # process keeps its mapping of a removed file)
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cc: str, build_dir: Path, isa: str = "native") -> Path:
    _check_host(isa)
    flags = [*CFLAGS, *ISA_MARCH[isa]]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([_source_text(), " ".join(flags), version, _cpu_fingerprint()]).encode()
    ).hexdigest()[:16]
    lib_path = build_dir / f"libbitdelta_cpu_{isa}_{key}.so"
    if not lib_path.exists():
        _compile(cc, isa, lib_path)
    return lib_path


def _prebuilt_path(prebuilt_dir: Path, isa: str) -> Path:
    """Where `--prebuild` puts (and the loader looks for) `isa`'s library of the current source."""
    key = hashlib.sha256("\0".join([_source_text(), " ".join([*CFLAGS, *ISA_MARCH[isa]])]).encode())
    return prebuilt_dir / f"libbitdelta_cpu_{isa}_{key.hexdigest()[:16]}.so"


def prebuild(prebuilt_dir: Path, isas: Sequence[str], cc: str | None = None) -> list[Path]:
    """Compile the library for each fixed target in `isas` (PREBUILT_ISAS) into `prebuilt_dir`,
    for CPUs other than this one (an image build): nothing is checked against this host."""
    bad = [isa for isa in isas if isa not in PREBUILT_ISAS]
    if bad or not isas:
        raise ValueError(f"prebuilt ISAs must be some of {', '.join(PREBUILT_ISAS)}, got {list(isas)}")
    cc = cc or _compiler()
    if cc is None or not shutil.which(cc):
        raise RuntimeError(f"no C compiler found ({cc or 'set CC'})")
    paths = [_prebuilt_path(prebuilt_dir, isa) for isa in isas]
    for isa, path in zip(isas, paths, strict=True):
        _compile(cc, isa, path)
    return paths


def _find_prebuilt(isa: str) -> Path | None:
    """The prebuilt library to load for the `cpu_isa` request, None without one (or without the
    setting). native: the best the CPU runs; another request: that one, refused if it cannot."""
    prebuilt_dir = current().prebuilt_dir
    if prebuilt_dir is None:
        return None
    if isa != "native":
        _check_host(isa)
    for candidate in PREBUILT_ISAS if isa == "native" else (isa,):
        path = _prebuilt_path(prebuilt_dir, candidate)
        if not _host_lacks(candidate) and path.exists():
            return path
    return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.bd_isa.restype = i32
    lib.bd_isa.argtypes = []
    # 1 | 0 | -1: the table loop's gathers, its loads and transpose, or the CPU's choice (same sums)
    lib.bd_set_gather.restype = i32
    lib.bd_set_gather.argtypes = [i32]
    # 1 | 0 | -1: the AVX-512 one-weight-row GEMV blocks' stream prefetch on, off, or the CPU's choice (same sums)
    lib.bd_set_stream_prefetch.restype = i32
    lib.bd_set_stream_prefetch.argtypes = [i32]
    # dtype (BD_W_*), rows -> the planes of one variant the decode layers' `fuse` sums in the weights' pass
    lib.bd_one_pass_planes.restype = i32
    lib.bd_one_pass_planes.argtypes = [i32, i64]
    # x, M, ldx, s, d_out, d_in, lds, alpha, alpha_stride, y, ldy, method, x_is_bf16, n_threads
    lib.bd_delta_gemv.restype = i32
    lib.bd_delta_gemv.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, p, i64, i32, i32, i32]
    # w, w_dtype, ldw, s, lds, alpha, alpha_stride, r0, r1, d_in, out, out_dtype, ldo, n_threads
    lib.bd_merge.restype = None
    lib.bd_merge.argtypes = [p, i32, i64, p, i64, p, i64, i64, i64, i64, p, i32, i64, i32]
    # x, M, ldx, s, stride_sv, d_out, d_in, lds, alpha, stride_av, alpha_stride, row_slots, n_planes,
    # col_alpha, stride_cv, stride_cg, bounds, n_groups, y, ldy, x_is_bf16, n_threads
    lib.bd_delta_batched.restype = i32
    lib.bd_delta_batched.argtypes = [
        p,
        i64,
        i64,
        p,
        i64,
        i64,
        i64,
        i64,
        p,
        i64,
        i64,
        p,
        i64,
        p,
        i64,
        i64,
        p,
        i64,
        p,
        i64,
        i32,
        i32,
    ]
    # x, M, ldx, w, w_dtype, ldw, s, d_out, d_in, lds, alpha, alpha_stride, y, ldy, x_is_bf16, two_pass, n_threads
    lib.bd_linear_gemv.restype = i32
    lib.bd_linear_gemv.argtypes = [p, i64, i64, p, i32, i64, p, i64, i64, i64, p, i64, p, i64, i32, i32, i32]
    # q, B, H, KV, D, k, v, kv_dtype, tables, max_blocks, lens, bs, window, scale, out, n_threads
    lib.bd_paged_decode.restype = i32
    f32 = ctypes.c_float
    lib.bd_paged_decode.argtypes = [p, i64, i64, i64, i64, p, p, i32, p, i64, p, i64, i64, f32, f32, p, i32]
    # layers, n_layers, n_slots, x_in, tokens, embed, n_vocab, n_embeds, embed_weight[], embed_signs[],
    # embed_alpha[], embed_planes[], embed_of_row, x_out, B, row_slot (int32), row_planes (int32),
    # n_planes, dim, H, KV, hd, F, eps, dtype, rope_cos, rope_sin, rope_dtype, rope_rows, n_rope, write_rows,
    # tables, max_blocks, lens, bs, scale, final_norm, head, vocab, n_heads, head_signs[],
    # head_alpha[], head_alpha_stride[], head_of_row, logits, n_threads, fuse, lowrank[]
    f32 = ctypes.c_float
    lib.bd_decode_layers.restype = i32
    lib.bd_decode_layers.argtypes = [
        *(p, i64, i64, p, p, p, i64, i64, p, p, p, p, p, p),
        *(i64, p, p, i64, i64, i64, i64, i64, i64, f32, i32, p, p, i32, p, i64),
        *(p, p, i64, p, i64, f32, p, p, i64, i64, p, p, p, p, p, i32, i32, p, p),
    ]
    lib.bd_argmax_rows.restype = None
    lib.bd_argmax_rows.argtypes = [p, i64, i64, p]
    lib.bd_decode_steps.restype = i64
    # bd_decode_layers' arguments, then the burst's own (steps, stop flag, deadline, tokens, times)
    lib.bd_decode_steps.argtypes = [*lib.bd_decode_layers.argtypes, i64, p, ctypes.c_double, p, p]


def _library_path(isa: str) -> Path:
    """The library for an ISA request: the prebuilt one if the settings have one that fits,
    else this host's build (compiled once)."""
    if isa not in ISA_MARCH:
        raise ValueError(f"unknown ISA {isa!r}: use one of {', '.join(ISA_MARCH)}")
    prebuilt = _find_prebuilt(isa)
    if prebuilt is not None:
        return prebuilt
    cc = _compiler()
    if cc is None:
        where = f"no prebuilt library for it in {current().prebuilt_dir} and " if current().prebuilt_dir else ""
        raise RuntimeError(f"{where}no C compiler found (set CC)")
    return _build(cc, _default_build_dir(), isa)


def load_variant(isa: str) -> ctypes.CDLL:
    """Load (building it once if needed) the library for one ISA ("native", "avx512", "avx2",
    "scalar") apart from the process-wide one; raises when that is impossible here. For tests
    and benchmarks that compare the SIMD paths on one machine."""
    return _open(_library_path(isa))


def load_source(source: Path, isa: str = "native") -> ctypes.CDLL:
    """Build (into a temporary directory, every call) and load the library from another source
    of it: its bitdelta_cpu.c, whose parts (csrc/*.h) it includes from its own directory, e.g. an
    older version's csrc/ (`git archive REV bitdelta_kernels/csrc | tar -x -C DIR`): a benchmark's
    before and after in one process (`bench/kernels.py --decode-layers --against`). Raises when it
    cannot be built."""
    _check_host(isa)
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    out = Path(tempfile.mkdtemp()) / f"libbitdelta_cpu_{isa}_source.so"
    _compile(cc, isa, out, source)
    return _open(out)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
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
            path = _library_path(settings.cpu_isa)
            lib = _open(path)
            log.info("kernels: C CPU kernels loaded (%s, %s)", ISA_NAMES.get(lib.bd_isa(), "?"), path)
        except Exception as e:  # any failure means: use the torch path
            unavailable_reason = str(e)
            log.warning("kernels: C CPU kernels unavailable (%s); using the pure-torch unpack path (slow)", e)
        _lib, _loaded_for = lib, settings
        return _lib


def cpu_isa() -> str:
    """'avx512' | 'avx2' | 'scalar' for the loaded library, 'torch' without one."""
    lib = load_cpu_lib()
    return "torch" if lib is None else ISA_NAMES.get(lib.bd_isa(), "?")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bitdelta_kernels.cpu_build",
        description="Build the C CPU kernels ahead of time for fixed targets (for an image without a compiler).",
    )
    parser.add_argument("--prebuild", type=Path, required=True, metavar="DIR", help="directory to write into")
    parser.add_argument(
        "--isa", action="append", choices=PREBUILT_ISAS, help="target (repeatable; default: all of them)"
    )
    parser.add_argument("--cc", help="the C compiler (default: the cc setting, then cc, gcc, clang)")
    args = parser.parse_args(argv)
    try:
        paths = prebuild(args.prebuild, args.isa or PREBUILT_ISAS, args.cc)
    except (RuntimeError, ValueError) as e:
        print(f"cpu_build: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
