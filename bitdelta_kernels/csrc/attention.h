/* Part of the CPU kernels' library: paged decode attention. Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

/* ---------------------------------------------------------------------- */
/* paged decode attention: one query token per sequence, its KV read in   */
/* place from the paged pool (no gather, no padding), fp32 online softmax */
/* ---------------------------------------------------------------------- */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float r = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    r = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float t[8];
    _mm256_storeu_ps(t, acc);
    r = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
#endif
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* LANES values of an fp32, bf16 or fp16 array from element offset off, widened to fp32 in registers. */
static inline vf widen_vec(const void *base, int dtype, int64_t off) {
    if (dtype == BD_W_F32) return V_LOAD((const float *)base + off);
    if (dtype == BD_W_BF16) return V_BF16_EVEN(V_WIDEN16((const uint16_t *)base + off)); /* the 16 bits as the upper half */
    return V_F16((const uint16_t *)base + off);
}
#endif

static inline void load_row(const void *base, int dtype, int64_t off, int64_t n, float *out) {
    if (dtype == BD_W_F32) {
        memcpy(out, (const float *)base + off, (size_t)n * sizeof(float));
        return;
    }
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; i + LANES <= n; i += LANES) V_STORE(out + i, widen_vec(base, dtype, off + i));
#endif
    for (; i < n; ++i) out[i] = w_at(base, dtype, off + i);
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* exp(x), L lanes, x clamped to [−87.3, 88] (e^-87.3 ≈ 1e-38; e^88 ≈ 1.7e38, 2^n's exponent still
 * in range): Cephes' expf (x = n·ln2 + r, |r| ≤ ln2/2, a degree-6 polynomial in r, then 2^n by the
 * exponent bits), within 2 ulp of expf. */
static inline vf exp_vec(vf x) {
    x = V_MIN(V_MAX(x, V_SET1(-87.3f)), V_SET1(88.f));
    const vf n = V_ROUND(V_MUL(x, V_SET1(1.44269504088896341f)));
    const vf r = V_FNMA(n, V_SET1(-2.12194440e-4f), V_FNMA(n, V_SET1(0.693359375f), x)); /* x − n·ln2, ln2 in two parts */
    vf p = V_SET1(1.9875691500e-4f);
    p = V_FMA(p, r, V_SET1(1.3981999507e-3f));
    p = V_FMA(p, r, V_SET1(8.3334519073e-3f));
    p = V_FMA(p, r, V_SET1(4.1665795894e-2f));
    p = V_FMA(p, r, V_SET1(1.6666665459e-1f));
    p = V_FMA(p, r, V_SET1(5.0000001201e-1f));
    const vf y = V_ADD(V_FMA(V_MUL(p, r), r, r), V_SET1(1.f));
    return V_MUL(y, V_POW2(n));
}

/* v rounded to the dtype and widened back (round_to, L lanes). */
static inline vf round_vec(int dtype, vf v) {
    if (dtype == BD_W_BF16) return v_round_bf16(v);
    if (dtype == BD_W_F16) return V_ROUND_F16(v);
    return v;
}
#endif

/* s[t] = exp(s[t] − mx) for t < T (every s[t] ≤ mx, the chunk's running maximum), exp_vec L lanes at
 * a time. glibc's expf is a call per score: at 3 query heads per key it was most of a key's time in
 * attend (57 ns per key and KV head at 512 keys, warm). */
static void exp_shifted(float *s, int64_t T, float mx) {
    int64_t t = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    const vf m = V_SET1(mx);
    for (; t + LANES <= T; t += LANES) V_STORE(s + t, exp_vec(V_SUB(V_LOAD(s + t), m)));
#endif
    for (; t < T; ++t) s[t] = expf(s[t] - mx);
}

/* max(m, s[0..T)) and Σ s[0..T), L lanes at a time (a serial chain of T compares or adds was a
 * few cycles per key and head). */
static inline float max_of(const float *s, int64_t T, float m) {
    int64_t t = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (T >= LANES) {
        vf v = V_SET1(m);
        for (; t + LANES <= T; t += LANES) v = V_MAX(v, V_LOAD(s + t));
        float lanes[LANES];
        V_STORE(lanes, v);
        for (int i = 0; i < LANES; ++i) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; t < T; ++t) m = s[t] > m ? s[t] : m;
    return m;
}

static inline float sum_of(const float *s, int64_t T) {
    int64_t t = 0;
    float r = 0.f;
#if defined(__AVX512F__) || defined(__AVX2__)
    vf v = V_ZERO();
    for (; t + LANES <= T; t += LANES) v = V_ADD(v, V_LOAD(s + t));
    r = V_SUM(v);
#endif
    for (; t < T; ++t) r += s[t];
    return r;
}

/* a[0..D) += Σ_t p[t] · v_t[0..D), t < T, row by row: the head sizes chunk_values does not take. */
static inline void add_rows(float *a, const float *p, const float *const *v, int64_t T, int64_t D) {
    for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) a[d] += p[t] * v[t][d];
}

/* Keys per chunk of attend: its scores are computed first, then one rescale of the running sums
 * per chunk, then the values (the online softmax of the whole row, chunk by chunk). In a decode
 * step a layer's KV is cold (the weights' stream has passed through the caches since the layer last
 * ran): the key-by-key online softmax this replaced chained every key's rescale and branch to the
 * next, so its row loads waited on each other; the chunk's independent score loads overlap (one
 * core of an AMD EPYC, SmolLM2's 9 query and 3 KV heads of 64, caches flushed before each call: 64
 * tokens 44–63 µs per layer before, 16–20 after; 512 tokens 219–315 before, 92–137 after). The
 * next chunk's rows are prefetched into L2 (prefetch_kv), its keys as a chunk starts and its values
 * before this chunk's values are summed: 16 keys a chunk keep each burst of prefetches small. A
 * 4096-token context cold from memory (one Zen 4 core, 30 layers, SmolLM2's heads, fp32) read its
 * K/V at 11.6 GB/s in chunks of 64, 13.1–13.3 of 32 and 14.8 of 16 (a sum 16–17); bf16, bound by
 * its compute, and the warm attention were the same or faster (2026-12-05, docs/kernels.md). */
#define ATT_CHUNK 16

/* The element offset of token t's row of KV head g in a pool [rows, KV, D] (block table `table`). */
static inline int64_t kv_off(const int32_t *table, int64_t bs, int64_t KV, int64_t g, int64_t D, int64_t t) {
    return (((int64_t)table[t / bs] * bs + t % bs) * KV + g) * D;
}

/* Token t's row of KV head g in a pool (k or v) as fp32: in place, or widened into `row`. */
static inline const float *kv_row(const void *pool, int dtype, const int32_t *table, int64_t bs, int64_t KV,
                                  int64_t g, int64_t D, int64_t t, float *row) {
    const int64_t off = kv_off(table, bs, KV, g, D, t);
    if (dtype == BD_W_F32) return (const float *)pool + off;
    load_row(pool, dtype, off, D, row);
    return row;
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* r lane i = Σ of v[i]'s lanes, for LANES vectors v (a transpose-and-add tree: ~3 ops per vector
 * instead of a horizontal sum's ~8 each, and no chain between the vectors). */
static inline vf sum_lanes(const vf *v) {
#if defined(__AVX512F__)
    __m512 w[8], u[4];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: the lane's sums of vectors 4i … 4i + 3 */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xee));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
#else
    __m256 w[4], u[2];
    for (int i = 0; i < 4; ++i)
        w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        const __m256d a = _mm256_castps_pd(w[2 * i]), b = _mm256_castps_pd(w[2 * i + 1]);
        u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#endif
}

/* Key rows chunk_scores holds in registers: heads of up to KEY_VECS · LANES values (512 in the
 * AVX-512 build, 256 in AVX2's); larger ones take attend's row form. */
#define KEY_VECS 32

/* part[(h·LANES + t)·LANES ...] = the G heads' products with key row t (at element offset o of the
 * pool k, nv vectors), summed to one vector per head: the row loaded (and widened) into registers
 * once for all G heads. chunk_scores calls it with a literal nv for the common head sizes. */
static inline __attribute__((always_inline)) void key_parts(const float *qg, int64_t G, const int nv, const void *k,
                                                            int kv_dtype, int64_t o, float *part, int64_t t) {
    vf kx[KEY_VECS];
    for (int j = 0; j < nv; ++j) kx[j] = widen_vec(k, kv_dtype, o + j * LANES);
    for (int64_t h = 0; h < G; ++h) {
        const float *qh = qg + h * nv * LANES;
        vf a = V_MUL(V_LOAD(qh), kx[0]);
        for (int j = 1; j < nv; ++j) a = V_FMA(V_LOAD(qh + j * LANES), kx[j], a);
        V_STORE(part + (h * LANES + t) * LANES, a);
    }
}

/* key_parts for the other head sizes, out of line (inlined with a runtime count, it cost the
 * common sizes' loop a few % on one Zen 4 core). */
static __attribute__((noinline)) void key_parts_any(const float *qg, int64_t G, int nv, const void *k, int kv_dtype,
                                                    int64_t o, float *part, int64_t t) {
    key_parts(qg, G, nv, k, kv_dtype, o, part, t);
}

/* sc[h·ATT_CHUNK + t] = scale · qg[h] · k_t for the chunk's T keys, key t's row at element offset
 * off[t] of the pool k, and the G heads (D a multiple of LANES, at most KEY_VECS vectors): LANES keys
 * at a time, each key row widened in registers once for all G heads (key_parts; widened once per
 * head instead, a warm 4096-token attention took 1.14 × the time in fp32 and 1.22 × in bf16 on one
 * Zen 4 core), its per-head products summed to one vector (part), then the group's LANES vectors
 * of a head summed across lanes at once (sum_lanes). part: scratch [G, LANES, LANES]. */
static void chunk_scores(const float *qg, int64_t G, int64_t D, const void *k, int kv_dtype, const int64_t *off,
                         int64_t T, float scale, float *sc, float *part) {
    const int64_t nv = D / LANES;
    const vf sv = V_SET1(scale);
    for (int64_t t0 = 0; t0 < T; t0 += LANES) {
        const int64_t nt = T - t0 < LANES ? T - t0 : LANES;
        for (int64_t t = 0; t < LANES; ++t) {
            if (t >= nt) { /* past the chunk's end: zeros, their sums dropped */
                for (int64_t h = 0; h < G; ++h) V_STORE(part + (h * LANES + t) * LANES, V_ZERO());
                continue;
            }
            const int64_t o = off[t0 + t];
            if (nv == 4)
                key_parts(qg, G, 4, k, kv_dtype, o, part, t); /* the literal keeps the row in registers */
            else if (nv == 8)
                key_parts(qg, G, 8, k, kv_dtype, o, part, t);
            else
                key_parts_any(qg, G, nv, k, kv_dtype, o, part, t);
        }
        for (int64_t h = 0; h < G; ++h) {
            vf v[LANES];
            for (int t = 0; t < LANES; ++t) v[t] = V_LOAD(part + (h * LANES + t) * LANES);
            const vf r = V_MUL(sum_lanes(v), sv);
            if (nt == LANES)
                V_STORE(sc + h * ATT_CHUNK + t0, r);
            else {
                float lanes[LANES];
                V_STORE(lanes, r);
                memcpy(sc + h * ATT_CHUNK + t0, lanes, sizeof(float) * (size_t)nt);
            }
        }
    }
}
/* acc[h] += Σ_t p[h·ATT_CHUNK + t] · v_t for GB heads from h = 0, v_t the pool's row at element
 * offset off[t] (NV vectors): the heads' sums stay in registers over the chunk's T rows, and each row
 * is widened in registers once for the GB heads. */
#define CHUNK_VALUES(NV, GB)                                                                             \
    static void chunk_values_##NV##_##GB(float *acc, const float *p, const void *v, int dtype,          \
                                         const int64_t *off, int64_t T) {                                \
        vf r[GB][NV];                                                                                    \
        for (int h = 0; h < GB; ++h)                                                                     \
            for (int j = 0; j < NV; ++j) r[h][j] = V_LOAD(acc + (h * NV + j) * LANES);                   \
        for (int64_t t = 0; t < T; ++t) {                                                                \
            vf x[NV];                                                                                    \
            for (int j = 0; j < NV; ++j) x[j] = widen_vec(v, dtype, off[t] + j * LANES);                    \
            for (int h = 0; h < GB; ++h) {                                                               \
                const vf pv = V_SET1(p[h * ATT_CHUNK + t]);                                              \
                for (int j = 0; j < NV; ++j) r[h][j] = V_FMA(pv, x[j], r[h][j]);                         \
            }                                                                                            \
        }                                                                                                \
        for (int h = 0; h < GB; ++h)                                                                     \
            for (int j = 0; j < NV; ++j) V_STORE(acc + (h * NV + j) * LANES, r[h][j]);                   \
    }
CHUNK_VALUES(4, 1)
CHUNK_VALUES(4, 2)
CHUNK_VALUES(4, 3)
CHUNK_VALUES(4, 4)
CHUNK_VALUES(8, 1)
CHUNK_VALUES(8, 2)
#undef CHUNK_VALUES

/* acc [G, D] += the chunk's weighted value rows (chunk_values_*) where D is 4 or 8 vectors (the
 * common head sizes; 4 or 2 heads at a time); returns 0 where it is not (the caller's row form). */
static int chunk_values(float *acc, const float *p, int64_t G, int64_t D, const void *v, int dtype,
                        const int64_t *off, int64_t T) {
    if (D != 4 * LANES && D != 8 * LANES) return 0;
    for (int64_t h = 0; h < G;) {
        const int64_t n = G - h;
        float *a = acc + h * D;
        const float *ph = p + h * ATT_CHUNK;
        if (D == 4 * LANES) {
            const int gb = n >= 4 ? 4 : (int)n;
            if (gb == 4) chunk_values_4_4(a, ph, v, dtype, off, T);
            else if (gb == 3) chunk_values_4_3(a, ph, v, dtype, off, T);
            else if (gb == 2) chunk_values_4_2(a, ph, v, dtype, off, T);
            else chunk_values_4_1(a, ph, v, dtype, off, T);
            h += gb;
        } else {
            if (n >= 2) chunk_values_8_2(a, ph, v, dtype, off, T);
            else chunk_values_8_1(a, ph, v, dtype, off, T);
            h += n >= 2 ? 2 : 1;
        }
    }
    return 1;
}
#endif

/* Prefetch tokens [t0, t1)'s rows of KV head g in a pool into L2: every line of each row (D values).
 * attend asks for the next chunk's rows (ATT_CHUNK). Into L1 (prefetcht0), in chunks of 64 keys, the
 * prefetches gained nothing over none at all at a 4096-token context cold from memory; into L2 that
 * attention ran 1.5–1.6 × as fast in fp32 and 2.4–2.6 × in bf16 (one core of a 2-core AMD EPYC,
 * Zen 4; SmolLM2-135M's 9 query and 3 KV heads of 64, 30 layers' pools of scattered blocks,
 * 2026-12-05; docs/kernels.md), the K/V read at 8–9 GB/s instead of 3–5 (a sum over as many bytes:
 * 14–17). */
static inline void prefetch_kv(const void *pool, int dtype, const int32_t *table, int64_t bs, int64_t KV, int64_t g,
                               int64_t D, int64_t t0, int64_t t1) {
    const int64_t es = dtype == BD_W_F32 ? 4 : 2;
    for (int64_t t = t0; t < t1; ++t) {
        const char *r = (const char *)pool + kv_off(table, bs, KV, g, D, t) * es;
        for (int64_t b = 0; b < D * es; b += 64) __builtin_prefetch(r + b, 0, 2);
    }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define SCORE_LANES LANES
#else
#define SCORE_LANES 0
#endif

/* Scratch floats of one attend task: acc [G, D], m [G], l [G], scores [G, ATT_CHUNK], a chunk's
 * rows widened to fp32 [ATT_CHUNK, D], chunk_scores' part [G, LANES, LANES]. */
static inline int64_t attend_floats(int64_t G, int64_t D) {
    return G * D + 2 * G + G * ATT_CHUNK + ATT_CHUNK * D + G * SCORE_LANES * SCORE_LANES;
}

/* The G query heads qg [G, D] of sequence b over its keys [lo, n) of KV head g -> o [G, D], the
 * keys in chunks of ATT_CHUNK: every score of the chunk (each key row read once for all G heads),
 * each head's chunk maximum, ONE rescale of its running sum and weights where that maximum is a new
 * one, exp(s − max) per score, then each value row read once, weighted into all G heads. fp32
 * throughout (keys and values widened from kv_dtype). softcap > 0: each score s becomes
 * softcap · tanh(s / softcap) before the softmax (Gemma 2). */
static void attend(const float *qg, int64_t G, int64_t D, const void *k, const void *v, int kv_dtype,
                   const int32_t *table, int64_t bs, int64_t KV, int64_t g, int64_t lo, int64_t n, float scale,
                   float softcap, float *buf, float *o) {
    float *acc = buf, *m = acc + G * D, *l = m + G, *sc = l + G, *row = sc + G * ATT_CHUNK, *part = row + ATT_CHUNK * D;
    (void)part;
#define CHUNK_END(c) ((c) + ATT_CHUNK < n ? (c) + ATT_CHUNK : n)
    for (int64_t h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    prefetch_kv(k, kv_dtype, table, bs, KV, g, D, lo, CHUNK_END(lo));
    prefetch_kv(v, kv_dtype, table, bs, KV, g, D, lo, CHUNK_END(lo));
    for (int64_t c0 = lo; c0 < n; c0 += ATT_CHUNK) {
        const int64_t T = CHUNK_END(c0) - c0;
        prefetch_kv(k, kv_dtype, table, bs, KV, g, D, c0 + T, CHUNK_END(c0 + T)); /* the next chunk's keys */
#if SCORE_LANES
        int64_t off[ATT_CHUNK]; /* the chunk's key and value rows (the two pools share one layout) */
        for (int64_t t = 0; t < T; ++t) off[t] = kv_off(table, bs, KV, g, D, c0 + t);
        if (D % LANES == 0 && D / LANES <= KEY_VECS)
            chunk_scores(qg, G, D, k, kv_dtype, off, T, scale, sc, part);
        else
#endif
            for (int64_t t = 0; t < T; ++t) {
                const float *kr = kv_row(k, kv_dtype, table, bs, KV, g, D, c0 + t, row);
                for (int64_t h = 0; h < G; ++h) sc[h * ATT_CHUNK + t] = dot_f32(qg + h * D, kr, D) * scale;
            }
        if (softcap > 0.f)
            for (int64_t h = 0; h < G; ++h)
                for (int64_t t = 0; t < T; ++t) sc[h * ATT_CHUNK + t] = softcap * tanhf(sc[h * ATT_CHUNK + t] / softcap);
        for (int64_t h = 0; h < G; ++h) {
            float *sh = sc + h * ATT_CHUNK, mc = m[h];
            mc = max_of(sh, T, mc);
            if (mc > m[h]) { /* a new maximum: rescale what was summed so far (nothing, the first time) */
                const float c = expf(m[h] - mc);
                l[h] *= c;
                for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= c;
                m[h] = mc;
            }
            exp_shifted(sh, T, mc);
            l[h] += sum_of(sh, T);
        }
        prefetch_kv(v, kv_dtype, table, bs, KV, g, D, c0 + T, CHUNK_END(c0 + T)); /* and values */
#if SCORE_LANES
        if (chunk_values(acc, sc, G, D, v, kv_dtype, off, T)) continue;
#endif
        const float *vr[ATT_CHUNK]; /* the chunk's value rows, each read (and widened) once for all G heads */
        for (int64_t t = 0; t < T; ++t) vr[t] = kv_row(v, kv_dtype, table, bs, KV, g, D, c0 + t, row + t * D);
        for (int64_t h = 0; h < G; ++h) add_rows(acc + h * D, sc + h * ATT_CHUNK, vr, T, D);
    }
    for (int64_t h = 0; h < G; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[h * D + d] * inv;
    }
#undef CHUNK_END
}

/* bd_paged_decode's (row, KV head) pairs as pool jobs, each participant with its own scratch. */
typedef struct {
    const float *q;
    const void *k, *v;
    const int32_t *tables, *lens;
    float *out;
    int64_t B, H, KV, D, G, max_blocks, bs, window;
    float scale, softcap;
    int kv_dtype, failed;
    pool_jobs jobs;
} attend_task;

static void attend_run(void *ctx) {
    attend_task *T = (attend_task *)ctx;
    float *buf = (float *)malloc((size_t)attend_floats(T->G, T->D) * sizeof(float));
    if (!buf) {
        __atomic_store_n(&T->failed, 1, __ATOMIC_RELAXED);
        return; /* the others take its jobs; the call still fails */
    }
    for (int64_t j0, k; (j0 = pool_claim(&T->jobs, &k)) >= 0;)
        for (int64_t j = j0; j < j0 + k; ++j) {
            const int64_t b = j / T->KV, g = j % T->KV, n = T->lens[b];
            const int64_t lo = T->window > 0 && n - T->window > 0 ? n - T->window : 0;
            attend(T->q + (b * T->H + g * T->G) * T->D, T->G, T->D, T->k, T->v, T->kv_dtype,
                   T->tables + b * T->max_blocks, T->bs, T->KV, g, lo, n, T->scale, T->softcap, buf,
                   T->out + (b * T->H + g * T->G) * T->D);
        }
    free(buf);
}

/* out[b, h, :] = Σ_t softmax_t(cap(q[b, h] · k_t · scale)) v_t over the keys t the query sees (cap: the
 *   identity, or softcap · tanh(s / softcap) where softcap > 0).
 *   q, out: fp32 [B, H, D] contiguous; k, v: [rows, KV, D] contiguous in kv_dtype (BD_W_*), token t
 *   of sequence b at row tables[b * max_blocks + t / bs] * bs + t % bs; lens[b]: its length (the
 *   query is token lens[b] − 1); window > 0: keys t > lens[b] − 1 − window only.
 *   One task per (sequence, KV head) (attend): its G = H / KV query heads share each key and value
 *   row, which is read once. n_threads 1 runs on the calling thread. Returns 0 or −1 (no memory). */
int bd_paged_decode(const float *q, int64_t B, int64_t H, int64_t KV, int64_t D, const void *k, const void *v,
                    int kv_dtype, const int32_t *tables, int64_t max_blocks, const int32_t *lens, int64_t bs,
                    int64_t window, float scale, float softcap, float *out, int n_threads) {
    const int64_t G = H / KV;
    attend_task T = {q, k, v, tables, lens, out, B, H, KV, D, G, max_blocks, bs, window, scale, softcap, kv_dtype, 0,
                     pool_jobs_of(B * KV, n_threads)};
    pool_run(attend_run, &T, B * KV == 1 ? 1 : n_threads);
    return T.failed ? -1 : 0;
}
