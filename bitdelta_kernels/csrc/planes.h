/* Part of the CPU kernels' library: the delta GEMV of sign planes (masked adds, x's nibble tables, the byte tables) and a mixed batch's planes. Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

/* ---------------------------------------------------------------------- */
/* delta GEMV, "mask" method: y[m, r] += α_r · Σ_k x[m, k] · s[r, k]       */
/* ---------------------------------------------------------------------- */
/* Rows per register block: 8 independent accumulator chains cover the 3–4
 * cycle add latency at one masked add per cycle. */
#define ROWS 8

/* tot[i] = Σ_{k: bit k of rows[i] set} xm[k] for the ROWS sign rows `rows` (d_in columns): the
 * scalar build's loop (AVX-512 and AVX2 take the table loop, lut_sums). */
static inline void mask_sums(const float *xm, const uint8_t *const *rows, int64_t d_in, float *tot) {
    for (int i = 0; i < ROWS; ++i) {
        float t = 0.f;
        for (int64_t k = 0; k < d_in; ++k)
            if ((rows[i][k >> 3] >> (k & 7)) & 1) t += xm[k];
        tot[i] = t;
    }
}

/* mask_sums of two x rows over the same sign rows. */
static inline void mask_sums2(const float *x0, const float *x1, const uint8_t *const *rows, int64_t d_in,
                              float *t0, float *t1) {
    mask_sums(x0, rows, d_in, t0);
    mask_sums(x1, rows, d_in, t1);
}

#if defined(__AVX512F__)
/* Nibble tables of one x vector (the "four Russians" form of Σ_{bit=1} x): for every group g of
 * 4 columns, T[16·g + n] = Σ_{i < 4, bit i of n set} x[4g + i] in fp32 (added in i order from 0;
 * columns ≥ d_in count as 0), for g < 2·ceil(d_in/8): one table per nibble of a sign row. */
#define HAVE_X_TABLES 1
static inline int64_t x_table_floats(int64_t d_in) { return 2 * ((d_in + 7) / 8) * 16; }

/* Group g's table: lane n = Σ_{i < 4, bit i of n set} x[4g + i], columns ≥ d_in as 0. */
static inline __m512 group_table(const float *x, int64_t d_in, int64_t g) {
    const __mmask16 bit[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00}; /* the lanes n with bit i set */
    __m512 t = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i)
        if (4 * g + i < d_in) t = _mm512_mask_add_ps(t, bit[i], t, _mm512_set1_ps(x[4 * g + i]));
    return t;
}

static void x_row_tables(const float *x, int64_t d_in, float *T) {
    const int64_t n_groups = 2 * ((d_in + 7) / 8);
    for (int64_t g = 0; g < n_groups; ++g) _mm512_storeu_ps(T + 16 * g, group_table(x, d_in, g));
}

#if defined(__AVX512BF16__)
/* bf16 tables, for an x that is exactly bf16 (a bf16 model's activations), in the AVX512-BF16 build:
 * the same entries rounded to bf16 (RNE), two nibble positions to a 32-word register. For dword k of
 * a sign row (32 columns) and n < 4, register 4k + n holds group 8k + n's 16 entries in its words
 * 0–15 and group 8k + n + 4's in 16–31 (groups past the row: 0). One VPERMW then looks up both
 * nibbles n and n + 4 of 16 rows (the word halves of a dword) and one VDPBF16PS against ones adds
 * the pair into the row's fp32 lane: per 8 nibble lookups 4 shifts, 4 VPTERNLOGD (the word
 * indices), 4 lookups and 4 dot products, against 7 shifts, 8 lookups and 8 adds in fp32. On one
 * core of an AMD EPYC of the Zen 4 generation the loop alone summed 1.44–1.52× the weights/ns
 * (512–4096 columns, docs/kernels.md). The price is one bf16 rounding of each entry (a sum of ≤ 4
 * of x's values, relative error ≤ 2⁻⁸, the same order as x's own rounding to bf16); the sums stay
 * fp32. Every path that sums a bf16 row's planes takes these tables (x_is_bf16), so a row's numbers
 * do not depend on its path. */
#define HAVE_BF16_TABLES 1
static inline int64_t x_table_floats_bf16(int64_t d_in) { return 64 * ((d_in + 31) / 32); }

static void x_row_tables_bf16(const float *x, int64_t d_in, float *T) {
    uint16_t *w = (uint16_t *)T;
    for (int64_t k = 0; k < (d_in + 31) / 32; ++k)
        for (int n = 0; n < 4; ++n) {
            const __m512bh t = _mm512_cvtne2ps_pbh(group_table(x, d_in, 8 * k + n + 4), group_table(x, d_in, 8 * k + n));
            _mm512_storeu_si512((void *)(w + 32 * (4 * k + n)), (__m512i)t);
        }
}
#else
#define HAVE_BF16_TABLES 0
#endif

/* 16 × 16 dwords transposed in place: v[k] lane i = dword k of v[i] before. */
static inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int q = 0; q < 4; ++q) {
            t[i + q] = _mm512_shuffle_i32x4(v[i + q], v[i + q + 4], 0x88);
            t[i + q + 4] = _mm512_shuffle_i32x4(v[i + q], v[i + q + 4], 0xdd);
        }
    for (int q = 0; q < 8; ++q) {
        v[q] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0x88);
        v[q + 8] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0xdd);
    }
}

/* Dwords k < ceil(nb/4) of 16 rows' nb ≤ 16 bytes at `at` (row i's at rows[i] + at), transposed like
 * transpose16: v[k] lane i = dword k of row i; bytes beyond nb read as 0. One masked 16-byte load a
 * row (only the rows' own bytes: the last row ends the buffer), 12 inserts and an in-lane 4 × 4
 * transpose, where the 64-byte form loads 16 vectors and runs 64 shuffles for a row's last few
 * bytes (SmolLM2's 576 columns end in 8: ~30 % of the table loop's time on those rows, on an AMD
 * EPYC of the Zen 5 generation; docs/kernels.md). Register i of the four holds the 128-bit rows
 * i, 4 + i, 8 + i, 12 + i, so the transpose inside each 128-bit lane leaves the rows in order. */
static inline void transpose16_tail(const uint8_t *const *rows, int64_t at, int nb, __m512i *v) {
    const __mmask16 m = (__mmask16)((1u << nb) - 1);
#define ROW16(j) _mm_maskz_loadu_epi8(m, rows[j] + at)
    __m512i r[4];
    for (int i = 0; i < 4; ++i)
        r[i] = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(ROW16(i)), ROW16(4 + i), 1), ROW16(8 + i), 2),
            ROW16(12 + i), 3);
#undef ROW16
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* tot_x[i] = Σ_{k: bit k of rows[i] set} x_x[k] for LROWS sign rows and NX (1 or 2) x vectors given
 * by their nibble tables tab[x]. The lanes are the 16 sign rows: per 64 bytes of every row (512
 * columns) one load each, a 16 × 16 dword transpose, then per dword of the rows (32 columns) 8
 * lookups: lane i's nibble n indexes table (8k + n) with one VPERMPS (it reads the index's low 4
 * bits, so a shift by 4n is all the decode), each adding 4 columns' sum where the masked add adds
 * 16 columns per mask register, whose loads bound that loop (1.5–2.1× its speed on one core of an
 * Intel Xeon, 4096², docs/kernels.md). Each
 * lane's adds are the same for NX 1 or 2 and any other rows, in column order into 4 accumulators
 * (nibble n into n mod 4) summed (0 + 1) + (2 + 3): a row's sums depend on its x and bits only. */
#define LROWS 16
#define BLOCK_ROWS LROWS
#define PREFETCH_BLOCKS 2 /* how far ahead the bits are prefetched (1, 4, 8 and 16 measured no better) */
/* The lookups of nn nibbles (from nibble 0) of one transposed dword vk, the tables of nibble 0 at
 * tab[x] + 16·g: constant nn (a whole dword) unrolls into immediate shifts. */
#define LUT_NIBBLES(vk, g, nn)                                                                               \
    for (int n = 0; n < (nn); ++n) {                                                                       \
        const __m512i idx_ = n ? _mm512_srli_epi32(vk, 4 * n) : (vk);                                      \
        for (int x = 0; x < NX; ++x)                                                                       \
            acc[x][n & 3] =                                                                                \
                _mm512_add_ps(acc[x][n & 3], _mm512_permutexvar_ps(idx_, _mm512_loadu_ps(tab[x] + 16 * ((g) + n)))); \
    }
#if HAVE_BF16_TABLES
/* The same from bf16 tables (x_row_tables_bf16): nibbles n and n + 4 at once, the register of
 * nibble 0 at tab[x] + 8·g floats; word indices (nibble n of the low word, 16 + nibble n + 4 of the
 * high one) from one shift and one VPTERNLOGD ((idx & nib16) | upper16). Nibbles past nn are 0
 * bits, whose entries are 0. */
#define LUT_PAIRS(vk, g, nn)                                                                                 \
    for (int n = 0; n < ((nn) < 4 ? (nn) : 4); ++n) {                                                      \
        const __m512i idx_ = _mm512_ternarylogic_epi32(n ? _mm512_srli_epi16(vk, 4 * n) : (vk), nib16, upper16, 0xEA); \
        for (int x = 0; x < NX; ++x)                                                                       \
            acc[x][n] = _mm512_dpbf16_ps(                                                                  \
                acc[x][n], (__m512bh)_mm512_permutexvar_epi16(idx_, _mm512_loadu_si512((const void *)(tab[x] + 8 * (g) + 16 * n))), \
                ones);                                                                                     \
    }
#define LUT_DWORD(vk, g, nn)                                                                                 \
    {                                                                                                      \
        if (BF) {                                                                                          \
            LUT_PAIRS(vk, g, nn)                                                                           \
        } else {                                                                                           \
            LUT_NIBBLES(vk, g, nn)                                                                         \
        }                                                                                                  \
    }
#else
#define LUT_DWORD(vk, g, nn) LUT_NIBBLES(vk, g, nn)
#endif
/* BF: tab[x] are bf16 tables (x_row_tables_bf16), else fp32 ones; both sum each lane in column
 * order into 4 accumulators. */
static inline __attribute__((always_inline)) void lut_sums(const float *const *tab, const int NX, const int BF,
                                                          const uint8_t *const *rows, int64_t n_bytes,
                                                          int64_t row_stride, int64_t ahead, float *const *tot) {
#if HAVE_BF16_TABLES
    const __m512i nib16 = _mm512_set1_epi32(0x000F000F), upper16 = _mm512_set1_epi32(0x00100000);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */
#else
    (void)BF;
#endif
    __m512 acc[2][4];
    for (int x = 0; x < NX; ++x)
        for (int a = 0; a < 4; ++a) acc[x][a] = _mm512_setzero_ps();
    const int64_t nfull = n_bytes / 64;
    const int nb = (int)(n_bytes - 64 * nfull); /* bytes of the last, partial chunk */
    /* rows evenly spaced: lane i's dword k is one gather at byte offset i·row_stride */
    const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)row_stride));
    __m512i v[16];
    for (int64_t c = 0; c < nfull; ++c) {
        for (int i = 0; i < 16; ++i) _mm_prefetch((const char *)(rows[0] + ahead + 64 * (16 * c + i)), _MM_HINT_T0);
        if (row_stride)
            for (int k = 0; k < 16; ++k) {
                const __m512i vk = _mm512_i32gather_epi32(off, (const void *)(rows[0] + 64 * c + 4 * k), 1);
                LUT_DWORD(vk, 128 * c + 8 * k, 8)
            }
        else {
            for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512((const void *)(rows[i] + 64 * c));
            transpose16(v);
            for (int k = 0; k < 16; ++k) LUT_DWORD(v[k], 128 * c + 8 * k, 8)
        }
    }
    if (nb) {
        for (int i = 0; i < 16; ++i)
            _mm_prefetch((const char *)(rows[0] + ahead + 64 * (16 * nfull + i)), _MM_HINT_T0);
        if (row_stride && nb % 4 == 0) /* whole dwords: no byte beyond a row is read */
            for (int k = 0; 4 * k < nb; ++k) {
                const __m512i vk = _mm512_i32gather_epi32(off, (const void *)(rows[0] + 64 * nfull + 4 * k), 1);
                LUT_DWORD(vk, 128 * nfull + 8 * k, 8)
            }
        else { /* only the rows' own bytes (the last row ends the buffer) */
            if (nb <= 32) /* 16 bytes at a time: each a quarter of the shuffles of transpose16 */
                for (int b0 = 0; b0 < nb; b0 += 16) {
                    const int n = nb - b0 < 16 ? nb - b0 : 16;
                    transpose16_tail(rows, 64 * nfull + b0, n, v + b0 / 4);
                }
            else {
                for (int i = 0; i < 16; ++i) v[i] = _mm512_maskz_loadu_epi8((1ull << nb) - 1, rows[i] + 64 * nfull);
                transpose16(v);
            }
            int k = 0;
            for (; 4 * k + 4 <= nb; ++k) LUT_DWORD(v[k], 128 * nfull + 8 * k, 8)
            if (4 * k < nb) LUT_DWORD(v[k], 128 * nfull + 8 * k, 2 * (nb - 4 * k)) /* the nibbles inside the row */
        }
    }
    for (int x = 0; x < NX; ++x)
        _mm512_storeu_ps(tot[x], _mm512_add_ps(_mm512_add_ps(acc[x][0], acc[x][1]), _mm512_add_ps(acc[x][2], acc[x][3])));
}
#undef LUT_DWORD
#undef LUT_NIBBLES
#undef LUT_PAIRS

#elif defined(__AVX2__)
/* The AVX2 table loop: 8 sign rows to a vector, x's tables of 2 columns each (4 entries, held
 * twice: one in each 128-bit half, where VPERMILPS looks up lane i's 2 bits, reading an index's low
 * 2 bits only, so a shift is all the decode). For dword d of a sign row (32 columns) and j < 16,
 * T[128·d + 8·j + 4·h + e] = Σ_{i: bit i of e set} x[32d + 2j + i] over the group's columns (< d_in;
 * added in i order from 0), h = 0, 1. Where the compare-and-mask loop took 5 operations per 8
 * lanes of one column, this takes 3 (shift, lookup, add) per 8 lanes of 2 columns. On an AMD EPYC
 * of the Zen 3 generation the in-lane VPERMILPS ran 1.1–1.65× as fast as 3-column tables looked up
 * by the lane-crossing VPERMPS, though those take a third fewer lookups (docs/kernels.md). */
#define HAVE_X_TABLES 1
#define PAIRS 16 /* tables per dword */
static inline int64_t x_table_floats(int64_t d_in) { return 8 * PAIRS * (((d_in + 7) / 8 + 3) / 4); }

static void x_row_tables(const float *x, int64_t d_in, float *T) {
    const int64_t n_groups = x_table_floats(d_in) / 8;
    for (int64_t g = 0; g < n_groups; ++g) {
        const float x0 = 2 * g < d_in ? x[2 * g] : 0.f, x1 = 2 * g + 1 < d_in ? x[2 * g + 1] : 0.f;
        const float t[4] = {0.f, x0, x1, x0 + x1};
        memcpy(T + 8 * g, t, sizeof(t));
        memcpy(T + 8 * g + 4, t, sizeof(t));
    }
}

/* 8 × 8 dwords transposed in place: v[k] lane i = dword k of v[i] before. */
static inline void transpose8(__m256i *v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 4) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
        t[i + 2] = _mm256_unpacklo_epi32(v[i + 2], v[i + 3]);
        t[i + 3] = _mm256_unpackhi_epi32(v[i + 2], v[i + 3]);
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);     /* dwords 0 | 4 of rows i … i + 3 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]); /* 1 | 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]); /* 2 | 6 */
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]); /* 3 | 7 */
    }
    for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        v[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* Dword d of the 8 rows, bytes beyond n_bytes as 0 (scalar loads: a row's own bytes only). */
static inline __m256i row_dwords(const uint8_t *const *rows, int64_t d, int64_t n_bytes) {
    const int64_t nb = n_bytes - 4 * d < 4 ? n_bytes - 4 * d : 4;
    uint32_t w[8];
    for (int i = 0; i < 8; ++i) {
        w[i] = 0;
        memcpy(&w[i], rows[i] + 4 * d, (size_t)nb);
    }
    return _mm256_loadu_si256((const __m256i *)w);
}

/* tot_x[i] = Σ_{k: bit k of rows[i] set} x_x[k] for LROWS sign rows and NX (1 or 2) x vectors given
 * by their tables tab[x]: per 32 bytes of the 8 rows one load each and an 8 × 8 dword transpose,
 * then per dword 16 lookups into 4 accumulators (group j into j mod 4) summed (0 + 1) + (2 + 3),
 * in column order: a row's sums depend on its x and bits only. row_stride is the AVX-512 loop's
 * (gathers; unused here). */
#define LROWS 8
#define BLOCK_ROWS LROWS
#define PREFETCH_BLOCKS 2
#define LUT_DWORD(vk, d)                                                                                        \
    for (int j = 0; j < PAIRS; ++j) {                                                                         \
        const __m256i idx_ = j ? _mm256_srli_epi32(vk, 2 * j) : (vk);                                         \
        for (int x = 0; x < NX; ++x)                                                                          \
            acc[x][j & 3] = _mm256_add_ps(                                                                    \
                acc[x][j & 3], _mm256_permutevar_ps(_mm256_loadu_ps(tab[x] + 8 * (PAIRS * (d) + j)), idx_));  \
    }
static inline __attribute__((always_inline)) void lut_sums(const float *const *tab, const int NX, const int BF,
                                                          const uint8_t *const *rows, int64_t n_bytes,
                                                          int64_t row_stride, int64_t ahead, float *const *tot) {
    (void)BF; /* no bf16 tables in this build */
    (void)row_stride;
    __m256 acc[2][4];
    for (int x = 0; x < NX; ++x)
        for (int a = 0; a < 4; ++a) acc[x][a] = _mm256_setzero_ps();
    const int64_t n_dwords = (n_bytes + 3) / 4, nfull = n_bytes / 32;
    __m256i v[8];
    /* the transposed dwords wait in memory, one loaded per lookup run: AVX2's 16 registers hold the
     * accumulators and a run, not the 8 of them too (spilled, 0.6× the speed on an AMD EPYC of the
     * Zen 3 generation) */
    __attribute__((aligned(32))) uint32_t dw[8][8];
    for (int64_t c = 0; c < nfull; ++c) {
        /* the block PREFETCH_BLOCKS on, 4 lines a chunk: its 8 rows' bytes over this block's chunks */
        for (int i = 0; i < 4; ++i) _mm_prefetch((const char *)(rows[0] + ahead + 64 * (4 * c + i)), _MM_HINT_T0);
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + 32 * c));
        transpose8(v);
        for (int k = 0; k < 8; ++k) _mm256_store_si256((__m256i *)dw[k], v[k]);
        for (int k = 0; k < 8; ++k) {
            const __m256i vk = _mm256_load_si256((const __m256i *)dw[k]);
            LUT_DWORD(vk, 8 * c + k)
        }
    }
    for (int64_t d = 8 * nfull; d < n_dwords; ++d) {
        const __m256i vk = row_dwords(rows, d, n_bytes);
        LUT_DWORD(vk, d)
    }
    for (int x = 0; x < NX; ++x)
        _mm256_storeu_ps(tot[x], _mm256_add_ps(_mm256_add_ps(acc[x][0], acc[x][1]), _mm256_add_ps(acc[x][2], acc[x][3])));
}
#undef LUT_DWORD
#endif

#ifndef BLOCK_ROWS
#define BLOCK_ROWS ROWS
#endif
#ifndef HAVE_BF16_TABLES
#define HAVE_BF16_TABLES 0
#endif

#ifdef HAVE_X_TABLES
/* Floats of one x row's tables: bf16 tables (x_row_tables_bf16) where bf16, else fp32 ones. */
static inline int64_t table_floats(int64_t d_in, int bf16) {
#if HAVE_BF16_TABLES
    if (bf16) return x_table_floats_bf16(d_in);
#endif
    (void)bf16;
    return x_table_floats(d_in);
}
#endif

/* Whether the table loop takes bf16 tables for an x whose values are (x_is_bf16) exactly bf16:
 * in the AVX512-BF16 build. */
static inline int tables_bf16(int x_is_bf16) { return x_is_bf16 && HAVE_BF16_TABLES; }

/* x's rows (or, with column α's, the nq scaled rows xcol) as the table loop's tables, a malloc'ed
 * [nq, table_floats(d_in, bf16)] the caller frees (bf16: tables_bf16's choice); NULL where the
 * build has no table loop (scalar: *failed = 0) or memory ran out (*failed = 1). */
static float *x_tables(const float *x, int64_t nq, int64_t ldx, int64_t d_in, int bf16, int *failed) {
    *failed = 0;
#ifdef HAVE_X_TABLES
    const int64_t nt = table_floats(d_in, bf16);
    float *tab = (float *)malloc(sizeof(float) * (size_t)(nq > 0 ? nq * nt : 1));
    if (!tab) {
        *failed = 1;
        return NULL;
    }
    for (int64_t q = 0; q < nq; ++q) {
#if HAVE_BF16_TABLES
        if (bf16) {
            x_row_tables_bf16(x + q * ldx, d_in, tab + q * nt);
            continue;
        }
#endif
        x_row_tables(x + q * ldx, d_in, tab + q * nt);
    }
    return tab;
#else
    (void)x, (void)nq, (void)ldx, (void)d_in, (void)bf16;
    return NULL;
#endif
}

/* The planes of a mixed batch over output rows [r0, r1):
 *   y[m, r] += Σ_p α_v[r] · Σ_k xs[k] · S_v[r, k],  v = slots[m·n_planes + p] ≥ 0 (< 0: no plane),
 * slot v's signs at s + v·stride_sv, its α_v[r] = alpha[v·stride_av + r·alpha_stride]; slots NULL:
 * one plane, slot 0, for every row. xs is x's row m (xcol NULL) or, with column α's, its row
 * scaled by slot v's column α of r's group g: xcol + ((m·n_planes + p)·n_groups + g)·d_in; xsum
 * holds Σ_k xs[k] in the same order ([M] without column α's). Groups: rows [bounds[g],
 * bounds[g + 1]) (bounds NULL: one group). tab: NULL, or the nibble tables of the rows xs
 * (x_tables; indexed as xsum; tab_bf16: bf16 ones): the table loop, blocks of LROWS rows (NULL: the
 * masked loop). An x
 * that is exactly bf16 takes the table loop too: where the build has AVX512-BF16, VDPBF16PS
 * against ones on the bf16 lanes of set bits (32 columns per mask) ran 2.1× slower than the
 * tables on one core of a Xeon with AVX512-BF16/AMX (4096², an extra plane 0.40 instead of 0.19 ×
 * the bf16 base GEMV; docs/kernels.md). The
 * planes' terms are summed in fp32 and added to y once. Each register block of rows stays inside
 * one group, and its sign rows stay in cache for all rows m and planes p. */
static void delta_rows_planes(const float *x, const float *tab, int tab_bf16, int64_t ldx, int64_t M,
                              const float *xsum, const float *xcol, const uint8_t *s, int64_t stride_sv,
                              int64_t lds, int64_t d_in,
                              const float *alpha, int64_t stride_av, int64_t alpha_stride,
                              const int64_t *slots, int64_t n_planes, const int64_t *bounds, int64_t n_groups,
                              const int64_t *mate, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    /* CHUNK rows at a time, plane after plane: each plane's bits are one sequential run the
     * hardware prefetcher follows (blocks of 8 rows alternating between planes ran at 0.6× once the
     * bits came from memory); the chunk's rows of one x row sum their planes in `sum`. Two x rows
     * with the same slots (mate) share every mask register load, the loop's bound. */
    enum { CHUNK = 128 };
    (void)tab_bf16; /* the scalar build has no tables */
    for (int64_t c0 = r0; c0 < r1; c0 += CHUNK) {
        const int64_t c1 = (c0 + CHUNK) < r1 ? c0 + CHUNK : r1;
        for (int64_t m = 0; m < M; ++m) {
            const int64_t m2 = mate ? mate[m] : (m % 2 == 0 && m + 1 < M ? m + 1 : (m % 2 ? -2 : -1));
            if (m2 == -2) continue; /* done with its partner */
            float sum[CHUNK], sum2[CHUNK];
            int any = 0;
            for (int64_t p = 0; p < n_planes; ++p) {
                const int64_t v = slots ? slots[m * n_planes + p] : 0;
                if (v < 0) continue;
                if (!any) {
                    memset(sum, 0, sizeof(sum));
                    memset(sum2, 0, sizeof(sum2));
                }
                any = 1;
                const float *av = alpha + v * stride_av;
                int64_t g = 0;
                for (int64_t r = c0; r < c1;) {
                    while (bounds && r >= bounds[g + 1]) ++g;
                    const int64_t end = bounds && bounds[g + 1] < c1 ? bounds[g + 1] : c1;
                    const int br = tab ? BLOCK_ROWS : ROWS; /* rows per register block */
                    const int nr = (end - r) < br ? (int)(end - r) : br;
                    const uint8_t *rows[BLOCK_ROWS];
                    for (int i = 0; i < br; ++i)  /* missing rows alias row r; their sums are dropped */
                        rows[i] = s + v * stride_sv + (r + (i < nr ? i : 0)) * lds;
                    const int64_t q = (m * n_planes + p) * n_groups + g, q2 = (m2 * n_planes + p) * n_groups + g;
                    float tot[BLOCK_ROWS], tot2[BLOCK_ROWS];
#ifdef HAVE_X_TABLES
                    if (br == LROWS) {
                        const int64_t nt = table_floats(d_in, tab_bf16), i0 = xcol ? q : m, i2 = xcol ? q2 : m2;
                        const float *tb[2] = {tab + i0 * nt, m2 >= 0 ? tab + i2 * nt : NULL};
                        float *const to[2] = {tot, tot2};
                        /* the bits PREFETCH_BLOCKS blocks on are fetched while these are summed: the
                         * hardware prefetcher does not follow 16 short row runs at a time */
                        const int64_t ahead = PREFETCH_BLOCKS * LROWS * lds;
                        /* and the α's of those rows: a slow sequential stream (a line per block) that
                         * the hardware prefetcher does not pick up, ~10 % of the pass waited on it */
                        _mm_prefetch((const char *)(av + (r + PREFETCH_BLOCKS * LROWS) * alpha_stride), _MM_HINT_T0);
                        /* a full block's rows are evenly spaced: gathers (int32 offsets), where the
                         * CPU's gathers are fast (gather_rows) */
                        const int64_t stride = gather_rows && nr == LROWS && lds <= INT32_MAX / LROWS ? lds : 0;
                        const int64_t nb = (d_in + 7) / 8;
#if HAVE_BF16_TABLES
                        if (tab_bf16) {
                            if (m2 >= 0)
                                lut_sums(tb, 2, 1, rows, nb, stride, ahead, to);
                            else
                                lut_sums(tb, 1, 1, rows, nb, stride, ahead, to);
                        } else
#endif
                        if (m2 >= 0)
                            lut_sums(tb, 2, 0, rows, nb, stride, ahead, to);
                        else
                            lut_sums(tb, 1, 0, rows, nb, stride, ahead, to);
                    } else
#endif
                    if (m2 >= 0) {
                        mask_sums2(xcol ? xcol + q * d_in : x + m * ldx, xcol ? xcol + q2 * d_in : x + m2 * ldx, rows,
                                   d_in, tot, tot2);
                    } else {
                        mask_sums(xcol ? xcol + q * d_in : x + m * ldx, rows, d_in, tot);
                    }
                    const float xs = xcol ? xsum[q] : xsum[m];
                    for (int i = 0; i < nr; ++i) sum[r - c0 + i] += av[(r + i) * alpha_stride] * (2.f * tot[i] - xs);
                    if (m2 >= 0) {
                        const float xs2 = xcol ? xsum[q2] : xsum[m2];
                        for (int i = 0; i < nr; ++i)
                            sum2[r - c0 + i] += av[(r + i) * alpha_stride] * (2.f * tot2[i] - xs2);
                    }
                    r += nr;
                }
            }
            if (any) {
                for (int64_t r = c0; r < c1; ++r) y[m * ldy + r] += sum[r - c0];
                if (m2 >= 0)
                    for (int64_t r = c0; r < c1; ++r) y[m2 * ldy + r] += sum2[r - c0];
            }
        }
    }
}

/* Partners for delta_rows_planes: mate[m] = a later row with the same slots (each row in at most
 * one pair), −1 none, −2 = some earlier row's partner. */
static void find_mates(const int64_t *slots, int64_t M, int64_t n_planes, int64_t *mate) {
    for (int64_t m = 0; m < M; ++m) mate[m] = -1;
    for (int64_t m = 0; m < M; ++m) {
        if (mate[m] != -1) continue;
        for (int64_t m2 = m + 1; m2 < M; ++m2) {
            if (mate[m2] != -1) continue;
            int same = 1, any = 0;
            for (int64_t p = 0; p < n_planes && same; ++p) {
                same = slots[m * n_planes + p] == slots[m2 * n_planes + p];
                any |= slots[m * n_planes + p] >= 0;
            }
            if (same && any) {
                mate[m] = m2;
                mate[m2] = -2;
                break;
            }
        }
    }
}

/* One plane of variant 0 for every x row: delta_rows_planes without column α's. */
static void delta_rows_mask(const float *x, const float *tab, int tab_bf16, int64_t ldx, int64_t M,
                            const float *xsum, const uint8_t *s, int64_t lds, int64_t d_in, const float *alpha,
                            int64_t alpha_stride, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    delta_rows_planes(x, tab, tab_bf16, ldx, M, xsum, NULL, s, 0, lds, d_in, alpha, 0, alpha_stride, NULL, 1, NULL, 1, NULL,
                      y, ldy, r0, r1);
}

/* x's rows as bf16 words (x's values exactly bf16: their upper halves) for the bf16 dot-product
 * GEMV (dense_rows_dp), a malloc'ed [M, ldx] the caller frees; NULL where the build has no
 * AVX512-BF16 (*failed = 0) or memory ran out (*failed = 1). */
static uint16_t *bf16_words(const float *x, int64_t M, int64_t ldx, int64_t d_in, int *failed) {
    *failed = 0;
#if defined(__AVX512BF16__)
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M > 0 ? M * ldx : 1));
    if (!xb) {
        *failed = 1;
        return NULL;
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < d_in; ++k) {
            uint32_t u;
            memcpy(&u, x + m * ldx + k, 4);
            xb[m * ldx + k] = (uint16_t)(u >> 16);
        }
    return xb;
#else
    (void)x, (void)M, (void)ldx, (void)d_in;
    return NULL;
#endif
}

/* ---------------------------------------------------------------------- */
/* delta GEMV, "lut8" method (the byte lookup table of the design doc):     */
/* T[g][b] = Σ_{i<8} x[8g+i] · (bit_i(b) ? +1 : −1), then Σ_g T[g][byte_g]  */
/* ---------------------------------------------------------------------- */
static void build_lut8(const float *xm, int64_t d_in, float *T) {
    const int64_t n_bytes = (d_in + 7) / 8;
    for (int64_t g = 0; g < n_bytes; ++g) {
        float xv[8];
        float neg = 0.f;
        for (int i = 0; i < 8; ++i) {
            const int64_t k = 8 * g + i;
            xv[i] = k < d_in ? xm[k] : 0.f;  /* padding columns count as x = 0 */
            neg -= xv[i];
        }
        float *t = T + g * 256;
        t[0] = neg;
        /* each entry adds 2·x of its lowest set bit to the entry without it */
        for (int b = 1; b < 256; ++b) t[b] = t[b & (b - 1)] + 2.f * xv[__builtin_ctz(b)];
    }
}

static void delta_rows_lut8(const float *T, int64_t M, const uint8_t *s, int64_t lds, int64_t d_in,
                            const float *alpha, int64_t alpha_stride,
                            float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t n_bytes = (d_in + 7) / 8;
    for (int64_t r = r0; r < r1; r += ROWS) {
        const int nr = (r1 - r) < ROWS ? (int)(r1 - r) : ROWS;
        for (int64_t m = 0; m < M; ++m) {
            const float *Tm = T + m * n_bytes * 256;
            float acc[ROWS] = {0};
            for (int64_t g = 0; g < n_bytes; ++g) {
                const float *t = Tm + g * 256;
                for (int i = 0; i < nr; ++i) acc[i] += t[s[(r + i) * lds + g]];
            }
            for (int i = 0; i < nr; ++i) y[m * ldy + r + i] += alpha[(r + i) * alpha_stride] * acc[i];
        }
    }
}

/* Row range of thread t out of n, in multiples of ROWS. */
/* Σ_k x[m, k] for every row m (the masked kernels add α·(2·Σ_{bit=1} x − Σ x)), in vector lanes
 * and then the ragged tail: a serial fp32 sum took ~1.7 µs for 1536 columns before the planes could
 * start (~0.1 ms of a one-row variant step). The same order for every row count and every caller.
 * Returns a malloc'ed fp32 [max(M, 1)] the caller frees, or NULL when out of memory. */
static float *row_sums(const float *x, int64_t M, int64_t ldx, int64_t d_in) {
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    if (!xsum) return NULL;
    for (int64_t m = 0; m < M; ++m) {
        const float *xm = x + m * ldx;
        float t = 0.f;
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 a = _mm512_setzero_ps();
        for (; k + 16 <= d_in; k += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(xm + k));
        t = _mm512_reduce_add_ps(a);
#elif defined(__AVX2__)
        __m256 a = _mm256_setzero_ps();
        for (; k + 8 <= d_in; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(xm + k));
        float l[8];
        _mm256_storeu_ps(l, a);
        t = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
#endif
        for (; k < d_in; ++k) t += xm[k];
        xsum[m] = t;
    }
    return xsum;
}

/* bd_delta_gemv's rows [r0, r1): by the byte tables (lut8) or the nibble tables / masks. */
typedef struct {
    const float *x, *lut8, *xsum, *tab;
    const uint8_t *s;
    const float *alpha;
    float *y;
    int64_t M, ldx, d_in, lds, alpha_stride, ldy;
    int tab_bf16;
} delta_gemv_args;

static void delta_gemv_rows(void *ctx, int64_t r0, int64_t r1) {
    const delta_gemv_args *A = (const delta_gemv_args *)ctx;
    if (A->lut8)
        delta_rows_lut8(A->lut8, A->M, A->s, A->lds, A->d_in, A->alpha, A->alpha_stride, A->y, A->ldy, r0, r1);
    else
        delta_rows_mask(A->x, A->tab, A->tab_bf16, A->ldx, A->M, A->xsum, A->s, A->lds, A->d_in, A->alpha, A->alpha_stride, A->y,
                        A->ldy, r0, r1);
}

/* y[m, r] += α_r · Σ_k x[m, k] · s[r, k]
 *   x: fp32 [M, ldx≥d_in]; s: uint8 [d_out, lds≥ceil(d_in/8)];
 *   alpha: fp32, α_r = alpha[r·alpha_stride] (stride 0: one α per matrix);
 *   y: fp32 [M, ldy≥d_out], accumulated in place.
 *   method: 0 = mask (the table loop; scalar: a test per bit), 1 = lut8 (byte lookup table).
 *   x_is_bf16: x's values are exactly bf16 (the table loop may then take bf16 tables, tables_bf16).
 * Returns 0, or −1 when scratch memory could not be allocated. */
int bd_delta_gemv(const float *x, int64_t M, int64_t ldx,
                  const uint8_t *s, int64_t d_out, int64_t d_in, int64_t lds,
                  const float *alpha, int64_t alpha_stride,
                  float *y, int64_t ldy, int method, int x_is_bf16, int n_threads) {
    const int bf16 = tables_bf16(x_is_bf16);
    delta_gemv_args A = {x, NULL, NULL, NULL, s, alpha, y, M, ldx, d_in, lds, alpha_stride, ldy, bf16};
    if (method == 1) {
        const int64_t n_bytes = (d_in + 7) / 8;
        float *T = (float *)malloc(sizeof(float) * (size_t)(M * n_bytes * 256));
        if (!T) return -1;
        for (int64_t m = 0; m < M; ++m) build_lut8(x + m * ldx, d_in, T + m * n_bytes * 256);
        A.lut8 = T;
        pool_rows(delta_gemv_rows, &A, d_out, POOL_ROWS, n_threads);
        free(T);
        return 0;
    }
    int failed = 0;
    float *xsum = row_sums(x, M, ldx, d_in), *tab = xsum ? x_tables(x, M, ldx, d_in, bf16, &failed) : NULL;
    if (!xsum || failed) {
        free(xsum);
        return -1;
    }
    A.xsum = xsum;
    A.tab = tab;
    pool_rows(delta_gemv_rows, &A, d_out, POOL_ROWS, n_threads);
    free(tab);
    free(xsum);
    return 0;
}

/* bd_delta_batched's rows [r0, r1) (delta_rows_planes). */
typedef struct {
    const float *x, *tab, *xsum, *xcol;
    const uint8_t *s;
    const float *alpha;
    const int64_t *slots, *bounds, *mate;
    float *y;
    int64_t ldx, M, stride_sv, lds, d_in, stride_av, alpha_stride, n_planes, n_groups, ldy;
    int tab_bf16;
} batched_args;

static void batched_rows(void *ctx, int64_t r0, int64_t r1) {
    const batched_args *A = (const batched_args *)ctx;
    delta_rows_planes(A->x, A->tab, A->tab_bf16, A->ldx, A->M, A->xsum, A->xcol, A->s, A->stride_sv, A->lds, A->d_in, A->alpha,
                      A->stride_av, A->alpha_stride, A->slots, A->n_planes, A->bounds, A->n_groups, A->mate, A->y,
                      A->ldy, r0, r1);
}

/* A mixed batch's planes in one pool task ("mask" method):
 *   y[m, r] += Σ_p α_v[r] · Σ_k x[m, k] · c_v[g(r), k] · S_v[r, k],  v = row_slots[m·n_planes + p]
 * over the p with v ≥ 0 (int64; < 0: nothing), the planes' terms summed in fp32, then added to y.
 *   s: uint8 [V, d_out, lds], slot stride stride_sv; alpha: fp32, α_v[r] = alpha[v·stride_av +
 *   r·alpha_stride]; col_alpha: NULL (c = 1) or fp32, c_v[g, k] = col_alpha[v·stride_cv + g·stride_cg
 *   + k], group g(r) the one with bounds[g] ≤ r < bounds[g + 1] (int64 [n_groups + 1], 0 … d_out;
 *   NULL with one group); x, y, x_is_bf16 as in bd_delta_gemv (without column α's: the scaled rows
 *   take fp32 tables). Indices are checked by the caller. Returns 0, or −1 when scratch memory could
 *   not be allocated. */
int bd_delta_batched(const float *x, int64_t M, int64_t ldx,
                     const uint8_t *s, int64_t stride_sv, int64_t d_out, int64_t d_in, int64_t lds,
                     const float *alpha, int64_t stride_av, int64_t alpha_stride,
                     const int64_t *row_slots, int64_t n_planes,
                     const float *col_alpha, int64_t stride_cv, int64_t stride_cg,
                     const int64_t *bounds, int64_t n_groups,
                     float *y, int64_t ldy, int x_is_bf16, int n_threads) {
    float *xsum = NULL, *xcol = NULL, *tab = NULL;
    const int bf16 = !col_alpha && tables_bf16(x_is_bf16);
    if (!col_alpha) {
        int failed = 0;
        xsum = row_sums(x, M, ldx, d_in);
        if (xsum) tab = x_tables(x, M, ldx, d_in, bf16, &failed);
        if (!xsum || failed) {
            free(xsum);
            return -1;
        }
    } else { /* x's row m scaled by each of its planes' column α's, once per call; and their sums */
        const int64_t q_n = M * n_planes * n_groups;
        xsum = (float *)malloc(sizeof(float) * (size_t)(q_n > 0 ? q_n : 1));
        xcol = (float *)malloc(sizeof(float) * (size_t)(q_n > 0 ? q_n * d_in : 1));
#ifdef HAVE_X_TABLES
        tab = (float *)malloc(sizeof(float) * (size_t)(q_n > 0 ? q_n * x_table_floats(d_in) : 1));
        const int tab_failed = !tab;
#else
        const int tab_failed = 0;
#endif
        if (!xsum || !xcol || tab_failed) {
            free(tab);
            free(xsum);
            free(xcol);
            return -1;
        }
        for (int64_t m = 0; m < M; ++m)
            for (int64_t p = 0; p < n_planes; ++p) {
                const int64_t v = row_slots[m * n_planes + p];
                if (v < 0) continue;
                for (int64_t g = 0; g < n_groups; ++g) {
                    const int64_t q = (m * n_planes + p) * n_groups + g;
                    const float *c = col_alpha + v * stride_cv + g * stride_cg, *xm = x + m * ldx;
                    float *o = xcol + q * d_in, t = 0.f;
                    for (int64_t k = 0; k < d_in; ++k) {
                        o[k] = xm[k] * c[k];
                        t += o[k];
                    }
                    xsum[q] = t;
#ifdef HAVE_X_TABLES
                    x_row_tables(o, d_in, tab + q * x_table_floats(d_in));
#endif
                }
            }
    }
    int64_t *mate = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    if (!mate) {
        free(tab);
        free(xcol);
        free(xsum);
        return -1;
    }
    find_mates(row_slots, M, n_planes, mate);
    batched_args A = {x, tab, xsum, xcol, s, alpha, row_slots, col_alpha ? bounds : NULL, mate, y, ldx, M, stride_sv,
                      lds, d_in, stride_av, alpha_stride, n_planes, col_alpha ? n_groups : 1, ldy, bf16};
    pool_rows(batched_rows, &A, d_out, POOL_ROWS, n_threads);
    free(tab);
    free(mate);
    free(xcol);
    free(xsum);
    return 0;
}
