/* CPU kernels for 1-bit deltas, loaded with ctypes by bitdelta_kernels/cpu_build.py.
 *
 * Plain C (no torch headers) so that it compiles in about a second and does
 * not depend on the torch ABI; -march=native picks the SIMD path of the host.
 *
 * Bit convention (bitdelta_kernels/bits.py): column k of a row is bit (k mod 8) of
 * byte k/8, LSB first; bit 1 = +1, bit 0 = -1. So 16 consecutive columns
 * starting at a multiple of 16 are exactly the little-endian uint16 at byte
 * 2j: that word IS an AVX-512 lane mask, and no bit is ever unpacked.
 *
 * Σ_k x_k s_k = 2 Σ_{k: bit=1} x_k − Σ_k x_k, so the delta GEMV only sums x
 * over set bits and corrects with Σx once: by lookups in x's tables of 4 columns,
 * on AVX-512 in fp32 (or bf16), 16 sign rows per vector, on AVX2 in int16 (VPSHUFB),
 * 16 rows by 2 bytes per vector (lut_sums); the fused one-pass GEMV by one masked add
 * per 16 columns.
 *
 * All matrices are fp32 row-major with a leading-dimension argument unless
 * said otherwise; n_threads is the caller's torch.get_num_threads(), the
 * calling thread and n_threads − 1 helpers of the library's own pool (pool_run).
 *
 * One translation unit in parts (so that the compiler inlines across them): this file (the build's
 * ISA, the CPU's choices, the weight dtypes) includes, in order, pool.h (the thread pool), planes.h
 * (the delta GEMV of sign planes and a mixed batch's planes), merge.h (W + α·S into a dense
 * matrix), linear.h (the GEMV with its planes), attention.h (paged decode attention) and decode.h
 * (the decode layers). Each part uses only what the parts before it define.
 */
#define _GNU_SOURCE /* pthreads under -std=c11 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BD_ISA_SCALAR 0
#define BD_ISA_AVX2 1
#define BD_ISA_AVX512 2
#define BD_ISA_AVX512BF16 3 /* AVX-512 with AVX512-BF16's dot product (vdpbf16ps) */

/* Which SIMD path this build took (for the log line and the benchmark). */
int bd_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return BD_ISA_AVX512BF16;
#elif defined(__AVX512F__)
    return BD_ISA_AVX512;
#elif defined(__AVX2__)
    return BD_ISA_AVX2;
#else
    return BD_ISA_SCALAR;
#endif
}

/* Up to 16 sign bits for columns [16j, 16j+16) of a row with n_bytes bytes;
 * only whole bytes inside the row are read (the last row ends the buffer). */
static inline uint32_t load_bits16(const uint8_t *row, int64_t j, int64_t n_bytes) {
    int64_t b = 2 * j;
    uint32_t lo = row[b];
    uint32_t hi = (b + 1 < n_bytes) ? row[b + 1] : 0u;
    return lo | (hi << 8);
}

/* Whether the table loop takes a full block's dwords from gathers (1) or from its 16 rows' loads
 * and a transpose (0). The two give the same lanes, so the same sums bit for bit; what differs is
 * speed. VPGATHERDD is fast on Intel cores (an Intel Xeon: 57 weights/ns instead of 49 on
 * SmolLM2's 576 columns) and slow on AMD's (an AMD EPYC of the Zen 5 generation, one core: the
 * loads and the transpose 77–85 weights/ns, the gathers 46–50; docs/kernels.md). Set once at load
 * by the CPU's vendor; AVX-512 builds only (the AVX2 loop loads and transposes). */
static int gather_rows = 0;

/* Whether the AVX-512 build's one-weight-row GEMV blocks (R = 1: one or two x rows, a single
 * stream's decode) request their weight stream's lines ahead (STREAM_PREFETCH). They gain on a Zen 5
 * core (below) and lose on a Zen 4 one, where the hardware prefetchers alone keep that light loop
 * near a plain read: one core of a 2-core AMD EPYC of the Zen 4 generation, SmolLM2-135M's 30
 * layers and head back to back, one row, best of 7 (2026-12-04): fp32 25.4–30.2 GB/s without, 20.1–20.9
 * with, bf16 22.1–24.7 against 19.5–22.8 (a sum over as many bytes 29–32.6; docs/kernels.md). Set
 * once at load: off on AMD's family 19h (in an AVX-512 build, Zen 4; Zen 3 has no AVX-512); the
 * numbers are the same either way (bd_set_stream_prefetch forces it, for tests and benchmarks).
 * AVX-512 builds only. */
static int one_row_prefetch = 1;

static int cpu_gathers_fast(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
}

static int cpu_one_row_prefetch(void) {
#if defined(__AVX512F__)
    __builtin_cpu_init();
    return !(__builtin_cpu_is("amd") && __builtin_cpu_is("amdfam19h"));
#else
    return 1; /* unused: the AVX2 build's blocks choose at compile time (BLOCK_PREFETCH) */
#endif
}

__attribute__((constructor)) static void choose_by_cpu(void) {
    gather_rows = cpu_gathers_fast();
    one_row_prefetch = cpu_one_row_prefetch();
}

/* bd_set_gather(1 | 0 | −1): force the gathers, the loads and transpose, or the CPU's choice (tests
 * and benchmarks run both; not while a call runs); returns the choice now in force. */
int bd_set_gather(int on) {
    gather_rows = on < 0 ? cpu_gathers_fast() : !!on;
    return gather_rows;
}

/* Force the one-row blocks' stream prefetch on (1) or off (0), or back to the CPU's choice (−1);
 * returns the setting now. */
int bd_set_stream_prefetch(int on) {
    one_row_prefetch = on < 0 ? cpu_one_row_prefetch() : !!on;
    return one_row_prefetch;
}

/* ---------------------------------------------------------------------- */
/* weight dtypes                                                          */
/* ---------------------------------------------------------------------- */
#define BD_W_NONE 0  /* no base: out = α·s (the unpacked, scaled delta) */
#define BD_W_F32 1
#define BD_W_BF16 2
#define BD_W_F16 3

static inline float w_at(const void *w, int w_dtype, int64_t i) {
    switch (w_dtype) {
    case BD_W_F32: return ((const float *)w)[i];
    case BD_W_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case BD_W_F16: {
        /* IEEE half → float without F16C (scalar tail / portable path) */
        uint16_t h = ((const uint16_t *)w)[i];
        uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
        if (e == 0) {
            if (m == 0) u = sign;
            else {  /* subnormal: renormalise */
                e = 127 - 15 + 1;
                while (!(m & 0x400)) { m <<= 1; --e; }
                u = sign | (e << 23) | ((m & 0x3ff) << 13);
            }
        } else if (e == 31) u = sign | 0x7f800000u | (m << 13);
        else u = sign | ((e + 127 - 15) << 23) | (m << 13);
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    default: return 0.f;
    }
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, like torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_out(void *out, int out_dtype, int64_t i, float v) {
    if (out_dtype == BD_W_F32) ((float *)out)[i] = v;
    else if (out_dtype == BD_W_BF16) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((_Float16 *)out)[i] = (_Float16)v;
}

#include "pool.h"
#include "planes.h"
#include "merge.h"
#include "linear.h"
#include "attention.h"
#include "decode.h"
