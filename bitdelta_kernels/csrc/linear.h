/* Part of the CPU kernels' library: the GEMV y = x·Wᵀ with its planes (register blocks, the one-pass loops, linear_planes). Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

/* The sign planes a GEMV's own pass sums (linear_rows): plane p's bits s[p] [d_out, lds] and its
 * α's a[p] (row r's at a[p][r · alpha_stride]). The blocks of LINEAR_BLOCK take one plane; the
 * one-pass loops (delta_rows_f32, delta_rows_dp) up to ONE_PASS_PLANES for up to ONE_PASS_ROWS x
 * rows, one plane for up to 3 rows (one_pass_most), one accumulator pair per plane, weight row and x
 * row; one_pass_planes. */
#define ONE_PASS_PLANES 4
#define ONE_PASS_ROWS 2
/* The planes the one-pass loops sum for M ≤ ONE_PASS_ROWS x rows (0: more rows): 4, 3, so that the
 * 2·M·(planes + 1) accumulators, the bf16 loop's 2·planes sign vectors and a few more stay in
 * AVX-512's 32 registers. From 3 rows on the dense blocks of three weight rows (DENSE_MIN_M_F32)
 * with the table loop's planes beat these one-weight-row loops: one core of a 2-core AMD EPYC of the
 * Zen 4 generation, a one-plane variant's step of SmolLM2-135M's C decode layers (`bench/kernels.py`'
 * model, in turns, medians; 2026-12-05) took at 2 / 3 / 4 rows 25.2 / 35.0 / 40.6 ms in one pass
 * against 25.2 / 26.9 / 30.9 in two in fp32, and 15.8 / 16.6 / 19.5 against 17.2 / 15.5 / 17.4 in
 * bf16 (up to 4 rows took one pass before those blocks' streams went to L2, ROWS_PREFETCH). bf16's
 * one-weight-row loop takes one row only (ONE_PASS_ROWS_BF16): at 2 rows it took 15.3–16.6 ms
 * against 13.1–14.7 in two passes (the same bench, four runs of 15–25 reps in turns, 2026-12-05). */
#define ONE_PASS_ROWS_BF16 1
/* Past those, up to ONE_PASS_BLOCK_ROWS x rows of one plane take one pass in blocks of ONE_PASS_R
 * weight rows that share each x vector (dp_rows_block, f32_rows_block). bf16 from 2 rows: the C
 * decode layers' bf16 step of a one-plane variant (`bench/kernels.py --decode-layers`, in turns with
 * the table loop's library, 2026-12-06) took at 3 rows 12.2 / 12.5 ms against 13.6 / 14.4, at 2 rows
 * 12.7–13.5 against 12.4–14.5 (faster in two runs of four, slower in two;
 * bench/results/kernels_cpu_2026-12-06_epyc-zen4-decode-layers-dp-blocks.txt). A first form at 4
 * rows ran no faster than the table loop (15.9 ms both): two planes' worth of dot products per
 * weight vector for each of 4 x rows, the step's bound at that row count. fp32 at 3 rows, where the
 * one-weight-row loop's 35.0 ms above lost to the table loop: 23.0 / 24.2 ms against 25.5 / 27.6
 * (bench/results/kernels_cpu_2026-12-06_epyc-zen4-decode-layers-f32-blocks.txt). */
#define ONE_PASS_R 2
#define ONE_PASS_BLOCK_ROWS 3
/* A one-pass block's state for weight rows [r, r + R) of W (element type WT): the rows (wr), each
 * plane's bits at them (sr), and per weight row and x row the weights' accumulator pair (a0, a1)
 * and each plane's (d0, d1), zeroed. */
#define ONE_PASS_BLOCK_INIT(WT, NX, NP, R)                                                               \
    const WT *wr[ONE_PASS_R];                                                                            \
    const uint8_t *sr[ONE_PASS_PLANES][ONE_PASS_R];                                                      \
    __m512 a0[ONE_PASS_R][ONE_PASS_BLOCK_ROWS], a1[ONE_PASS_R][ONE_PASS_BLOCK_ROWS];                     \
    __m512 d0[ONE_PASS_PLANES][ONE_PASS_R][ONE_PASS_BLOCK_ROWS], d1[ONE_PASS_PLANES][ONE_PASS_R][ONE_PASS_BLOCK_ROWS]; \
    UNROLLED for (int i = 0; i < (R); ++i) {                                                             \
        wr[i] = w + (r + i) * ldw;                                                                       \
        UNROLLED for (int p = 0; p < (NP); ++p) sr[p][i] = P->s[p] + (r + i) * lds;                      \
        UNROLLED for (int b = 0; b < (NX); ++b) {                                                        \
            a0[i][b] = a1[i][b] = _mm512_setzero_ps();                                                   \
            UNROLLED for (int p = 0; p < (NP); ++p) d0[p][i][b] = d1[p][i][b] = a0[i][b];                \
        }                                                                                                \
    }
static inline int one_pass_most(int dtype, int64_t M) {
    const int64_t rows = dtype == BD_W_BF16 ? ONE_PASS_ROWS_BF16 : ONE_PASS_ROWS; /* one weight row at a time */
    if (M >= 1 && M <= rows) return (int)(5 - M);
    return M > rows && M <= ONE_PASS_BLOCK_ROWS ? 1 : 0; /* the blocks: one plane */
}
typedef struct {
    const uint8_t *s[ONE_PASS_PLANES];
    const float *a[ONE_PASS_PLANES];
    int n;
} pass_planes;

/* ---------------------------------------------------------------------- */
/* fused linear GEMV: y[m, r] = Σ_k x[m,k]·w[r,k] + α_r · Σ_k x[m,k]·s[r,k] */
/* One pass over W and the bits: a FMA for the base and a masked add for    */
/* the delta per 16 columns, so the delta rides on the memory-bound base.   */
/* s == NULL: the base alone (the decode GEMV of a base row, or a bf16 one  */
/* at full bandwidth: torch's small-M bf16 GEMM reads at about half of it). */
/* bf16/fp16 weights are widened to fp32 in registers (a shift, or F16C), so */
/* the same code runs on AVX2 and on AVX-512 without AVX512-BF16/AMX.       */
/* ---------------------------------------------------------------------- */
#if defined(__AVX512F__) || defined(__AVX2__)
/* A chunk is 2·L columns (L = the vector's fp32 lanes: 16 for AVX-512, 8 for AVX2). bf16
 * weights are widened without a shuffle: one load of 2·L bf16 values, `<< 16` gives the even
 * columns as fp32 and `& 0xffff0000` the odd ones, multiplied by x's even and odd columns,
 * which the caller lays out once per call (xeo: per chunk L even then L odd values). fp32/fp16
 * weights take two natural vectors. The delta (bits of 2·L columns) takes two masked adds of
 * x's natural vectors. */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SET1(f) _mm512_set1_ps(f)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define V_ROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n for a vector of whole numbers n in [−126, 127]: n + 127 as the exponent bits */
#define V_POW2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define V_SUM(v) _mm512_reduce_add_ps(v)
#define V_BF16_EVEN(h) _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
#define V_BF16_ODD(h) _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xffff0000u)))
#define V_LOAD_I(p) _mm512_loadu_si512((const void *)(p))
#define V_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_WIDEN16(p) _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))) /* LANES u16 -> u32 */
#define V_MIN(a, b) _mm512_min_ps(a, b)
#define V_DIV(a, b) _mm512_div_ps(a, b)
/* round to bf16 as f32_to_bf16 does (nearest even; a NaN quiet), the result widened back */
static inline __m512 v_round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __m512i qn = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, qn), hi));
}
#define V_ROUND_F16(v) _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
/* the delta of 16 columns whose bits start at byte p: a masked add */
#define DELTA_PREP()
#define DELTA_ADD(acc, p, xv) acc = _mm512_mask_add_ps(acc, _load_mask16((__mmask16 *)(p)), acc, xv)
#else
#define LANES 8
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SET1(f) _mm256_set1_ps(f)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define V_ROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#define V_SUM(v) hsum8(v)
#define V_BF16_EVEN(h) _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
#define V_BF16_ODD(h) _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xffff0000u)))
#define V_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))) /* F16C: part of x86-64-v3 */
#define V_WIDEN16(p) _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define V_MIN(a, b) _mm256_min_ps(a, b)
#define V_DIV(a, b) _mm256_div_ps(a, b)
static inline __m256 v_round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    const __m256i qn = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_and_ps(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qn), nan), _mm256_castsi256_ps(hi));
}
#define V_ROUND_F16(v) _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
/* no mask registers: broadcast the byte, test one bit per lane */
#define DELTA_PREP() const __m256i lane_bit_ = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)
#define DELTA_ADD(acc, p, xv)                                                                            \
    do {                                                                                                 \
        const __m256i b_ = _mm256_set1_epi32(*(p));                                                      \
        const __m256 on_ = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b_, lane_bit_), lane_bit_)); \
        acc = _mm256_add_ps(acc, _mm256_and_ps(on_, xv));                                                \
    } while (0)
#endif

/* A loop over a block's registers, unrolled whole: a loop that is not (GCC leaves one with a loop
 * inside, e.g. a ragged tail's) keeps the block's accumulators in memory, stored after the main loop
 * and loaded back (and zeroed there before it). */
#define UNROLLED _Pragma("GCC unroll 16")
#if defined(__AVX512F__)
/* out[j] = _mm512_reduce_add_ps(v[j]) for n ≤ 16 vectors, the same adds in the same order (GCC's:
 * lanes j + j+8, then j + j+4, then j + j+2, then 0 + 1), as one tree across the vectors: at each
 * level two vectors' halves are shuffled side by side and added at once, ~3 operations a vector
 * where one reduction takes ~9 (n padded with zeros to the levels' pairs). Result lane 4g + q of
 * the last level holds vector 4q + g's sum. */
static inline __attribute__((always_inline)) void lane_sums(const __m512 *v, const int n, float *out) {
    const __m512 z = _mm512_setzero_ps();
    __m512 s1[8], s2[4], s3[2];
    const int n1 = (n + 1) / 2, n2 = (n1 + 1) / 2, n3 = (n2 + 1) / 2;
    UNROLLED for (int i = 0; i < n1; ++i) { /* [a.lo256 | b.lo256] + [a.hi256 | b.hi256] */
        const __m512 a = v[2 * i], b = 2 * i + 1 < n ? v[2 * i + 1] : z;
        s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    UNROLLED for (int i = 0; i < n2; ++i) { /* each 256-bit half's 128-bit halves */
        const __m512 a = s1[2 * i], b = 2 * i + 1 < n1 ? s1[2 * i + 1] : z;
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    UNROLLED for (int i = 0; i < n3; ++i) { /* in each 128-bit lane, lanes 0, 1 + lanes 2, 3 */
        const __m512 a = s2[2 * i], b = 2 * i + 1 < n2 ? s2[2 * i + 1] : z;
        s3[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    }
    const __m512 a = s3[0], b = n3 > 1 ? s3[1] : z; /* lane 0 + lane 1 */
    float t[16];
    _mm512_storeu_ps(t, _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD)));
    UNROLLED for (int j = 0; j < n; ++j) out[j] = t[4 * (j % 4) + j / 4];
}
/* Blocks of this many pairs or more take lane_sums (fewer: the padding costs more than it saves).
 * A C harness over 576-column bf16 matrices in L2, one core of a 2-core AMD EPYC of the Zen 4
 * generation (2026-12-06, two runs): 4 / 5 / 6 / 7 / 8 x rows 0.91–0.94 / 0.95–0.97 / 0.97 / 0.98 /
 * 0.93–0.96 × the time of one reduction a pair, 3 rows (blocks of 6 and 3 pairs) 1.01–1.03 ×, 2 rows
 * 1.02–1.04 ×. */
#define LANE_SUMS_MIN 8
#endif
/* float sums[R][MB]: each (weight row, x row) pair's two accumulators a[i][b][0..1] added and summed
 * across lanes (V_ADD, V_SUM; lane_sums for blocks of LANE_SUMS_MIN pairs or more: the same bits),
 * in registers; the ragged tails come after (one loop of those in the same loop nest kept a 3 × 4
 * bf16 block's 24 accumulators in memory: 48 stores and 24 loads a call, against its 216 dot
 * products at 576 columns: SmolLM2-135M's matrices, 8 x rows, in L2, one core of a 2-core AMD EPYC
 * of the Zen 4 generation, 1.2 × the time; docs/kernels.md). */
#if defined(__AVX512F__)
#define PAIR_SUMS(R, MB)                                                                                 \
    float sums[R][MB];                                                                                   \
    if ((R) * (MB) >= LANE_SUMS_MIN) {                                                                   \
        __m512 pv_[(R) * (MB)];                                                                          \
        UNROLLED for (int i = 0; i < R; ++i)                                                             \
            UNROLLED for (int b = 0; b < MB; ++b) pv_[i * (MB) + b] = V_ADD(a[i][b][0], a[i][b][1]);     \
        lane_sums(pv_, (R) * (MB), &sums[0][0]);                                                         \
    } else                                                                                               \
        UNROLLED for (int i = 0; i < R; ++i)                                                             \
            UNROLLED for (int b = 0; b < MB; ++b) sums[i][b] = V_SUM(V_ADD(a[i][b][0], a[i][b][1]))
#else
#define PAIR_SUMS(R, MB)                                                                                 \
    float sums[R][MB];                                                                                   \
    UNROLLED for (int i = 0; i < R; ++i)                                                                 \
        UNROLLED for (int b = 0; b < MB; ++b) sums[i][b] = V_SUM(V_ADD(a[i][b][0], a[i][b][1]))
#endif

/* R weight rows × MB rows of x per register block (R·MB base accumulators, and as many for
 * the delta when D = 1). R, MB, D and the weight dtype must be literal constants so that the
 * accumulator arrays live in registers (as runtime-sized arrays GCC kept them on the stack:
 * 1.5× slower), hence one function per combination, stamped out by this macro. */
#define LINEAR_BLOCK(NAME, R, MB, WD, D)                                                                \
    static void NAME(const float *x, const float *xeo, int64_t ldx, const float *xsum, const void *w,    \
                     int64_t ldw, const uint8_t *s, int64_t lds, int64_t d_in, const float *alpha,       \
                     int64_t alpha_stride, float *y, int64_t ldy, int64_t r, int nr, int64_t m0) {       \
        const int64_t nchunk = d_in / (2 * LANES);                                                       \
        DELTA_PREP();                                                                                    \
        vf base[MB][R], dlt[MB][R];                                                                      \
        UNROLLED for (int b = 0; b < MB; ++b)                                                            \
            UNROLLED for (int i = 0; i < R; ++i) base[b][i] = dlt[b][i] = V_ZERO();                      \
        const float *wf[R];                                                                              \
        const uint16_t *wh[R];                                                                           \
        const uint8_t *sr[R];                                                                            \
        for (int i = 0; i < R; ++i) { /* missing rows alias row r; their sums are dropped */             \
            const int64_t ri = r + (i < nr ? i : 0);                                                     \
            wf[i] = (const float *)w + ri * ldw;                                                         \
            wh[i] = (const uint16_t *)w + ri * ldw;                                                      \
            sr[i] = D ? s + ri * lds : NULL;                                                             \
        }                                                                                                \
        for (int64_t j = 0; j < nchunk; ++j) {                                                           \
            const int64_t c = 2 * LANES * j;                                                             \
            vf x0[MB], x1[MB];                                                                           \
            for (int b = 0; b < MB; ++b) {                                                               \
                const float *xm = (WD == BD_W_BF16 ? xeo : x) + (m0 + b) * ldx + c;                      \
                x0[b] = V_LOAD(xm);                                                                      \
                x1[b] = V_LOAD(xm + LANES);                                                              \
            }                                                                                            \
            for (int i = 0; i < R; ++i) {                                                                \
                vf w0, w1;                                                                               \
                if (WD == BD_W_F32) {                                                                    \
                    w0 = V_LOAD(wf[i] + c);                                                              \
                    w1 = V_LOAD(wf[i] + c + LANES);                                                      \
                } else if (WD == BD_W_BF16) {                                                            \
                    const __typeof__(V_LOAD_I(wh[i])) h = V_LOAD_I(wh[i] + c);                           \
                    w0 = V_BF16_EVEN(h);                                                                 \
                    w1 = V_BF16_ODD(h);                                                                  \
                } else {                                                                                 \
                    w0 = V_F16(wh[i] + c);                                                               \
                    w1 = V_F16(wh[i] + c + LANES);                                                       \
                }                                                                                        \
                for (int b = 0; b < MB; ++b) {                                                           \
                    base[b][i] = V_FMA(x0[b], w0, base[b][i]);                                           \
                    base[b][i] = V_FMA(x1[b], w1, base[b][i]);                                           \
                }                                                                                        \
                if (D)                                                                                   \
                    for (int b = 0; b < MB; ++b) {                                                       \
                        const float *xm = x + (m0 + b) * ldx + c;                                        \
                        DELTA_ADD(dlt[b][i], sr[i] + c / 8, V_LOAD(xm));                                 \
                        DELTA_ADD(dlt[b][i], sr[i] + c / 8 + LANES / 8, V_LOAD(xm + LANES));             \
                    }                                                                                    \
            }                                                                                            \
        }                                                                                                \
        float bts[MB][R], dts[MB][R]; /* in registers, before the tails (PAIR_SUMS) */                  \
        UNROLLED for (int b = 0; b < MB; ++b)                                                            \
            UNROLLED for (int i = 0; i < R; ++i) {                                                       \
                bts[b][i] = V_SUM(base[b][i]);                                                           \
                dts[b][i] = D ? V_SUM(dlt[b][i]) : 0.f;                                                  \
            }                                                                                            \
        for (int b = 0; b < MB; ++b) {                                                                   \
            const float *xm = x + (m0 + b) * ldx;                                                        \
            for (int i = 0; i < nr; ++i) {                                                               \
                float bt = bts[b][i], dt = dts[b][i];                                                    \
                for (int64_t k = 2 * LANES * nchunk; k < d_in; ++k) { /* ragged tail */                  \
                    bt += xm[k] * w_at(w, WD, (r + i) * ldw + k);                                        \
                    if (D && ((s[(r + i) * lds + (k >> 3)] >> (k & 7)) & 1)) dt += xm[k];                \
                }                                                                                        \
                y[(m0 + b) * ldy + r + i] =                                                              \
                    D ? bt + alpha[(r + i) * alpha_stride] * (2.f * dt - xsum[m0 + b]) : bt;             \
            }                                                                                            \
        }                                                                                                \
    }

#if defined(__AVX512F__)
#define ROWS_A 8 /* weight rows of the one-x-row block */
#define ROWS_AD 4 /* the same with the delta (twice the accumulators, and a sign pointer per row) */
#define ROWS_B 4 /* weight rows of the two-x-rows block */
LINEAR_BLOCK(delta_one_f32, ROWS_AD, 1, BD_W_F32, 1)
LINEAR_BLOCK(delta_one_bf16, ROWS_AD, 1, BD_W_BF16, 1)
LINEAR_BLOCK(delta_one_f16, ROWS_AD, 1, BD_W_F16, 1)
LINEAR_BLOCK(dense_one_f32, 8, 1, BD_W_F32, 0)
LINEAR_BLOCK(dense_one_bf16, 8, 1, BD_W_BF16, 0)
LINEAR_BLOCK(dense_one_f16, 8, 1, BD_W_F16, 0)
#else
#define ROWS_A 4 /* 16 ymm registers */
#define ROWS_AD 4
#define ROWS_B 2
LINEAR_BLOCK(delta_one_f32, ROWS_AD, 1, BD_W_F32, 1)
LINEAR_BLOCK(delta_one_bf16, ROWS_AD, 1, BD_W_BF16, 1)
LINEAR_BLOCK(delta_one_f16, ROWS_AD, 1, BD_W_F16, 1)
LINEAR_BLOCK(dense_one_f32, 4, 1, BD_W_F32, 0)
LINEAR_BLOCK(dense_one_bf16, 4, 1, BD_W_BF16, 0)
LINEAR_BLOCK(dense_one_f16, 4, 1, BD_W_F16, 0)
#endif
#define MB_B 2
LINEAR_BLOCK(delta_two_f32, ROWS_B, 2, BD_W_F32, 1)
LINEAR_BLOCK(delta_two_bf16, ROWS_B, 2, BD_W_BF16, 1)
LINEAR_BLOCK(delta_two_f16, ROWS_B, 2, BD_W_F16, 1)
LINEAR_BLOCK(dense_two_f32, ROWS_B, 2, BD_W_F32, 0)
LINEAR_BLOCK(dense_two_bf16, ROWS_B, 2, BD_W_BF16, 0)
LINEAR_BLOCK(dense_two_f16, ROWS_B, 2, BD_W_F16, 0)
#define HAVE_LINEAR_BLOCKS 1

/* The weight stream's lines STREAM_AHEAD bytes on, requested as each line is read: the hardware
 * prefetchers alone kept one core's GEMV at ~0.7 of a plain read's bandwidth (a layer's matrices
 * are short streams, and the prefetchers stop at every 4 KB page). One core of an AMD EPYC (Zen 5),
 * a bf16 GEMV over matrices from memory: 21–24 GB/s without, 27–31 with (a plain read 31–34); the
 * C decode layers of a SmolLM2-135M step, the two in turns: 0.81 × the time in bf16, 0.82 × in fp32
 * (medians; 4 and 16 KB ahead measured no better). Past a matrix's end it fetches a few lines
 * nobody reads; a prefetch never faults. */
#define STREAM_AHEAD 8192
/* `lines` cache lines from `ahead` bytes past p, into the cache level `hint` names. */
#define PREFETCH_LINES(p, ahead, lines, hint)                                                            \
    do {                                                                                                 \
        for (int l_ = 0; l_ < (lines); ++l_) _mm_prefetch((const char *)(p) + (ahead) + 64 * l_, hint);  \
    } while (0)
#define STREAM_PREFETCH(p, lines) PREFETCH_LINES(p, STREAM_AHEAD, lines, _MM_HINT_T0)

/* The AVX-512 build's blocks of R > 1 weight rows request their R streams' lines into L2 (T1), 16 KB
 * on: into L1 (T0) 8 KB on, three streams' 24 KB of lines ahead filled most of a 32 KB L1 that the
 * block's weight rows and x rows live in. One core of a 2-core AMD EPYC of the Zen 4 generation,
 * SmolLM2-135M's 30 layers and head back to back in fp32 (2026-12-05, in turns, medians): at 8 x
 * rows 51 ms with T0 against 37–39 with T1 (8–64 KB on; T1 4 KB on 51, T2 as T1, NTA as T0), at 6
 * rows 46 against 29; and three weight rows' blocks from 3 x rows on (DENSE_MIN_M_F32, below)
 * 19 ms at 3 rows against 25 for one-row blocks. The one-row blocks keep STREAM_PREFETCH (or none:
 * one_row_prefetch); the AVX2 build keeps T0 (measured on a Zen 3 core with it). The bf16 dot-product
 * blocks (DENSE_BLOCK_DP) request theirs 16 KB on (ROWS_AHEAD_DP), except at exactly 4 x rows, 8 KB
 * on (ROWS_AHEAD_DP_FOUR, the blocks of DENSE_ROWS' table half for DENSE_MB rows). Once the blocks'
 * sums stayed in registers (PAIR_SUMS), the C decode layers' bf16 step (`bench/kernels.py
 * --decode-layers`, two runs of 25 reps in turns, 2026-12-06) took at 4 x rows 10.3–10.7 ms with
 * 8 KB against 11.5–12.5 with 16 KB (11.1–12.7 before PAIR_SUMS), at 8 rows 15.8–16.1 against
 * 14.8–15.0 (18.3–18.6 before); three more runs of the base's steps at 3–8 rows in turns the same
 * day: 16 KB faster at 3, 5, 6, 7 and 8 rows (by 2–7 %), slower at 4 (by 4–22 %). Only the first
 * block over a weight row requesting its lines (the second block of 8 rows reads them from L1) ran
 * 6–10 % slower at 6 and 8 rows. fp32's blocks, the other way, ran faster with 16 KB than with 8 at
 * 4 rows too: 19.3–19.8 against 21.8–22.6 ms, and 30.1–30.4 against 31.8–32.2 at 8; 32 KB read
 * 2–3 % faster at 3–8 rows in two runs and 6 % slower at 4 rows in a third: not kept. */
#define ROWS_AHEAD 16384
#define ROWS_AHEAD_DP 16384
#define ROWS_AHEAD_DP_FOUR 8192
#define ROWS_PREFETCH(p, ahead, lines) PREFETCH_LINES(p, ahead, lines, _MM_HINT_T1)
#if defined(__AVX512F__)
/* R > 1 rows' blocks ROWS_PREFETCH `ahead` bytes on, one row's STREAM_PREFETCH */
#define BLOCK_STREAM_PREFETCH(R, ahead, p, lines)                                                        \
    do {                                                                                                 \
        if ((R) > 1)                                                                                     \
            ROWS_PREFETCH(p, ahead, lines);                                                              \
        else                                                                                             \
            STREAM_PREFETCH(p, lines);                                                                   \
    } while (0)
#else
#define BLOCK_STREAM_PREFETCH(R, ahead, p, lines) STREAM_PREFETCH(p, lines)
#endif

/* Whether a block of R weight rows × MB x rows of dtype WD prefetches its stream. In the AVX-512
 * build every block does, except the one-weight-row blocks (R = 1: fewer than 3 x rows, a single
 * stream's decode) on a CPU where one_row_prefetch is off. The AVX2 build's
 * one-row block does not: on a Zen 3 core (the one AVX2-only CPU measured) the hardware
 * prefetchers keep its light loop at a plain read's speed (a 512 MiB matrix 17.6–19 GB/s, a sum
 * 18.4), and the prefetches cost ~12 % (SmolLM2-135M's matrices 15.1–15.8 GB/s without, 13.3–14.0
 * with; the C decode layers' one-row step 0.84–0.89× the time without). Its bf16 block and the
 * larger blocks, with more work per byte, gain from them; so does Zen 5's one-row block (above). */
#if defined(__AVX512F__)
#define BLOCK_PREFETCH(WD, R, MB) ((R) > 1 || one_row_prefetch)
#else
#define BLOCK_PREFETCH(WD, R, MB) ((WD) != BD_W_F32 || (R) * (MB) > 1)
#endif

/* v stays in a register from here: the compiler may no longer fold the load that made it into the
 * instructions using it (an empty asm that takes and returns v; no code). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

/* The dense blocks' accumulators: two per (weight row, x row) pair, the vectors of even and of odd
 * index; stored as their sum and then the ragged tail from k on (xs: the x rows the tail reads,
 * each of ldx floats; w of dtype WD), y[m0 + b, r + i]. */
#define PAIR_ACC_INIT(R, MB)                                                                             \
    vf a[R][MB][2];                                                                                      \
    UNROLLED for (int i = 0; i < R; ++i)                                                                 \
        UNROLLED for (int b = 0; b < MB; ++b) a[i][b][0] = a[i][b][1] = V_ZERO()
#define PAIR_ACC_STORE(R, MB, xs, w, WD)                                                                 \
    PAIR_SUMS(R, MB);                                                                                    \
    for (int i = 0; i < R; ++i)                                                                          \
        for (int b = 0; b < MB; ++b) {                                                                   \
            const float *xm_ = (xs) + (m0 + b) * ldx;                                                    \
            float t = sums[i][b];                                                                        \
            for (int64_t kk = k; kk < d_in; ++kk) t += xm_[kk] * w_at(w, WD, (r + i) * ldw + kk); /* tail */ \
            y[(m0 + b) * ldy + r + i] = t;                                                               \
        }

/* The dense GEMV (no delta) in register blocks of R weight rows × MB x rows: each weight vector
 * loaded once for MB x rows and each x vector once for R weight rows (a decode step's rows share
 * W; one weight row per x row at a time left 8 rows compute-bound at ~3× the 1-row time on one core
 * of an AMD EPYC, Zen 5). Every (weight row, x row) pair sums its products in two accumulators, the
 * vectors of even and of odd index, added at the end and then the ragged tail: the same order in
 * every block, so a row's result does not depend on how many rows its step has (--batch-invariant).
 * The R rows' weights are R linear streams, each prefetched STREAM_AHEAD on (BLOCK_PREFETCH).
 * KEEP: each weight and x vector stays in a register (IN_REGISTER) for all its FMAs; else GCC folds
 * the loads into the FMAs (one load per FMA, the weights' or x's): a 3 × 4 block then issues 30
 * loads to 24 FMAs, the loads its bound. One core of a 2-core AMD EPYC of the Zen 4 generation,
 * fp32, 8 x rows, the block on weights in L1: 20.5 FLOP per cycle folded, 29.2 kept (of 32). Which
 * blocks keep: DENSE_ROWS. */
#define DENSE_BLOCK(NAME, R, MB, WT, WD, KEEP)                                                           \
    static void NAME(const float *x, int64_t ldx, const WT *w, int64_t ldw, int64_t d_in, float *y,     \
                     int64_t ldy, int64_t r, int64_t m0) {                                               \
        PAIR_ACC_INIT(R, MB);                                                                            \
        int64_t k = 0;                                                                                   \
        for (; k + 2 * LANES <= d_in; k += 2 * LANES) {                                                  \
            if (BLOCK_PREFETCH(WD, R, MB) && (k * (int64_t)sizeof(WT)) % 64 == 0) /* a new line */     \
                for (int i = 0; i < R; ++i)                                                              \
                    BLOCK_STREAM_PREFETCH(R, ROWS_AHEAD, w + (r + i) * ldw + k, (2 * LANES * (int)sizeof(WT) + 63) / 64); \
            for (int h = 0; h < 2; ++h) {                                                                \
                vf wv[R];                                                                                \
                for (int i = 0; i < R; ++i) {                                                            \
                    const WT *wr = w + (r + i) * ldw + k;                                                \
                    if (WD == BD_W_F32)                                                                  \
                        wv[i] = V_LOAD((const float *)wr + h * LANES);                                   \
                    else /* bf16: one load of 2·LANES values, the even then the odd columns */          \
                        wv[i] = h == 0 ? V_BF16_EVEN(V_LOAD_I(wr)) : V_BF16_ODD(V_LOAD_I(wr));           \
                    if (KEEP) IN_REGISTER(wv[i]);                                                        \
                }                                                                                        \
                for (int b = 0; b < MB; ++b) {                                                           \
                    vf xv = V_LOAD(x + (m0 + b) * ldx + k + h * LANES);                                  \
                    if (KEEP) IN_REGISTER(xv);                                                           \
                    for (int i = 0; i < R; ++i) a[i][b][h] = V_FMA(xv, wv[i], a[i][b][h]);               \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        if (WD == BD_W_F32 && k + LANES <= d_in) {                                                       \
            UNROLLED for (int b = 0; b < MB; ++b) {                                                      \
                const vf xv = V_LOAD(x + (m0 + b) * ldx + k);                                            \
                UNROLLED for (int i = 0; i < R; ++i)                                                     \
                    a[i][b][0] = V_FMA(xv, V_LOAD((const float *)(w + (r + i) * ldw + k)), a[i][b][0]);  \
            }                                                                                            \
            k += LANES;                                                                                  \
        }                                                                                                \
        PAIR_ACC_STORE(R, MB, x, w, WD);                                                                 \
    }
/* A block of R > 1 weight rows twice: its vectors kept in registers, and NAME_fold with the loads
 * folded. DENSE_BLOCKS(P, WT, WD) stamps out a build's blocks P_RxMB (pairs where R > 1), and
 * DENSE_TABLE(P, S) is a table of them [R - 1][mb_index(MB)], S the suffix of its R > 1 blocks
 * (empty: kept; _fold): a DENSE_ROWS table is {DENSE_TABLE(P, ), DENSE_TABLE(P, _fold)}. */
#define DENSE_BLOCK_PAIR(NAME, R, MB, WT, WD) DENSE_BLOCK(NAME, R, MB, WT, WD, 1) DENSE_BLOCK(NAME##_fold, R, MB, WT, WD, 0)
#if defined(__AVX512F__)
#define DENSE_R 3  /* 3 × 4 pairs × 2 accumulators + 3 weight vectors + an x vector: 28 of 32 registers */
#define DENSE_MB 4
#define DENSE_BLOCKS(P, WT, WD)                                                                          \
    DENSE_BLOCK_PAIR(P##_3x4, 3, 4, WT, WD) DENSE_BLOCK_PAIR(P##_3x2, 3, 2, WT, WD)                      \
    DENSE_BLOCK_PAIR(P##_3x1, 3, 1, WT, WD) DENSE_BLOCK_PAIR(P##_2x4, 2, 4, WT, WD)                      \
    DENSE_BLOCK_PAIR(P##_2x2, 2, 2, WT, WD) DENSE_BLOCK_PAIR(P##_2x1, 2, 1, WT, WD)                      \
    DENSE_BLOCK(P##_1x4, 1, 4, WT, WD, 0) DENSE_BLOCK(P##_1x2, 1, 2, WT, WD, 0) DENSE_BLOCK(P##_1x1, 1, 1, WT, WD, 0)
#define DENSE_TABLE(P, S)                                                                                \
    {{P##_1x1, P##_1x2, P##_1x4}, {P##_2x1##S, P##_2x2##S, P##_2x4##S}, {P##_3x1##S, P##_3x2##S, P##_3x4##S}}
#else
/* 16 ymm registers: 2 × 3 pairs × 2 accumulators + 2 weight vectors + an x vector. 2 × 2 blocks
 * took 1.1–1.3× the time at 6–8 x rows on a Zen 3 core (SmolLM2's head: each weight row pair read
 * by 4 blocks while 8 x rows and the stream's look-ahead filled L1; docs/kernels.md). */
#define DENSE_R 2
#define DENSE_MB 3
#define DENSE_BLOCKS(P, WT, WD)                                                                          \
    DENSE_BLOCK_PAIR(P##_2x3, 2, 3, WT, WD) DENSE_BLOCK_PAIR(P##_2x2, 2, 2, WT, WD)                      \
    DENSE_BLOCK_PAIR(P##_2x1, 2, 1, WT, WD) DENSE_BLOCK(P##_1x3, 1, 3, WT, WD, 0)                        \
    DENSE_BLOCK(P##_1x2, 1, 2, WT, WD, 0) DENSE_BLOCK(P##_1x1, 1, 1, WT, WD, 0)
#define DENSE_TABLE(P, S) {{P##_1x1, P##_1x2, P##_1x3}, {P##_2x1##S, P##_2x2##S, P##_2x3##S}}
#endif
DENSE_BLOCKS(dense_f32, float, BD_W_F32)
typedef void (*dense_f32_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t);
static const dense_f32_fn dense_f32_blocks[2][DENSE_R][3] = {DENSE_TABLE(dense_f32, ), DENSE_TABLE(dense_f32, _fold)};

/* DENSE_R weight rows per block from this many x rows on (MIN_M of DENSE_ROWS); fewer take one row
 * at a time, one linear stream, in blocks of at most DENSE_MB_ONE x rows. In the AVX-512 build from 3
 * x rows on, fp32 and bf16 (VDPBF16PS) alike: on one core of a 2-core AMD EPYC of the Zen 4
 * generation, SmolLM2-135M's 30 layers and head back to back (GEMVs from Python, in turns, medians;
 * 2026-12-05) took at 2 / 3 / 4 / 5 / 8 x rows 18.0 / 18.7 / 20.0 / 24.7 / 37.4 ms in fp32 and
 * 10.2 / 9.2 / 10.6 / 11.7 / 17.2 in bf16 with three weight rows' blocks from 3 rows on, against
 * one-row blocks' 18.0 / 24.8 / 30.3 at 2–4 rows (bf16 9.8 / 11.5 / 18.5), and three rows' blocks at
 * 2 rows 22.1 (bf16 12.0); one x row takes 16.3 (bf16 9.2). Before their streams went to L2
 * (ROWS_PREFETCH) the three rows' blocks read W at ~15 GB/s below 5 rows and the thresholds were 5
 * (fp32) and 6 (bf16). The AVX2 build keeps 3 and DENSE_MB (measured on a Zen 3 core; the note
 * there). */
#if defined(__AVX512F__)
#define DENSE_MIN_M_F32 3
#define DENSE_MIN_M_DP 3
#define DENSE_MB_ONE 2
#else
#define DENSE_MIN_M_F32 3
#define DENSE_MB_ONE DENSE_MB
#endif

/* mb index of a block of n x rows in the tables (1, 2, DENSE_MB (4 or 3) -> 0, 1, 2) */
static inline int mb_index(int64_t n) { return n >= 3 ? 2 : (int)(n - 1); }

/* y[m, r] = x_m · W_r for rows [r0, r1) and every x row by a table of blocks [K][R - 1][mb_index(MB)]:
 * DENSE_R weight rows at a time (their weights stay in L1 for all x rows) in blocks of DENSE_MB x
 * rows; below MIN_M x rows one weight row at a time in blocks of DENSE_MB_ONE; then 2 and 1 for the
 * rest. K = 1 (the folded blocks, DENSE_BLOCK's KEEP) for DENSE_MB x rows, one block that reads the
 * weights from memory with no later block reusing them from L1; K = 0 (kept) for any other count.
 * One core of a 2-core AMD EPYC of the Zen 4 generation, SmolLM2-135M's 30 layers and head in fp32
 * (GEMVs called from Python, in turns, medians, 2026-12-05): kept vectors at 3 / 5 / 6 / 7 / 8 x rows
 * 20.0 / 24.1 / 26.7 / 29.9 / 34.3 ms against 20.3–20.7 / 26.3 / 30.2 / 34.7 / 39.9 folded, but at 4
 * rows 26.4–27.5 against 22.4–22.8 (why: not found). A 3 × 3 block for 3 rows (one pass instead of
 * 2 + 1) ran faster on weights in L2 but 1.3–1.4× slower from memory, fp32 and bf16 (not kept). Every
 * block sums a (weight row, x row) pair in the same order: the blocks change no bit. */
#define DENSE_ROWS(NAME, XT, WT, BLOCKS, MIN_M)                                                          \
    static void NAME(const XT *x, int64_t ldx, int64_t M, const WT *w, int64_t ldw, int64_t d_in, float *y, \
                     int64_t ldy, int64_t r0, int64_t r1) {                                              \
        const int64_t R = M >= (MIN_M) ? DENSE_R : 1, MB = R > 1 ? DENSE_MB : DENSE_MB_ONE;             \
        __typeof__(&BLOCKS[0][0]) blocks = BLOCKS[M == DENSE_MB];                                        \
        for (int64_t r = r0; r < r1; r += R) {                                                           \
            const int64_t nr = (r1 - r) < R ? r1 - r : R;                                                \
            for (int64_t m = 0; m < M;) {                                                                \
                const int64_t nb = M - m >= MB ? MB : (M - m >= 2 ? 2 : 1);                              \
                blocks[nr - 1][mb_index(nb)](x, ldx, w, ldw, d_in, y, ldy, r, m);                        \
                m += nb;                                                                                 \
            }                                                                                            \
        }                                                                                                \
    }
DENSE_ROWS(dense_rows_f32, float, float, dense_f32_blocks, DENSE_MIN_M_F32)

#if !defined(__AVX512F__)
/* AVX2: bf16 weights widened in registers (`<< 16` the even columns, `& 0xffff0000` the odd,
 * against xeo: per chunk 8 even then 8 odd x values, its ragged tail x's own) in the same blocks
 * as fp32: one weight row, one linear stream, below DENSE_MIN_M_F32 x rows, each line prefetched.
 * LINEAR_BLOCK's four rows at a time read a SmolLM2-135M's bf16 matrices at 9.1 GB/s on one Zen 3
 * core, these at 13.5 (a plain read 17.7; medians of 12, the two in turns). The AVX-512 build
 * keeps LINEAR_BLOCK (not measured). */
DENSE_BLOCKS(dense_bf16, uint16_t, BD_W_BF16)
typedef void (*dense_bf16_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t, float *, int64_t, int64_t,
                              int64_t);
static const dense_bf16_fn dense_bf16_blocks[2][DENSE_R][3] = {DENSE_TABLE(dense_bf16, ), DENSE_TABLE(dense_bf16, _fold)};
DENSE_ROWS(dense_rows_bf16, float, uint16_t, dense_bf16_blocks, DENSE_MIN_M_F32) /* bf16 weights, x as xeo */
#define HAVE_DENSE_BF16 1
#endif

#if defined(__AVX512BF16__)
/* bf16 weights and an x that is exactly bf16 (a bf16 model's activations), no delta: one VDPBF16PS
 * per 32 weights (pairs of exact products summed in fp32; denormals flushed) instead of widening
 * both halves and two FMAs (that path was compute-bound at ~0.7× of the bf16 weights' bandwidth on
 * one core). Blocks as DENSE_BLOCK, the two accumulators over 32-value chunks of even and odd
 * index, blocks of R > 1 weight rows with their vectors kept (IN_REGISTER) at any row count: on the
 * Zen 4 core of DENSE_ROWS' note, SmolLM2-135M's GEMVs at 3 / 4 / 6 / 8 x rows 9.2 / 10.4 / 13.3 / 16.7
 * ms against 10.3 / 10.4 / 14.4 / 17.0 as GCC compiled them. xb: x as bf16, x's layout. */
#define DENSE_BLOCK_DP(NAME, R, MB, AHEAD)                                                               \
    static void NAME(const uint16_t *xb, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t d_in,     \
                     float *y, int64_t ldy, int64_t r, int64_t m0) {                                     \
        __m512 a[R][MB][2];                                                                              \
        UNROLLED for (int i = 0; i < R; ++i)                                                             \
            UNROLLED for (int b = 0; b < MB; ++b) a[i][b][0] = a[i][b][1] = _mm512_setzero_ps();         \
        int64_t k = 0;                                                                                   \
        for (; k + 64 <= d_in; k += 64) {                                                                \
            if (BLOCK_PREFETCH(BD_W_BF16, R, MB))                                                        \
                for (int i = 0; i < R; ++i)                                                              \
                    BLOCK_STREAM_PREFETCH(R, AHEAD, w + (r + i) * ldw + k, 2);                           \
            for (int h = 0; h < 2; ++h) {                                                                \
                __m512bh wv[R];                                                                          \
                for (int i = 0; i < R; ++i) {                                                            \
                    wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(w + (r + i) * ldw + k + 32 * h)); \
                    if (R > 1) IN_REGISTER(wv[i]);                                                       \
                }                                                                                        \
                for (int b = 0; b < MB; ++b) {                                                           \
                    __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + (m0 + b) * ldx + k + 32 * h)); \
                    if (R > 1) IN_REGISTER(xv);                                                          \
                    for (int i = 0; i < R; ++i) a[i][b][h] = _mm512_dpbf16_ps(a[i][b][h], xv, wv[i]);    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        if (k + 32 <= d_in) {                                                                            \
            UNROLLED for (int b = 0; b < MB; ++b) {                                                      \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + (m0 + b) * ldx + k)); \
                UNROLLED for (int i = 0; i < R; ++i)                                                     \
                    a[i][b][0] = _mm512_dpbf16_ps(a[i][b][0], xv,                                        \
                                                  (__m512bh)_mm512_loadu_si512((const void *)(w + (r + i) * ldw + k))); \
            }                                                                                            \
            k += 32;                                                                                     \
        }                                                                                                \
        PAIR_SUMS(R, MB); /* V_SUM: _mm512_reduce_add_ps here */                                         \
        for (int i = 0; i < R; ++i)                                                                      \
            for (int b = 0; b < MB; ++b) {                                                               \
                const uint16_t *xm = xb + (m0 + b) * ldx, *wr = w + (r + i) * ldw;                       \
                float t = sums[i][b];                                                                    \
                for (int64_t kk = k; kk < d_in; ++kk) t += w_at(xm, BD_W_BF16, kk) * w_at(wr, BD_W_BF16, kk); \
                y[(m0 + b) * ldy + r + i] = t;                                                           \
            }                                                                                            \
    }
/* R > 1 rows' blocks twice: NAME with their streams ROWS_AHEAD_DP on, NAME_four (the table half of
 * DENSE_MB = 4 x rows) ROWS_AHEAD_DP_FOUR on */
#define DENSE_BLOCK_DP_PAIR(NAME, R, MB)                                                                 \
    DENSE_BLOCK_DP(NAME, R, MB, ROWS_AHEAD_DP) DENSE_BLOCK_DP(NAME##_four, R, MB, ROWS_AHEAD_DP_FOUR)
DENSE_BLOCK_DP_PAIR(dense_dp_3x4, 3, 4)
DENSE_BLOCK_DP_PAIR(dense_dp_3x2, 3, 2)
DENSE_BLOCK_DP_PAIR(dense_dp_3x1, 3, 1)
DENSE_BLOCK_DP_PAIR(dense_dp_2x4, 2, 4)
DENSE_BLOCK_DP_PAIR(dense_dp_2x2, 2, 2)
DENSE_BLOCK_DP_PAIR(dense_dp_2x1, 2, 1)
DENSE_BLOCK_DP(dense_dp_1x4, 1, 4, ROWS_AHEAD_DP)
DENSE_BLOCK_DP(dense_dp_1x2, 1, 2, ROWS_AHEAD_DP)
DENSE_BLOCK_DP(dense_dp_1x1, 1, 1, ROWS_AHEAD_DP)
typedef void (*dense_dp_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, float *, int64_t, int64_t,
                            int64_t);
/* kept at every row count; 4 x rows' half requests its streams nearer (ROWS_AHEAD_DP_FOUR) */
static const dense_dp_fn dense_dp_blocks[2][3][3] = {DENSE_TABLE(dense_dp, ), DENSE_TABLE(dense_dp, _four)};

DENSE_ROWS(dense_rows_dp, uint16_t, uint16_t, dense_dp_blocks, DENSE_MIN_M_DP) /* bf16 weights and x (as bf16 words) */
#define HAVE_DP_BF16 1

/* y[b, r] = x_b · W_r + Σ_p α_p,r · (x_b · S_p,r) for NX x rows (of one variant) that are exactly
 * bf16, rows [r0, r1), in ONE pass: per 32 columns one VDPBF16PS per x row against the weights
 * and, per plane, one against its signs as bf16 ±1 (a blend by the 32 bits loaded as a mask, once
 * for all x rows), all sums fp32 (products exact), each α applied per lane before the one
 * horizontal add. One weight row at a time, one linear stream of W (prefetched STREAM_AHEAD on:
 * without it this loop, unlike the dense one, fell behind on Zen 4) beside the bits' (1/16 of its
 * bytes): a variant's rows read its bytes once instead of the table loop's second pass. A bf16
 * SmolLM2-135M variant's one-row decode step in the worker, one Zen 4 core: 0.88–0.91 × the base's
 * against 0.84–0.86 for the two passes (the bytes' limit 0.95; 2026-12-04, in turns). Its sums are
 * not the table loop's, so only a single-variant step takes it (bd_decode_layers' `fuse`, never
 * batch-invariant); an x row's sums take the same steps whatever NX. A 3-plane row's planes past
 * the first cost ~0.04 of the base's step each here (bytes 1/16), against ~0.15 by the table loop
 * (docs/kernels.md). Two or three x rows (one plane) take blocks of ONE_PASS_R weight rows (their
 * streams requested into L2 as the dense blocks' are, a half of 64 columns at a time), which share
 * each x vector between the weight rows: every (weight row, x row) pair still takes the very adds
 * of the one-row loop, so a row's sums are the same in a step of 1, 2 or 3 rows. NX, NP, R: x rows,
 * P's planes and weight rows, literals (delta_rows_dp). */
static inline __attribute__((always_inline)) void dp_rows_block(const uint16_t *xb, int64_t ldx, const uint16_t *w,
                                                                int64_t ldw, const pass_planes *P, int64_t lds,
                                                                int64_t d_in, int64_t alpha_stride, float *y,
                                                                int64_t ldy, int64_t r, const int NX, const int NP,
                                                                const int R) {
    const __m512i pos = _mm512_set1_epi16(0x3F80), neg = _mm512_set1_epi16((short)0xBF80); /* bf16 ±1 */
    ONE_PASS_BLOCK_INIT(uint16_t, NX, NP, R);
    int64_t k = 0;
    for (; k + 64 <= d_in; k += 64) {
        if (R == 1) { /* both halves' weights and signs, then each x row's four products */
            STREAM_PREFETCH(wr[0] + k, 2);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wr[0] + k));
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wr[0] + k + 32));
            __m512bh s0[ONE_PASS_PLANES], s1[ONE_PASS_PLANES]; /* each plane's 64 signs as bf16 ±1 */
            for (int p = 0; p < NP; ++p) {
                uint32_t m0, m1;
                memcpy(&m0, sr[p][0] + k / 8, 4);
                memcpy(&m1, sr[p][0] + k / 8 + 4, 4);
                s0[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m0, neg, pos);
                s1[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m1, neg, pos);
            }
            for (int b = 0; b < NX; ++b) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k));
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k + 32));
                a0[0][b] = _mm512_dpbf16_ps(a0[0][b], x0, w0);
                a1[0][b] = _mm512_dpbf16_ps(a1[0][b], x1, w1);
                for (int p = 0; p < NP; ++p) {
                    d0[p][0][b] = _mm512_dpbf16_ps(d0[p][0][b], x0, s0[p]);
                    d1[p][0][b] = _mm512_dpbf16_ps(d1[p][0][b], x1, s1[p]);
                }
            }
        } else { /* a half (32 columns) at a time: R rows' weights and signs, then every x row's */
            for (int i = 0; i < R; ++i) BLOCK_STREAM_PREFETCH(R, ROWS_AHEAD_DP, wr[i] + k, 2);
            UNROLLED for (int h = 0; h < 2; ++h) {
                __m512bh wv[ONE_PASS_R], sv[ONE_PASS_PLANES][ONE_PASS_R];
                UNROLLED for (int i = 0; i < R; ++i) {
                    wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(wr[i] + k + 32 * h));
                    UNROLLED for (int p = 0; p < NP; ++p) {
                        uint32_t m;
                        memcpy(&m, sr[p][i] + k / 8 + 4 * h, 4);
                        sv[p][i] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m, neg, pos);
                    }
                }
                UNROLLED for (int b = 0; b < NX; ++b) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k + 32 * h));
                    UNROLLED for (int i = 0; i < R; ++i) {
                        if (h) {
                            a1[i][b] = _mm512_dpbf16_ps(a1[i][b], xv, wv[i]);
                            UNROLLED for (int p = 0; p < NP; ++p) d1[p][i][b] = _mm512_dpbf16_ps(d1[p][i][b], xv, sv[p][i]);
                        } else {
                            a0[i][b] = _mm512_dpbf16_ps(a0[i][b], xv, wv[i]);
                            UNROLLED for (int p = 0; p < NP; ++p) d0[p][i][b] = _mm512_dpbf16_ps(d0[p][i][b], xv, sv[p][i]);
                        }
                    }
                }
            }
        }
    }
    const int half = k + 32 <= d_in;
    if (half) /* 32 columns more: the first halves' accumulators */
        UNROLLED for (int i = 0; i < R; ++i) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wr[i] + k));
            __m512bh s0[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) {
                uint32_t m0;
                memcpy(&m0, sr[p][i] + k / 8, 4);
                s0[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m0, neg, pos);
            }
            for (int b = 0; b < NX; ++b) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k));
                a0[i][b] = _mm512_dpbf16_ps(a0[i][b], x0, w0);
                for (int p = 0; p < NP; ++p) d0[p][i][b] = _mm512_dpbf16_ps(d0[p][i][b], x0, s0[p]);
            }
        }
    UNROLLED for (int i = 0; i < R; ++i) {
        float al[ONE_PASS_PLANES];
        for (int p = 0; p < NP; ++p) al[p] = P->a[p][(r + i) * alpha_stride];
        float sums[ONE_PASS_BLOCK_ROWS]; /* in registers, before the tails (PAIR_SUMS) */
        UNROLLED for (int b = 0; b < NX; ++b) {
            __m512 acc = _mm512_add_ps(a0[i][b], a1[i][b]);
            UNROLLED for (int p = 0; p < NP; ++p)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(al[p]), _mm512_add_ps(d0[p][i][b], d1[p][i][b]), acc);
            sums[b] = _mm512_reduce_add_ps(acc);
        }
        for (int b = 0; b < NX; ++b) {
            const uint16_t *xm = xb + b * ldx;
            float t = sums[b];
            for (int64_t kk = k + 32 * half; kk < d_in; ++kk) { /* ragged tail */
                const float xv = w_at(xm, BD_W_BF16, kk);
                float dt = 0.f;
                for (int p = 0; p < NP; ++p) dt += al[p] * ((sr[p][i][kk >> 3] >> (kk & 7)) & 1 ? xv : -xv);
                t += xv * w_at(wr[i], BD_W_BF16, kk) + dt;
            }
            y[b * ldy + r + i] = t;
        }
    }
}

/* Rows [r0, r1) of dp_rows_block: R at a time, the last few one at a time (a row's sums the same). */
static inline __attribute__((always_inline)) void dp_rows_np(const uint16_t *xb, int64_t ldx, const uint16_t *w,
                                                             int64_t ldw, const pass_planes *P, int64_t lds,
                                                             int64_t d_in, int64_t alpha_stride, float *y, int64_t ldy,
                                                             int64_t r0, int64_t r1, const int NX, const int NP,
                                                             const int R) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) dp_rows_block(xb, ldx, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r, NX, NP, R);
    for (; r < r1; ++r) dp_rows_block(xb, ldx, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r, NX, NP, 1);
}
static void delta_rows_dp(const uint16_t *xb, int64_t ldx, int64_t M, const uint16_t *w, int64_t ldw,
                          const pass_planes *P, int64_t lds, int64_t d_in, int64_t alpha_stride, float *y, int64_t ldy,
                          int64_t r0, int64_t r1) {
#define DP_ROWS(NX, NP, R) dp_rows_np(xb, ldx, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1, NX, NP, R)
    switch (M * 8 + P->n) { /* n ≤ one_pass_most(BD_W_BF16, M): the callers choose n so */
    case 9: DP_ROWS(1, 1, 1); break;
    case 10: DP_ROWS(1, 2, 1); break;
    case 11: DP_ROWS(1, 3, 1); break;
    case 12: DP_ROWS(1, 4, 1); break;
    case 17: DP_ROWS(2, 1, ONE_PASS_R); break;
    case 25: DP_ROWS(3, 1, ONE_PASS_R); break;
    default: abort();
    }
#undef DP_ROWS
}
#endif

#if defined(__AVX512F__)
/* y[b, r] = x_b · W_r + Σ_p α_p,r · (2 · Σ_{S_p,r = +} x_b − Σ x_b) for NX fp32 x rows (of one
 * variant), rows [r0, r1), in ONE pass: per 16 columns one FMA per x row against the weights and,
 * per plane and x row, one add of x masked by its 16 bits (loaded once for all x rows), so a
 * variant's planes ride its weights' stream (1/32 of its bytes each) instead of the table loop's
 * second pass. One weight row at a time, one linear stream of W, left to the hardware
 * prefetchers: on a Zen 4 core the software prefetch of delta_rows_dp cost this lighter loop 1–3 %
 * (SmolLM2-135M's C decode step with its head, one row, 100 in turns, four runs). The variant's
 * step ÷ the base's there: ~1 % above the two passes', within that host's spread (an fp32 step is
 * ~18 ms of weights; the table loop's compute ~0.5 ms of it). Three x rows (one plane) take blocks
 * of ONE_PASS_R weight rows (their streams requested into L2 as the dense blocks' are, a half of 32
 * columns at a time) sharing each x vector (measured at one_pass_most). Every (weight row, x row)
 * pair takes the one-row loop's very adds, so a row's sums are the same in a step of 1, 2 or 3 rows.
 * xsum: Σ x_b (row_sums). NX, NP, R: x rows, P's planes and weight rows, literals (delta_rows_f32). */
static inline __attribute__((always_inline)) void f32_rows_block(const float *x, int64_t ldx, const float *xsum,
                                                                 const float *w, int64_t ldw, const pass_planes *P,
                                                                 int64_t lds, int64_t d_in, int64_t alpha_stride,
                                                                 float *y, int64_t ldy, int64_t r, const int NX,
                                                                 const int NP, const int R) {
    ONE_PASS_BLOCK_INIT(float, NX, NP, R);
    int64_t k = 0;
    for (; k + 32 <= d_in; k += 32) {
        if (R == 1) { /* both halves' weights, then each x row's */
            const __m512 w0 = _mm512_loadu_ps(wr[0] + k), w1 = _mm512_loadu_ps(wr[0] + k + 16);
            uint32_t m[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) memcpy(&m[p], sr[p][0] + k / 8, 4);
            for (int b = 0; b < NX; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x + b * ldx + k), x1 = _mm512_loadu_ps(x + b * ldx + k + 16);
                a0[0][b] = _mm512_fmadd_ps(x0, w0, a0[0][b]);
                a1[0][b] = _mm512_fmadd_ps(x1, w1, a1[0][b]);
                for (int p = 0; p < NP; ++p) {
                    d0[p][0][b] = _mm512_mask_add_ps(d0[p][0][b], (__mmask16)m[p], d0[p][0][b], x0);
                    d1[p][0][b] = _mm512_mask_add_ps(d1[p][0][b], (__mmask16)(m[p] >> 16), d1[p][0][b], x1);
                }
            }
        } else { /* a half (16 columns) at a time: R rows' weights, then every x row's */
            for (int i = 0; i < R; ++i) BLOCK_STREAM_PREFETCH(R, ROWS_AHEAD, wr[i] + k, 2);
            uint32_t m[ONE_PASS_PLANES][ONE_PASS_R];
            UNROLLED for (int i = 0; i < R; ++i)
                UNROLLED for (int p = 0; p < NP; ++p) memcpy(&m[p][i], sr[p][i] + k / 8, 4);
            UNROLLED for (int h = 0; h < 2; ++h) {
                __m512 wv[ONE_PASS_R];
                UNROLLED for (int i = 0; i < R; ++i) wv[i] = _mm512_loadu_ps(wr[i] + k + 16 * h);
                UNROLLED for (int b = 0; b < NX; ++b) {
                    const __m512 xv = _mm512_loadu_ps(x + b * ldx + k + 16 * h);
                    UNROLLED for (int i = 0; i < R; ++i) {
                        if (h) {
                            a1[i][b] = _mm512_fmadd_ps(xv, wv[i], a1[i][b]);
                            UNROLLED for (int p = 0; p < NP; ++p)
                                d1[p][i][b] = _mm512_mask_add_ps(d1[p][i][b], (__mmask16)(m[p][i] >> 16), d1[p][i][b], xv);
                        } else {
                            a0[i][b] = _mm512_fmadd_ps(xv, wv[i], a0[i][b]);
                            UNROLLED for (int p = 0; p < NP; ++p)
                                d0[p][i][b] = _mm512_mask_add_ps(d0[p][i][b], (__mmask16)m[p][i], d0[p][i][b], xv);
                        }
                    }
                }
            }
        }
    }
    const int half = k + 16 <= d_in;
    if (half)
        UNROLLED for (int i = 0; i < R; ++i) {
            const __m512 w0 = _mm512_loadu_ps(wr[i] + k);
            uint16_t m0[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) memcpy(&m0[p], sr[p][i] + k / 8, 2);
            for (int b = 0; b < NX; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x + b * ldx + k);
                a0[i][b] = _mm512_fmadd_ps(x0, w0, a0[i][b]);
                for (int p = 0; p < NP; ++p) d0[p][i][b] = _mm512_mask_add_ps(d0[p][i][b], (__mmask16)m0[p], d0[p][i][b], x0);
            }
        }
    UNROLLED for (int i = 0; i < R; ++i) {
        float al[ONE_PASS_PLANES], asum = 0.f;
        for (int p = 0; p < NP; ++p) {
            al[p] = P->a[p][(r + i) * alpha_stride];
            asum += al[p];
        }
        float sums[ONE_PASS_BLOCK_ROWS]; /* in registers, before the tails (PAIR_SUMS) */
        UNROLLED for (int b = 0; b < NX; ++b) {
            __m512 acc = _mm512_add_ps(a0[i][b], a1[i][b]);
            UNROLLED for (int p = 0; p < NP; ++p)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(2.f * al[p]), _mm512_add_ps(d0[p][i][b], d1[p][i][b]), acc);
            sums[b] = _mm512_reduce_add_ps(acc);
        }
        for (int b = 0; b < NX; ++b) {
            const float *xm = x + b * ldx;
            float t = sums[b];
            for (int64_t kk = k + 16 * half; kk < d_in; ++kk) { /* ragged tail */
                float dt = 0.f;
                for (int p = 0; p < NP; ++p) dt += (sr[p][i][kk >> 3] >> (kk & 7)) & 1 ? 2.f * al[p] * xm[kk] : 0.f;
                t += xm[kk] * wr[i][kk] + dt;
            }
            y[b * ldy + r + i] = t - asum * xsum[b];
        }
    }
}

/* Rows [r0, r1) of f32_rows_block: R at a time, the last few one at a time (a row's sums the same). */
static inline __attribute__((always_inline)) void f32_rows_np(const float *x, int64_t ldx, const float *xsum,
                                                              const float *w, int64_t ldw, const pass_planes *P,
                                                              int64_t lds, int64_t d_in, int64_t alpha_stride, float *y,
                                                              int64_t ldy, int64_t r0, int64_t r1, const int NX,
                                                              const int NP, const int R) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) f32_rows_block(x, ldx, xsum, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r, NX, NP, R);
    for (; r < r1; ++r) f32_rows_block(x, ldx, xsum, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r, NX, NP, 1);
}
static void delta_rows_f32(const float *x, int64_t ldx, int64_t M, const float *xsum, const float *w, int64_t ldw,
                           const pass_planes *P, int64_t lds, int64_t d_in, int64_t alpha_stride, float *y,
                           int64_t ldy, int64_t r0, int64_t r1) {
#define F32_ROWS(NX, NP, R) f32_rows_np(x, ldx, xsum, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1, NX, NP, R)
    switch (M * 8 + P->n) { /* n ≤ one_pass_most(BD_W_F32, M): the callers choose n so */
    case 9: F32_ROWS(1, 1, 1); break;
    case 10: F32_ROWS(1, 2, 1); break;
    case 11: F32_ROWS(1, 3, 1); break;
    case 12: F32_ROWS(1, 4, 1); break;
    case 17: F32_ROWS(2, 1, 1); break;
    case 18: F32_ROWS(2, 2, 1); break;
    case 19: F32_ROWS(2, 3, 1); break;
    case 25: F32_ROWS(3, 1, ONE_PASS_R); break;
    default: abort();
    }
#undef F32_ROWS
}
#define HAVE_F32_ONE_PASS 1
#endif

#endif

/* Which one-pass loops this build has (one_pass_planes) */
#ifdef HAVE_DP_BF16
#define HAVE_DP_ONE_PASS 1 /* bf16: delta_rows_dp */
#else
#define HAVE_DP_ONE_PASS 0
#endif
#ifndef HAVE_F32_ONE_PASS
#define HAVE_F32_ONE_PASS 0 /* fp32: delta_rows_f32 */
#endif

/* Up to how many planes of one variant M x rows of weights of dtype sum in the weights' pass in
 * this build (0: none): one_pass_most(dtype, M) for fp32 where it has AVX-512 (delta_rows_f32) and for bf16
 * where it has AVX512-BF16 (delta_rows_dp). Their sums are more exact than the bf16 tables', so such
 * a row's bf16 logits can differ from the same row's in a mixed step by a unit in the last place,
 * and greedy tokens at such a near-tie can swap (tests/gpu_worker/test_worker_batch_invariance.py
 * checks that the logprobs stay within that unit). A row's numbers are the same whatever M: each x
 * row's sums take the same steps in every loop. */
static inline int one_pass_planes(int dtype, int64_t M) {
    const int has = dtype == BD_W_BF16 ? HAVE_DP_ONE_PASS : dtype == BD_W_F32 && HAVE_F32_ONE_PASS;
    return has ? one_pass_most(dtype, M) : 0;
}

#ifdef HAVE_LINEAR_BLOCKS
typedef void (*block_fn)(const float *, const float *, int64_t, const float *, const void *, int64_t,
                         const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int64_t, int64_t, int,
                         int64_t);

static void linear_rows(const float *x, const float *xeo, const uint16_t *xb, int64_t ldx, int64_t M, const float *xsum, const void *w, int w_dtype,
                        int64_t ldw, const pass_planes *P, int64_t lds, int64_t d_in,
                        int64_t alpha_stride, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    /* ROWS_A rows × 1 x-row: enough chains to keep loads in flight for one row of x;
     * ROWS_B rows × MB_B x-rows: each W vector feeds MB_B FMAs when M ≥ MB_B. */
    const uint8_t *s = P ? P->s[0] : NULL; /* the blocks' one plane */
    const float *alpha = P ? P->a[0] : NULL;
    const int k = w_dtype == BD_W_F32 ? 0 : (w_dtype == BD_W_BF16 ? 1 : 2);
    const block_fn one_d[3] = {delta_one_f32, delta_one_bf16, delta_one_f16};
    const block_fn two_d[3] = {delta_two_f32, delta_two_bf16, delta_two_f16};
    const block_fn one_b[3] = {dense_one_f32, dense_one_bf16, dense_one_f16};
    const block_fn two_b[3] = {dense_two_f32, dense_two_bf16, dense_two_f16};
    const block_fn one = s ? one_d[k] : one_b[k], two = s ? two_d[k] : two_b[k];
#ifdef HAVE_DP_BF16
    if (xb && !s && w_dtype == BD_W_BF16) {
        dense_rows_dp(xb, ldx, M, (const uint16_t *)w, ldw, d_in, y, ldy, r0, r1);
        return;
    }
    if (xb && s && w_dtype == BD_W_BF16 && P->n <= one_pass_most(BD_W_BF16, M)) {
        delta_rows_dp(xb, ldx, M, (const uint16_t *)w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1);
        return;
    }
#endif
#if HAVE_F32_ONE_PASS
    if (s && w_dtype == BD_W_F32 && P->n <= one_pass_most(BD_W_F32, M)) {
        delta_rows_f32(x, ldx, M, xsum, (const float *)w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1);
        return;
    }
#endif
    (void)xb;
    if (!s && w_dtype == BD_W_F32) {
        dense_rows_f32(x, ldx, M, (const float *)w, ldw, d_in, y, ldy, r0, r1);
        return;
    }
#ifdef HAVE_DENSE_BF16
    if (!s && w_dtype == BD_W_BF16) {
        dense_rows_bf16(xeo, ldx, M, (const uint16_t *)w, ldw, d_in, y, ldy, r0, r1);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r += ROWS_A) {
        const int64_t re = (r + ROWS_A) < r1 ? r + ROWS_A : r1;
        int64_t m = 0;
        for (; m + MB_B <= M; m += MB_B)
            for (int64_t q = r; q < re; q += ROWS_B)
                two(x, xeo, ldx, xsum, w, ldw, s, lds, d_in, alpha, alpha_stride, y, ldy, q,
                    (re - q) < ROWS_B ? (int)(re - q) : ROWS_B, m);
        const int64_t ra = s ? ROWS_AD : ROWS_A;
        for (; m < M; ++m)
            for (int64_t q = r; q < re; q += ra)
                one(x, xeo, ldx, xsum, w, ldw, s, lds, d_in, alpha, alpha_stride, y, ldy, q,
                    (re - q) < ra ? (int)(re - q) : (int)ra, m);
    }
}
#else
static void linear_rows(const float *x, const float *xeo, const uint16_t *xb, int64_t ldx, int64_t M, const float *xsum, const void *w, int w_dtype,
                        int64_t ldw, const pass_planes *P, int64_t lds, int64_t d_in,
                        int64_t alpha_stride, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    /* Portable path (the Python side prefers BLAS + delta GEMV without AVX2); one plane. */
    const uint8_t *s = P ? P->s[0] : NULL;
    const float *alpha = P ? P->a[0] : NULL;
    (void)xeo;
    (void)xb;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t m = 0; m < M; ++m) {
            const float *xm = x + m * ldx;
            float bt = 0.f, dt = 0.f;
            for (int64_t k = 0; k < d_in; ++k) {
                bt += xm[k] * w_at(w, w_dtype, r * ldw + k);
                if (s && ((s[r * lds + (k >> 3)] >> (k & 7)) & 1)) dt += xm[k];
            }
            y[m * ldy + r] = s ? bt + alpha[r * alpha_stride] * (2.f * dt - xsum[m]) : bt;
        }
}
#endif

/* Rows [r0, r1) of y = x · Wᵀ (linear_rows), then their planes (delta_rows_planes, no column α's;
 * s NULL: none): one thread's share of linear_planes, the planes' pass over the rows this thread's
 * GEMV wrote. (The two in turns of 32–512 rows measured no faster on one core, and the table loop
 * spread between the GEMV's weight rows 2× slower: the weights' stream pushed x's tables out of L1.) */
static void linear_planes_rows(const float *x, const float *xeo, const uint16_t *xb, const float *tab, int tab_bf16,
                               int64_t ldx,
                               int64_t M, const float *xsum, const void *w, int w_dtype, int64_t ldw,
                               const uint8_t *s, int64_t stride_sv, int64_t lds, int64_t d_in, const float *alpha,
                               int64_t stride_av, int64_t alpha_stride, const int64_t *slots, int64_t n_planes,
                               const int64_t *mate, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    linear_rows(x, xeo, xb, ldx, M, xsum, w, w_dtype, ldw, NULL, lds, d_in, alpha_stride, y, ldy, r0, r1);
    if (s)
        delta_rows_planes(x, tab, tab_bf16, ldx, M, xsum, NULL, s, stride_sv, lds, d_in, alpha, stride_av, alpha_stride,
                          slots, n_planes, NULL, 1, mate, y, ldy, r0, r1);
}

/* linear_planes over many threads (pool_run): the rows in chunks of POOL_ROWS, each chunk's GEMV
 * (one-pass: with its bits) and its planes two jobs, which participants take from two counters: the
 * first to arrive GEMV jobs first, the next plane jobs first, and so on, each then the other kind, so
 * while one core streams W another sums the bits, which are compute, not bytes. The planes' sums go
 * to part [M, d_out]; whoever finishes a chunk's second job adds them to y, the same y += sum as
 * linear_planes_rows, so every row's numbers are those of one thread's pass. */
typedef struct {
    const float *x, *xeo, *tab, *xsum, *alpha;
    const uint16_t *xb;
    const void *w;
    const pass_planes *p1; /* the one-pass loop's planes */
    const uint8_t *s2;
    const int64_t *slots, *mate;
    int64_t ldx, M, ldw, stride_sv, lds, d_in, stride_av, alpha_stride, n_planes, ldy, d_out;
    int w_dtype, tab_bf16;
    float *y, *part;
    int *done; /* jobs finished per chunk (0, 1, 2) */
    int arrived;
    pool_jobs jobs[2]; /* GEMV, planes */
} share_task;

static void share_run(void *ctx) {
    share_task *T = (share_task *)ctx;
    const int first = __atomic_fetch_add(&T->arrived, 1, __ATOMIC_RELAXED) % 2;
    for (int turn = 0; turn < 2; ++turn) {
        const int kind = (first + turn) % 2; /* 0: GEMV, 1: planes */
        for (int64_t j, k; (j = pool_claim(&T->jobs[kind], &k)) >= 0;) {
            const int64_t r0 = j * POOL_ROWS, r1 = (j + k) * POOL_ROWS < T->d_out ? (j + k) * POOL_ROWS : T->d_out;
            if (kind == 0)
                linear_rows(T->x, T->xeo, T->xb, T->ldx, T->M, T->xsum, T->w, T->w_dtype, T->ldw, T->p1, T->lds,
                            T->d_in, T->alpha_stride, T->y, T->ldy, r0, r1);
            else
                delta_rows_planes(T->x, T->tab, T->tab_bf16, T->ldx, T->M, T->xsum, NULL, T->s2, T->stride_sv, T->lds, T->d_in,
                                  T->alpha, T->stride_av, T->alpha_stride, T->slots, T->n_planes, NULL, 1, T->mate,
                                  T->part, T->d_out, r0, r1);
            /* a chunk's second job adds its sums (acq_rel: the first job's writes are seen); rows
             * without a plane are left alone, as delta_rows_planes leaves them */
            for (int64_t c = j; T->s2 && c < j + k; ++c) {
                if (__atomic_fetch_add(&T->done[c], 1, __ATOMIC_ACQ_REL) != 1) continue;
                const int64_t c0 = c * POOL_ROWS, c1 = c0 + POOL_ROWS < T->d_out ? c0 + POOL_ROWS : T->d_out;
                for (int64_t m = 0; m < T->M; ++m) {
                    int any = !T->slots;
                    for (int64_t p = 0; p < T->n_planes && !any; ++p) any = T->slots[m * T->n_planes + p] >= 0;
                    if (any)
                        for (int64_t r = c0; r < c1; ++r) T->y[m * T->ldy + r] += T->part[m * T->d_out + r];
                }
            }
        }
    }
}

/* y = x · Wᵀ + Σ_p α_v ⊙ (x · S_vᵀ), overwriting y: the base GEMV and then the planes of
 * delta_rows_planes in ONE call (linear_planes_rows on one thread, share_run's task on more), the
 * numbers of bd_linear_gemv then bd_delta_batched; s NULL: y = x · Wᵀ. slots NULL: one plane,
 * slot 0, for every row (s, alpha as in bd_delta_gemv); else as bd_delta_batched's row_slots
 * (strides stride_sv, stride_av). one_pass: instead the planes ride the GEMV's loop: one plane
 * (slots NULL, or one slot ≥ 0 in slots[0, n_planes) with M = 1), or with M = 1 as many as the
 * build's one-row loop for w_dtype sums (one_pass_planes); more take the planes' pass. Returns 0 or
 * −1 (no memory). */
static int linear_planes(const float *x, int64_t M, int64_t ldx, const void *w, int w_dtype, int64_t ldw,
                         const uint8_t *s, int64_t stride_sv, int64_t d_out, int64_t d_in, int64_t lds,
                         const float *alpha, int64_t stride_av, int64_t alpha_stride, const int64_t *slots,
                         int64_t n_planes, float *y, int64_t ldy, int x_is_bf16, int one_pass, int n_threads) {
    pass_planes planes = {{NULL}, {NULL}, 0}; /* the one-pass loop's */
    const int most = one_pass_planes(w_dtype, M) > 1 ? one_pass_planes(w_dtype, M) : 1; /* else the blocks' one */
    for (int64_t p = 0, v; one_pass && p < (slots ? n_planes : 1); ++p)
        if ((v = slots ? slots[p] : 0) >= 0) {
            if (planes.n == most) { /* more than the loop sums: the planes' pass */
                one_pass = 0;
                break;
            }
            planes.s[planes.n] = s + v * stride_sv;
            planes.a[planes.n++] = alpha + v * stride_av;
        }
    if (!planes.n) one_pass = 0;
    const pass_planes *p1 = one_pass ? &planes : NULL;
    const uint8_t *s2 = one_pass ? NULL : s; /* the planes' pass */
    /* each x row's sum, for the planes' terms (2 · Σ_{s=1} x − Σ x) only: a serial fp32 sum, ~1.7 µs
     * for 1536 columns before the GEMV could start (~0.1 ms of a one-row step without planes) */
    float *xsum = s ? row_sums(x, M, ldx, d_in) : NULL;
    if (s && !xsum) return -1;
    float *xeo = NULL, *tab = NULL;
    uint16_t *xb = NULL;
    int64_t *mate = NULL;
    int failed = 0;
    /* x's values are bf16: its upper halves, exactly, for the bf16 dense GEMV */
    if (x_is_bf16 && (!p1 || one_pass_planes(BD_W_BF16, M) > 0) && w_dtype == BD_W_BF16)
        xb = bf16_words(x, M, ldx, d_in, &failed);
    const int bf16 = tables_bf16(x_is_bf16);
    if (s2 && !failed) tab = x_tables(x, M, ldx, d_in, bf16, &failed); /* the planes' table loop */
    if (s2 && slots && !failed) {
        mate = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
        if (mate)
            find_mates(slots, M, n_planes, mate);
        else
            failed = 1;
    }
#ifdef HAVE_LINEAR_BLOCKS
    if (w_dtype == BD_W_BF16 && !xb && !failed) { /* x's columns per chunk: LANES even, then LANES odd */
        xeo = (float *)malloc(sizeof(float) * (size_t)(M > 0 ? M * ldx : 1));
        if (xeo) {
            const int64_t nchunk = d_in / (2 * LANES);
            for (int64_t m = 0; m < M; ++m) {
                const float *xm = x + m * ldx;
                float *em = xeo + m * ldx;
                for (int64_t j = 0; j < nchunk; ++j)
                    for (int t = 0; t < LANES; ++t) {
                        em[2 * LANES * j + t] = xm[2 * LANES * j + 2 * t];
                        em[2 * LANES * j + LANES + t] = xm[2 * LANES * j + 2 * t + 1];
                    }
                for (int64_t k = 2 * LANES * nchunk; k < d_in; ++k) em[k] = xm[k]; /* the ragged tail as x */
            }
        } else
            failed = 1;
    }
#endif
    if (!failed && n_threads <= 1) {
        if (p1)
            linear_rows(x, xeo, xb, ldx, M, xsum, w, w_dtype, ldw, p1, lds, d_in, alpha_stride, y, ldy, 0, d_out);
        else
            linear_planes_rows(x, xeo, xb, tab, bf16, ldx, M, xsum, w, w_dtype, ldw, s2, stride_sv, lds, d_in, alpha,
                               stride_av, alpha_stride, slots, n_planes, mate, y, ldy, 0, d_out);
    } else if (!failed) {
        const int64_t n_jobs = (d_out + POOL_ROWS - 1) / POOL_ROWS;
        share_task T = {x, xeo, tab, xsum, alpha, xb, w, p1, s2, slots, mate, ldx, M, ldw, stride_sv, lds, d_in,
                        stride_av, alpha_stride, n_planes, ldy, d_out, w_dtype, bf16, y, NULL, NULL, 0,
                        {pool_jobs_of(n_jobs, n_threads), pool_jobs_of(s2 ? n_jobs : 0, n_threads)}};
        if (s2) {
            T.part = (float *)calloc((size_t)(M > 0 ? M * d_out : 1), sizeof(float));
            T.done = (int *)calloc((size_t)(n_jobs > 0 ? n_jobs : 1), sizeof(int));
            failed = !T.part || !T.done;
        }
        if (!failed) pool_run(share_run, &T, n_threads);
        free(T.done);
        free(T.part);
    }
    free(mate);
    free(tab);
    free(xb);
    free(xeo);
    free(xsum);
    return failed ? -1 : 0;
}

/* y = x · Wᵀ + α ⊙ (x · Sᵀ), overwriting y (s NULL: y = x · Wᵀ; alpha is then unused).
 *   x: fp32 [M, ldx]; w: [d_out, ldw] in w_dtype (BD_W_F32/BF16/F16);
 *   s, alpha as in bd_delta_gemv; y: fp32 [M, ldy]. x_is_bf16: x's values are exactly bf16 (the
 *   bf16 dot-product path may then read them as bf16). two_pass: W's rows alone (a pure stream at
 *   bandwidth), then the delta over the same rows from the bits (linear_planes_rows); else both in
 *   one pass. Returns 0 or −1 (no memory). */
int bd_linear_gemv(const float *x, int64_t M, int64_t ldx, const void *w, int w_dtype, int64_t ldw,
                   const uint8_t *s, int64_t d_out, int64_t d_in, int64_t lds,
                   const float *alpha, int64_t alpha_stride, float *y, int64_t ldy, int x_is_bf16, int two_pass,
                   int n_threads) {
    return linear_planes(x, M, ldx, w, w_dtype, ldw, s, 0, d_out, d_in, lds, alpha, 0, alpha_stride, NULL, 1, y, ldy,
                         x_is_bf16, s && !two_pass, n_threads);
}
