/* Part of the CPU kernels' library: merge and unpack (W + α·S into a dense matrix). Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

/* ---------------------------------------------------------------------- */
/* merge: out[r − r0, k] = w[r, k] + α_r · s[r, k]   for r in [r0, r1)      */
/* ---------------------------------------------------------------------- */
static void merge_row(const void *w, int w_dtype, int64_t w_off, const uint8_t *srow, float a,
                      int64_t d_in, void *out, int out_dtype, int64_t o_off) {
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 pos = _mm512_set1_ps(a), neg = _mm512_set1_ps(-a);
    for (; k + 16 <= d_in; k += 16) {
        uint16_t bits;
        memcpy(&bits, srow + k / 8, 2);
        __m512 v = _mm512_mask_blend_ps((__mmask16)bits, neg, pos);
        if (w_dtype == BD_W_F32) {
            v = _mm512_add_ps(v, _mm512_loadu_ps((const float *)w + w_off + k));
        } else if (w_dtype == BD_W_BF16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + w_off + k));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        } else if (w_dtype == BD_W_F16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + w_off + k));
            v = _mm512_add_ps(v, _mm512_cvtph_ps(h));
        }
        if (out_dtype == BD_W_F32) {
            _mm512_storeu_ps((float *)out + o_off + k, v);
        } else if (out_dtype == BD_W_BF16) {
            /* round to nearest even (no NaN can come out of finite weights + α) */
            __m512i u = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + o_off + k), _mm512_cvtepi32_epi16(u));
        } else {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + o_off + k),
                                _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
#endif
    for (; k < d_in; ++k) {
        const float sg = ((srow[k >> 3] >> (k & 7)) & 1) ? a : -a;
        store_out(out, out_dtype, o_off + k, (w_dtype == BD_W_NONE ? 0.f : w_at(w, w_dtype, w_off + k)) + sg);
    }
}

/* bd_merge's rows r0 + [i0, i1). */
typedef struct {
    const void *w;
    const uint8_t *s;
    const float *alpha;
    void *out;
    int w_dtype, out_dtype;
    int64_t ldw, lds, alpha_stride, r0, d_in, ldo;
} merge_args;

static void merge_rows(void *ctx, int64_t i0, int64_t i1) {
    const merge_args *A = (const merge_args *)ctx;
    for (int64_t r = A->r0 + i0; r < A->r0 + i1; ++r)
        merge_row(A->w, A->w_dtype, r * A->ldw, A->s + r * A->lds, A->alpha ? A->alpha[r * A->alpha_stride] : 1.f,
                  A->d_in, A->out, A->out_dtype, (r - A->r0) * A->ldo);
}

/*   w: [d_out, ldw] in w_dtype (ignored for BD_W_NONE); s: uint8 [d_out, lds];
 *   alpha as in bd_delta_gemv (NULL: α = 1, i.e. plain ±1 unpack);
 *   out: [r1 − r0, ldo] in out_dtype (BD_W_F32/BF16/F16), rounded to nearest even. */
void bd_merge(const void *w, int w_dtype, int64_t ldw, const uint8_t *s, int64_t lds,
              const float *alpha, int64_t alpha_stride, int64_t r0, int64_t r1, int64_t d_in,
              void *out, int out_dtype, int64_t ldo, int n_threads) {
    merge_args A = {w, s, alpha, out, w_dtype, out_dtype, ldw, lds, alpha_stride, r0, d_in, ldo};
    pool_rows(merge_rows, &A, r1 - r0, 16, n_threads);
}
