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
/* The AVX2 table loop: x's nibble tables in 24-bit integers, looked up by VPSHUFB, 16 sign rows by
 * 2 bytes to a register. AVX2 has no lookup of 16 floats (VPERMPS takes 8 entries, the in-lane
 * VPERMILPS 4: the fp32 tables this replaced held 2 columns and summed 16 weights a lookup, about one
 * a cycle on a Zen 3 core), but VPSHUFB looks up 32 bytes at once, each 128-bit half in a 16-byte
 * table of its own: one lookup of a byte of 4 columns' entry for 32 (row, byte) lanes.
 *
 * x's chunk c of 256 columns (32 bytes of a sign row) has one scale, s_c = max|T| / (2²³ − 1) over
 * its 64 nibble tables (T[n] = Σ_{i < 4, bit i of n} x[4g + i] in fp32, added in i order from 0, as
 * the AVX-512 tables), and each entry is q = round(T / s_c), stored as three byte tables (its bytes
 * 0 and 1, unsigned, and 2, signed). A chunk's 16 pairs j take bytes j and h + j of 16 rows (h = 16,
 * or half a shorter last chunk rounded up), one byte per lane: 16 rows' 32 bytes are loaded and
 * transposed 16 × 16 inside each 128-bit half (byte b of row i to byte i of register b). Per pair:
 * the low and the high nibbles' indices (shared by the block's x rows), and per x row and byte k of
 * the entries two lookups (the low nibble's, the high nibble's), interleaved and summed by VPMADDUBSW
 * against ones into int16 accumulators (bytes 0 and 1: ≤ 510 a pair, byte 2: −256…254): exact
 * integers over a chunk's ≤ 16 pairs, then bytes 0 + 256 · bytes 1 (VPMADDWD) + 65536 · bytes 2
 * converted and multiplied by s_c into fp32, a row's two byte halves added at the end.
 *
 * The entries' rounding: |error| ≤ s_c / 2 per lookup, 2 lookups per byte, so a row's sum over set
 * bits moves by at most Σ_c bytes_c · s_c ≤ 2⁻¹⁸ · Σ_c max_c |x| (max_c: the chunk's largest 4-column
 * sum of |x|), about where the fp32 tables' own rounding lies (each entry and each add to 2⁻²⁴ of
 * its size): the C decode layers' logits of 8 rows over 4 variants differ from the fp32 tables' by
 * ≤ 7.4·10⁻⁷ (bench/kernels.py --decode-layers --against). Every path of this build that sums planes
 * takes these tables (the decode layers, the layer-by-layer path, the delta GEMV, the batched
 * delta; the AVX2 build has no one-pass plane loop at decode), and a chunk's scale is its x row's,
 * so a row's sums depend only on its x and its bits. A non-finite x makes its chunks' scale NaN,
 * so its sums are NaN, as the fp32 tables' were. Two bytes (int16 entries, steps of 2⁻¹⁵ of the
 * chunk's largest) ran ~5 % faster in that bench but moved a test family's logits (deltas as large
 * as the weights) by up to 2.6·10⁻⁴: not kept. Measured in docs/kernels.md, "A plane's pass". */
#define HAVE_X_TABLES 1
#define Q24_CHUNK 32                 /* bytes of a sign row per chunk (256 columns) */
#define Q24_MAX 8388607.f /* 2^23 − 1: the entries' largest magnitude */
#define Q24_PAIR_BYTES (6 * 32)         /* a pair's tables: 2 nibbles × 3 bytes × 32 */
#define Q24_CHUNK_BYTES (16 * Q24_PAIR_BYTES) /* a chunk's: 16 pairs */
static inline int64_t q24_chunks(int64_t n_bytes) { return (n_bytes + Q24_CHUNK - 1) / Q24_CHUNK; }
/* floats of one x row's tables: its chunks' tables, then their scales (one float each) */
static inline int64_t x_table_floats(int64_t d_in) {
    const int64_t nc = q24_chunks((d_in + 7) / 8);
    return nc * (Q24_CHUNK_BYTES / 4) + nc;
}
/* pairs in chunk c of a row of n_bytes (h above): bytes j and h + j of the chunk, j < h */
static inline int q24_pairs(int64_t n_bytes, int64_t c) {
    const int64_t nb = n_bytes - Q24_CHUNK * c;
    return nb >= Q24_CHUNK ? Q24_CHUNK / 2 : (int)((nb + 1) / 2);
}

/* Group g's 16 entries (T[n] = Σ_{i < 4, bit i of n} x[4g + i], added in i order from 0; columns
 * ≥ d_in as 0) as two vectors: entries 0–7 (bits 0–2) and 8–15 (the same plus x[4g + 3]). */
static inline void q24_group(const float *x, int64_t d_in, int64_t g, __m256 *e0, __m256 *e1) {
    float v[4];
    for (int i = 0; i < 4; ++i) v[i] = 4 * g + i < d_in ? x[4 * g + i] : 0.f;
    const __m256 b0 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
    const __m256 b1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1));
    const __m256 b2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1));
    __m256 t = _mm256_and_ps(b0, _mm256_set1_ps(v[0]));
    t = _mm256_add_ps(t, _mm256_and_ps(b1, _mm256_set1_ps(v[1]))); /* + 0 where the bit is clear: the same value */
    t = _mm256_add_ps(t, _mm256_and_ps(b2, _mm256_set1_ps(v[2])));
    *e0 = t;
    *e1 = _mm256_add_ps(t, _mm256_set1_ps(v[3]));
}

/* x's tables: chunk c's pair j at bytes (c·16 + j)·192: the low nibble's bytes 0, 1 and 2 of its
 * entries, then the high nibble's, 32 bytes each [byte j's 16 entries | byte h + j's] (absent
 * bytes: 0); after the chunks, the scales. */
static void x_row_tables(const float *x, int64_t d_in, float *T) {
    const int64_t n_bytes = (d_in + 7) / 8, nc = q24_chunks(n_bytes);
    uint8_t *tb = (uint8_t *)T;
    float *scale = T + nc * (Q24_CHUNK_BYTES / 4);
    memset(tb, 0, (size_t)(nc * Q24_CHUNK_BYTES));
    /* 4 int32 entries in each 128-bit half -> their bytes 0, then 1, then 2 (a dword each) */
    const __m256i split = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, -1, -1, -1, -1, 0, 4, 8, 12, 1, 5,
                                           9, 13, 2, 6, 10, 14, -1, -1, -1, -1);
    const __m256i gather = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 ent[4 * Q24_CHUNK]; /* a chunk's 64 groups' entries, two vectors each */
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t nb = n_bytes - Q24_CHUNK * c < Q24_CHUNK ? n_bytes - Q24_CHUNK * c : Q24_CHUNK;
        const int64_t g0 = 2 * Q24_CHUNK * c;
        __m256 mx8 = _mm256_setzero_ps(), nan8 = mx8; /* the largest |entry| per lane; NaN lanes */
        for (int64_t g = 0; g < 2 * nb; ++g) {
            q24_group(x, d_in, g0 + g, &ent[2 * g], &ent[2 * g + 1]);
            for (int e = 0; e < 2; ++e) {
                const __m256 v = ent[2 * g + e];
                mx8 = _mm256_max_ps(mx8, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v));
                nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
        }
        float l[8], mx = 0.f;
        _mm256_storeu_ps(l, mx8);
        for (int i = 0; i < 8; ++i) mx = l[i] > mx ? l[i] : mx;
        const int finite = !_mm256_movemask_ps(nan8) && mx <= 3.4e38f;
        scale[c] = finite ? mx / Q24_MAX : NAN;
        const __m256 inv = _mm256_set1_ps(finite && mx > 0.f ? Q24_MAX / mx : 0.f);
        const __m256i lim = _mm256_set1_epi32((int)Q24_MAX), nlim = _mm256_set1_epi32(-(int)Q24_MAX);
        const int h = q24_pairs(n_bytes, c);
        for (int64_t b = 0; b < nb; ++b) {
            const int j = (int)(b < h ? b : b - h), half = b < h ? 0 : 1;
            for (int nib = 0; nib < 2; ++nib) {
                const __m256 *e = ent + 2 * (2 * b + nib);
                __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(e[0], inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(e[1], inv));
                q0 = _mm256_max_epi32(_mm256_min_epi32(q0, lim), nlim);
                q1 = _mm256_max_epi32(_mm256_min_epi32(q1, lim), nlim);
                /* per 128-bit half: byte 0 of its 4 entries, byte 1, byte 2; then the halves' dwords side by side */
                const __m256i b0 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q0, split), gather);
                const __m256i b1 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q1, split), gather);
                const __m256i lo = _mm256_unpacklo_epi64(b0, b1), hi = _mm256_unpackhi_epi64(b0, b1);
                uint8_t *o = tb + (c * 16 + j) * Q24_PAIR_BYTES + nib * (Q24_PAIR_BYTES / 2) + 16 * half;
                _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(lo));              /* bytes 0 of entries 0–15 */
                _mm_storeu_si128((__m128i *)(o + 32), _mm256_castsi256_si128(hi));       /* bytes 1 */
                _mm_storeu_si128((__m128i *)(o + 64), _mm256_extracti128_si256(lo, 1)); /* bytes 2 (signed) */
            }
        }
    }
}

/* 16 × 16 bytes transposed inside each 128-bit half: byte i of register b = byte b of register i before. */
static inline void transpose16_bytes(__m256i *v) {
    __m256i t[16], u[16];
    for (int i = 0; i < 8; ++i) { /* t[i] word k: rows 2i, 2i + 1, byte k; t[8 + i]: byte 8 + k */
        t[i] = _mm256_unpacklo_epi8(v[2 * i], v[2 * i + 1]);
        t[8 + i] = _mm256_unpackhi_epi8(v[2 * i], v[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) /* u[8h + i] dword k: rows 4i … 4i + 3, byte 8h + k; u[8h + 4 + i]: 8h + 4 + k */
        for (int i = 0; i < 4; ++i) {
            u[8 * h + i] = _mm256_unpacklo_epi16(t[8 * h + 2 * i], t[8 * h + 2 * i + 1]);
            u[8 * h + 4 + i] = _mm256_unpackhi_epi16(t[8 * h + 2 * i], t[8 * h + 2 * i + 1]);
        }
    for (int q = 0; q < 4; ++q) /* t[4q + i] qword k: rows 8i … 8i + 7, byte 4q + k; t[4q + 2 + i]: 4q + 2 + k */
        for (int i = 0; i < 2; ++i) {
            t[4 * q + i] = _mm256_unpacklo_epi32(u[4 * q + 2 * i], u[4 * q + 2 * i + 1]);
            t[4 * q + 2 + i] = _mm256_unpackhi_epi32(u[4 * q + 2 * i], u[4 * q + 2 * i + 1]);
        }
    for (int q = 0; q < 8; ++q) { /* byte 2q and 2q + 1 of the 16 rows */
        v[2 * q] = _mm256_unpacklo_epi64(t[2 * q], t[2 * q + 1]);
        v[2 * q + 1] = _mm256_unpackhi_epi64(t[2 * q], t[2 * q + 1]);
    }
}

/* Chunk c's bytes of 16 rows, row i in v[i]: bytes j < h in the low half, h + j in the high half
 * (zeros past the row), reading only the rows' own bytes: a full chunk one load a row; a shorter last
 * one 16 bytes ending at the row's end (and, past 16 bytes, 16 from the chunk's start) placed by
 * two VPSHUFBs; rows shorter than 16 bytes byte by byte. */
static inline void q24_load_chunk(const uint8_t *const *rows, int64_t n_bytes, int64_t c, __m256i *v) {
    const int64_t b0 = Q24_CHUNK * c, nb = n_bytes - b0 < Q24_CHUNK ? n_bytes - b0 : Q24_CHUNK;
    if (nb == Q24_CHUNK) {
        for (int i = 0; i < 16; ++i) v[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + b0));
        return;
    }
    const int h = (int)(nb + 1) / 2;
    if (n_bytes < 16) {
        for (int i = 0; i < 16; ++i) {
            uint8_t buf[32] = {0};
            memcpy(buf, rows[i] + b0, (size_t)h);
            memcpy(buf + 16, rows[i] + b0 + h, (size_t)(nb - h));
            v[i] = _mm256_loadu_si256((const __m256i *)buf);
        }
        return;
    }
    uint8_t cl[16], ch[16]; /* positions in the loads: the low half's from the chunk's start past 16 bytes */
    for (int j = 0; j < 16; ++j) {
        cl[j] = j < h ? (uint8_t)((nb > 16 ? 0 : 16 - nb) + j) : 0x80;
        ch[j] = j < nb - h ? (uint8_t)(16 - nb + h + j) : 0x80;
    }
    const __m128i ctl = _mm_loadu_si128((const __m128i *)cl), cth = _mm_loadu_si128((const __m128i *)ch);
    for (int i = 0; i < 16; ++i) {
        const __m128i e = _mm_loadu_si128((const __m128i *)(rows[i] + n_bytes - 16));
        const __m128i f = nb > 16 ? _mm_loadu_si128((const __m128i *)(rows[i] + b0)) : e;
        v[i] = _mm256_set_m128i(_mm_shuffle_epi8(e, cth), _mm_shuffle_epi8(f, ctl));
    }
}

/* tot_x[i] = Σ_{k: bit k of rows[i] set} x_x[k] for LROWS sign rows and NX (1 or 2) x rows given
 * by their tables tab[x] (x_row_tables): per chunk the 16 rows' bytes loaded and transposed once,
 * then each x row's lookups in turn (one x row's accumulators, indices and
 * lookups fill AVX2's 16 registers). The same steps for a row whatever NX and the other rows.
 * row_stride is the AVX-512 loop's (gathers; unused here). */
#define LROWS 16
#define BLOCK_ROWS LROWS
#define PREFETCH_BLOCKS 2
static inline __attribute__((always_inline)) void lut_sums(const float *const *tab, const int NX, const int BF,
                                                          const uint8_t *const *rows, int64_t n_bytes,
                                                          int64_t row_stride, int64_t ahead, float *const *tot) {
    (void)BF; /* no bf16 tables in this build */
    (void)row_stride;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones8 = _mm256_set1_epi8(1), lo_hi = _mm256_set1_epi32(0x01000001);
    const int64_t nc = q24_chunks(n_bytes);
    /* the block's bits over its chunks: LROWS · n_bytes bytes from rows[0] (a block's rows are
     * evenly spaced), its lines spread over the chunks */
    const int64_t lines = (LROWS * n_bytes + 63) / 64, per_chunk = (lines + nc - 1) / nc;
    __m256 acc[2][4];
    for (int x = 0; x < NX; ++x)
        for (int a = 0; a < 4; ++a) acc[x][a] = _mm256_setzero_ps();
    __m256i v[16]; /* the chunk's transposed bytes */
    for (int64_t c = 0; c < nc; ++c) {
        for (int64_t l = c * per_chunk; l < (c + 1) * per_chunk && l < lines; ++l)
            _mm_prefetch((const char *)(rows[0] + ahead + 64 * l), _MM_HINT_T0);
        q24_load_chunk(rows, n_bytes, c, v);
        transpose16_bytes(v);
        const int np = q24_pairs(n_bytes, c);
        for (int x = 0; x < NX; ++x) {
            const uint8_t *t = (const uint8_t *)tab[x] + c * Q24_CHUNK_BYTES;
            __m256i a0[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, a1[2] = {a0[0], a0[0]}, a2[2] = {a0[0], a0[0]};
            for (int j = 0; j < np; ++j, t += Q24_PAIR_BYTES) {
                /* the pair's nibbles, split here for each x row rather than once into 32 vectors: AVX2's
                 * 16 registers cannot hold those, so the split's stores and the lookups' index loads
                 * cost more than three ALU operations (a C loop on one Zen 3 core: 1.07–1.16 × the
                 * weights a ns, the same sums; docs/kernels.md) */
                const __m256i lo_ = _mm256_and_si256(v[j], nib), hi_ = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), nib);
#define Q24_BYTE(k, acc, sgn)                                                                                        \
    {                                                                                                                   \
        const __m256i l_ = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(t + 32 * (k))), lo_);               \
        const __m256i h_ = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(t + Q24_PAIR_BYTES / 2 + 32 * (k))), hi_);        \
        acc[0] = _mm256_add_epi16(acc[0], sgn ? _mm256_maddubs_epi16(ones8, _mm256_unpacklo_epi8(l_, h_))              \
                                              : _mm256_maddubs_epi16(_mm256_unpacklo_epi8(l_, h_), ones8));             \
        acc[1] = _mm256_add_epi16(acc[1], sgn ? _mm256_maddubs_epi16(ones8, _mm256_unpackhi_epi8(l_, h_))              \
                                              : _mm256_maddubs_epi16(_mm256_unpackhi_epi8(l_, h_), ones8));             \
    }
                Q24_BYTE(0, a0, 0)
                Q24_BYTE(1, a1, 0)
                Q24_BYTE(2, a2, 1)
#undef Q24_BYTE
            }
            /* rows 0–3, 4–7 (a·[0]) and 8–11, 12–15 (a·[1]) of each byte half: bytes 0 + 256 · bytes 1
             * (VPMADDWD) + 65536 · bytes 2 (the high words of an unpack with zero) */
            const __m256 s = _mm256_set1_ps(tab[x][nc * (Q24_CHUNK_BYTES / 4) + c]);
            const __m256i z = _mm256_setzero_si256();
#define Q24_ADD(a, f, e)                                                                                               \
    acc[x][a] = _mm256_fmadd_ps(                                                                                        \
        _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(f(a0[e], a1[e]), lo_hi), f(z, a2[e]))), s, acc[x][a])
            Q24_ADD(0, _mm256_unpacklo_epi16, 0);
            Q24_ADD(1, _mm256_unpackhi_epi16, 0);
            Q24_ADD(2, _mm256_unpacklo_epi16, 1);
            Q24_ADD(3, _mm256_unpackhi_epi16, 1);
#undef Q24_ADD
        }
    }
    for (int x = 0; x < NX; ++x) /* the two byte halves of each row */
        for (int a = 0; a < 4; ++a)
            _mm_storeu_ps(tot[x] + 4 * a,
                          _mm_add_ps(_mm256_castps256_ps128(acc[x][a]), _mm256_extractf128_ps(acc[x][a], 1)));
}
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
