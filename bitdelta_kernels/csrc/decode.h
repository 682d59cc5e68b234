/* Part of the CPU kernels' library: the decode layers (every layer of a step in one call) and the greedy pick. Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

/* ---------------------------------------------------------------------- */
/* decode layers: every layer of a step's B single-token rows in one call */
/* ---------------------------------------------------------------------- */
/* The runner's layer (services/gpu_worker/runner.py) for decode rows, op for op and with its
 * roundings: each op's result is rounded to the model's dtype where torch's op would round it
 * (norm, projection, rope, attention, residual, silu and its product), the GEMVs and the
 * attention are the functions above (bd_linear_gemv, bd_delta_batched, bd_paged_decode), so a row
 * gets the same values in any batch. What it saves is the ~40 small torch ops and their dispatch
 * per layer, ~40 % of a step at SmolLM2-135M's size. */
typedef struct {
    const void *w[4];      /* qkv, o, gate_up, down: [d_out, d_in] in the dtype, rows contiguous */
    const uint8_t *s[4];   /* the slots' sign stacks [n_slots, d_out, ceil(d_in/8)], contiguous */
    const float *a[4];     /* their α stacks, fp32 [n_slots, d_out] */
    const void *bias[4];   /* [n_slots + 1, d_out] in the dtype (row 0: the base), or NULL */
    /* input and post-attention RMSNorm weights [n_slots + 1, dim]; then Gemma 2/3's pre- and
     * post-feedforward ones, or NULL (a sandwich layer: the attention's and the MLP's outputs normed
     * by norm[1] and norm[3] before their residual adds, the MLP's input by norm[2]) */
    const void *norm[4];
    void *k, *v;           /* this layer's KV pool [rows, KV, hd] in the dtype */
    int64_t window;        /* sliding window; 0: full attention */
    const void *qk_norm[2]; /* Qwen3's and Gemma 3's per-head RMSNorms of q and k [n_slots + 1, hd], or NULL */
    int64_t local;         /* 1: the rotation of bd_decode_opts' local tables (Gemma 3's sliding layers) */
    int64_t nope;          /* 1: no rotation at all (SmolLM3's NoPE layers) */
    const void *norm_bias[4]; /* StableLM's LayerNorm biases beside norm[i] [n_slots + 1, dim], or NULL */
} bd_decode_layer;

/* What a family changes in the layer (NULL: Llama's). */
typedef struct {
    int32_t gemma;         /* Gemma's RMSNorm: round(x · rsqrt(mean(x²) + eps) · (1 + w)), in fp32, and the
                            * embeddings of token ids × round(embed_scale) */
    int32_t act;           /* the MLP's gate: ACT_SILU, ACT_GELU_TANH (GELU's tanh form), ACT_RELU2 (relu²),
                            * ACT_GELU_NEW (Phi's gelu_new, op by op) or ACT_GELU (GPT-NeoX's exact GELU) */
    float embed_scale;
    float attn_softcap;    /* > 0: each score capped (bd_paged_decode's softcap) */
    const void *local_cos, *local_sin; /* the local layers' tables: rope_dtype, rows as rope_rows' */
    float embed_multiplier;    /* Granite: token ids' embeddings × this, one rounding (0: 1) */
    float residual_multiplier; /* Granite: each sublayer's output × this, rounded, before its add (0: 1) */
    int32_t norm_once;     /* OLMo 2's RMSNorm: round(x · rsqrt(mean(x²) + eps) · w), in fp32 */
    int32_t qk_full;       /* OLMo 2: the q and k norms span the whole projection, not one head */
    int64_t rotary;        /* the rotated dims of a head, the tables' width (0: head_dim; Phi's partial_rotary_factor) */
    int32_t interleaved;   /* GLM: the rotated pairs are dims (2i, 2i + 1), not (i, i + rotary/2) */
    int32_t rope_fp32;     /* ERNIE 4.5, Cohere: the rotation's products and sums in fp32, rounded once */
    int32_t layer_norm;    /* LayerNorm: round(w · (x − mean) · rsqrt(var + eps) [+ b]), in fp32 (b: norm_bias) */
    int32_t parallel;      /* Cohere, StableLM: the MLP reads the input norm's output too; x + attention + MLP */
    const void *final_norm_bias; /* StableLM: the final LayerNorm's bias [n_slots + 1, dim], or NULL */
    int32_t ungated;       /* StarCoder2: the gate_up group is up alone [F, dim]; the MLP is down(act(up)) */
    int32_t qk_heads;      /* Command R+: the per-head q and k norms' weights are each head's own [n_slots + 1, heads · hd] */
    int32_t norm_plus_one; /* Nemotron's LayerNorm1P: each LayerNorm scales by round(w + 1), not w */
    int32_t qk_after_rope; /* Hunyuan: the per-head q and k norms after the rope, not before */
    int32_t sublayers_first; /* Phi: a parallel block's attention and MLP outputs added first, then to x */
    float clip_qkv;        /* OLMo 1, OLMoE: > 0: q, k, v clamped to ±clip_qkv (after qk_full's norms) */
    int32_t parallel_mlp_norm; /* GPT-NeoX: a parallel block's MLP reads norm[1] of the block's input (with
                                * sublayers_first) */
} bd_decode_opts;

/* The MLP's gate activation (bd_decode_opts.act). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_RELU2 = 2, ACT_GELU_NEW = 3, ACT_GELU = 4 };

/* How a norm rounds (norm_row): Llama's, Gemma's (1 + w, once), OLMo 2's (w, once) or a LayerNorm
 * (Cohere's, StableLM's: the mean subtracted, then as OLMo 2's, a bias added before the rounding;
 * Nemotron's LayerNorm1P by round(w + 1)). */
enum { NORM_LLAMA = 0, NORM_GEMMA = 1, NORM_ONCE = 2, NORM_LAYER = 3, NORM_LAYER_1P = 4 };

/* One slot's low-rank residual of one projection group (services/gpu_worker/slots.py LowRank):
 * y += U_m · (V · x)[c0_m, c0_m + rank_m) into the group's rows [r0_m, r0_m + rows_m) for each of its
 * n matrices with a rank; V the matrices' V's stacked, R = Σ rank_m. Factors in fp16, as stored. */
typedef struct {
    const void *v;           /* fp16 [R, d_in] */
    int64_t R, n;
    const int64_t *r0, *rows, *c0, *rank; /* [n] each */
    const void *const *u;    /* [n]: fp16 Uᵀ [rank_m, rows_m] */
} bd_lowrank;

/* e[r] = Σ_{j<k} t[j] · U[r, j] for r < rows, from Uᵀ (fp16 [k, rows]): k AXPYs over the rows, LANES
 * rows a vector (no horizontal sums; each e[r] summed over j in order, fused multiply-adds). */
static void lowrank_expand(const float *t, int64_t k, const void *ut, int64_t rows, float *e) {
    int64_t r = 0;
#ifdef LANES
    const uint16_t *u16 = (const uint16_t *)ut;
    for (; r + LANES <= rows; r += LANES) {
        vf acc = V_ZERO();
        for (int64_t j = 0; j < k; ++j) acc = V_FMA(V_SET1(t[j]), V_F16(u16 + j * rows + r), acc);
        V_STORE(e + r, acc);
    }
#endif
    for (; r < rows; ++r) {
        float acc = 0.f;
        for (int64_t j = 0; j < k; ++j) acc = fmaf(t[j], w_at(ut, BD_W_F16, j * rows + r), acc);
        e[r] = acc;
    }
}

static inline float round_to(int dtype, float v) {
    if (dtype == BD_W_BF16) {
        const uint32_t u = (uint32_t)f32_to_bf16(v) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    if (dtype == BD_W_F16) return (float)(_Float16)v;
    return v;
}

/* The planes of one variant bd_decode_layers' `fuse` sums in the weights' pass for a step of `rows`
 * rows of dtype (0: none). */
int bd_one_pass_planes(int dtype, int64_t rows) { return one_pass_planes(dtype, rows); }

/* y_b += the low-rank residual `lr` of x_b (fp32 sums, before y's rounding), as
 * bitdelta_kernels.lowrank: t = V · x_b (the shrink, the GEMV of fp16 weights), then each matrix's U
 * over its part of t (the expand, lowrank_expand), one row at a time, so a row's sums do not depend
 * on the step's other rows. tmp: R + max rows_m floats. Returns 0 or −1 (no memory). */
static int add_lowrank(const bd_lowrank *lr, const float *xb, int64_t d_in, float *yb, float *tmp) {
    float *t = tmp, *e = tmp + lr->R;
    if (linear_planes(xb, 1, d_in, lr->v, BD_W_F16, d_in, NULL, 0, lr->R, d_in, 0, NULL, 0, 0, NULL, 1, t, lr->R, 0, 0,
                      1))
        return -1;
    for (int64_t m = 0; m < lr->n; ++m) {
        const int64_t rows = lr->rows[m];
        lowrank_expand(t + lr->c0[m], lr->rank[m], lr->u[m], rows, e);
        float *dst = yb + lr->r0[m];
        for (int64_t r = 0; r < rows; ++r) dst[r] += e[r];
    }
    return 0;
}

/* y = round(x · Wᵀ [+ Σ_p α_v ⊙ (x · S_vᵀ) over the row's plane slots v ≥ 0] [+ U · (V · x) of the
 * row's slot's low-rank residual]) [+ bias row], as runner._linear: slots [B, n_planes] each row's
 * plane slots (row_slot itself for one plane); low[s] slot s's low-rank residual of this group, or
 * NULL (low NULL: none). one_pass: the step's one row, of a variant, in one pass over the weights
 * and its planes' bits where the build's loop sums that many (linear_planes). */
static int decode_proj(const bd_decode_layer *L, int g, const float *x, int64_t B, int64_t d_in, int64_t d_out,
                       int dtype, const int64_t *row_slot, const int64_t *slots, int64_t n_planes, int any_delta,
                       int one_pass, const bd_lowrank *const *low, int64_t low_stride, float *y, int n_threads) {
    const int64_t lds = (d_in + 7) / 8;
    if (linear_planes(x, B, d_in, L->w[g], dtype, d_in, any_delta ? L->s[g] : NULL, d_out * lds, d_out, d_in, lds,
                      L->a[g], d_out, 1, slots, n_planes, y, d_out, dtype == BD_W_BF16, one_pass, n_threads))
        return -1;
    if (low) { /* one scratch for every row's terms: the most any of them needs */
        int64_t need = 0;
        for (int64_t b = 0; b < B; ++b) {
            const bd_lowrank *lr = row_slot[b] >= 0 ? low[row_slot[b] * low_stride] : NULL;
            for (int64_t m = 0; lr && lr->R && m < lr->n; ++m)
                need = lr->R + lr->rows[m] > need ? lr->R + lr->rows[m] : need;
        }
        float *tmp = need ? (float *)malloc(sizeof(float) * (size_t)need) : NULL;
        if (need && !tmp) return -1;
        int rc = 0;
        for (int64_t b = 0; b < B && need && !rc; ++b) {
            const bd_lowrank *lr = row_slot[b] >= 0 ? low[row_slot[b] * low_stride] : NULL;
            if (lr && lr->R) rc = add_lowrank(lr, x + b * d_in, d_in, y + b * d_out, tmp);
        }
        free(tmp);
        if (rc) return -1;
    }
    for (int64_t b = 0; b < B; ++b) {
        float *yb = y + b * d_out;
        if (L->bias[g]) {
            const int64_t off = (row_slot[b] + 1) * d_out;
            for (int64_t r = 0; r < d_out; ++r)
                yb[r] = round_to(dtype, round_to(dtype, yb[r]) + w_at(L->bias[g], dtype, off + r));
        } else
            for (int64_t r = 0; r < d_out; ++r) yb[r] = round_to(dtype, yb[r]);
    }
    return 0;
}

/* hb = round(w · round(xb · rsqrt(mean(xb²) + eps))) over D values, w the weights at element `off`
 * of `w` (runner._norm); style NORM_GEMMA: round(xb · rsqrt(…) · (1 + w)) in fp32 instead, NORM_ONCE:
 * round(xb · rsqrt(…) · w) in fp32. hb may be xb. The
 * element-wise steps of a layer here and below run L lanes at a time: one by one (round_to and expf
 * per value) they were ~6 % of a one-row bf16 step and ~12 % of an 8-row one. */
static void norm_row(const float *xb, const void *w, const void *bias, int64_t off, int64_t D, float eps, int dtype,
                     int style, float *hb) {
    int64_t k = 0;
    float ss = 0.f;
    if (style == NORM_LAYER || style == NORM_LAYER_1P) { /* Cohere's LayerNorm: (x − mean) · rsqrt(mean((x −
                                * mean)²) + eps), × w in fp32 (Nemotron's × round(w + 1)), + StableLM's bias at
                                * the same offset, one rounding */
        const int plus_one = style == NORM_LAYER_1P;
        float mean = 0.f;
        for (k = 0; k < D; ++k) mean += xb[k];
        mean /= (float)D;
        for (k = 0; k < D; ++k) ss += (xb[k] - mean) * (xb[k] - mean);
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        for (k = 0; k < D; ++k) {
            const float wk = w_at(w, dtype, off + k), y = (plus_one ? round_to(dtype, wk + 1.f) : wk) * ((xb[k] - mean) * inv);
            hb[k] = round_to(dtype, bias ? y + w_at(bias, dtype, off + k) : y);
        }
        return;
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    vf acc = V_ZERO();
    for (; k + LANES <= D; k += LANES) acc = V_FMA(V_LOAD(xb + k), V_LOAD(xb + k), acc);
    ss = V_SUM(acc);
#endif
    for (; k < D; ++k) ss += xb[k] * xb[k];
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    const vf iv = V_SET1(inv), one = V_SET1(1.f);
    if (style == NORM_GEMMA)
        for (; k + LANES <= D; k += LANES)
            V_STORE(hb + k, round_vec(dtype, V_MUL(V_MUL(V_LOAD(xb + k), iv), V_ADD(one, widen_vec(w, dtype, off + k)))));
    else if (style == NORM_ONCE)
        for (; k + LANES <= D; k += LANES)
            V_STORE(hb + k, round_vec(dtype, V_MUL(widen_vec(w, dtype, off + k), V_MUL(V_LOAD(xb + k), iv))));
    else
        for (; k + LANES <= D; k += LANES)
            V_STORE(hb + k, round_vec(dtype, V_MUL(widen_vec(w, dtype, off + k), round_vec(dtype, V_MUL(V_LOAD(xb + k), iv)))));
#endif
    if (style == NORM_GEMMA)
        for (; k < D; ++k) hb[k] = round_to(dtype, xb[k] * inv * (1.f + w_at(w, dtype, off + k)));
    else if (style == NORM_ONCE)
        for (; k < D; ++k) hb[k] = round_to(dtype, w_at(w, dtype, off + k) * (xb[k] * inv));
    else
        for (; k < D; ++k) hb[k] = round_to(dtype, w_at(w, dtype, off + k) * round_to(dtype, xb[k] * inv));
}

/* Each of q's H and k's KV heads of hd at row (adjacent) through its per-head norm, slot `slot`'s weights:
 * shared by the heads, or (Command R+, `own`) each head's own. */
static void qk_head_norms(const bd_decode_layer *L, float *row, int64_t slot, int64_t H, int64_t KV, int64_t hd,
                          float eps, int dtype, int style, int own) {
    for (int64_t j = 0; j < H + KV; ++j) {
        const int64_t n = j < H ? H : KV, head = j < H ? j : j - H;
        const int64_t off = own ? ((slot + 1) * n + head) * hd : (slot + 1) * hd;
        norm_row(row + j * hd, L->qk_norm[j >= H], NULL, off, hd, eps, dtype, style, row + j * hd);
    }
}

/* norm_row of each of B rows of D, with its slot's weights (row_slot[b] + 1 of the stack). */
static void decode_norm(const float *x, const void *w, const void *bias, const int64_t *row_slot, int64_t B, int64_t D,
                        float eps, int dtype, int style, float *h) {
    for (int64_t b = 0; b < B; ++b)
        norm_row(x + b * D, w, bias, (row_slot[b] + 1) * D, D, eps, dtype, style, h + b * D);
}

/* x[i] = round(x[i]) for i < n. */
static void round_all(float *x, int64_t n, int dtype) {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; i + LANES <= n; i += LANES) V_STORE(x + i, round_vec(dtype, V_LOAD(x + i)));
#endif
    for (; i < n; ++i) x[i] = round_to(dtype, x[i]);
}

/* x[i] = round(x[i] + o[i]) for i < n (a residual add); m ≠ 1: round(x[i] + round(o[i] · m)) (Granite's). */
static void residual_add(float *x, const float *o, int64_t n, int dtype, float m) {
    int64_t i = 0;
    if (m != 1.f) {
        for (; i < n; ++i) x[i] = round_to(dtype, x[i] + round_to(dtype, o[i] * m));
        return;
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; i + LANES <= n; i += LANES) V_STORE(x + i, round_vec(dtype, V_ADD(V_LOAD(x + i), V_LOAD(o + i))));
#endif
    for (; i < n; ++i) x[i] = round_to(dtype, x[i] + o[i]);
}

/* The MLP's gate activations, each rounded to the dtype as the runner's torch ops round it (the lanes' and the
 * scalar tail's forms of one formula): SiLU, g / (1 + e^{−g}); GELU's tanh form (Gemma's, StarCoder2's), torch's
 * formula 0.5 · g · (1 + tanh(√(2/π) · (g + 0.044715 · g³))) in fp32, one rounding; relu² (Nemotron's, Arcee's:
 * relu exact, the square rounded once); gelu_new (Phi's: transformers' NewGELUActivation op by op, each op rounded,
 * round(round(0.5 · g) · round(1 + round(tanh(round(√(2/π) · round(g + round(0.044715 · round(g³)))))))), with
 * round(g³) = round(round(g · g) · g) as torch's pow(g, 3) rounds in bf16); the exact GELU (GPT-NeoX's, Falcon's),
 * 0.5 · g · (1 + erf(g / √2)) in fp32 by libm's erff, one rounding, one value at a time (no lanes' form). tanh(y) =
 * 1 − 2 / (e^{2y} + 1) in the lanes. */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f
static inline float act_one(int kind, float g, int dtype) {
    switch (kind) {
    case ACT_GELU_TANH:
        return round_to(dtype, 0.5f * g * (1.f + tanhf(GELU_BETA * (g + GELU_KAPPA * g * g * g))));
    case ACT_RELU2: {
        const float r = g < 0.f ? 0.f : g; /* a NaN g stays NaN */
        return round_to(dtype, r * r);
    }
    case ACT_GELU:
        return round_to(dtype, 0.5f * g * (1.f + erff(g * 0.7071067811865476f)));
    case ACT_GELU_NEW: {
        const float cube = round_to(dtype, round_to(dtype, g * g) * g);
        const float y = round_to(dtype, GELU_BETA * round_to(dtype, g + round_to(dtype, GELU_KAPPA * cube)));
        return round_to(dtype, round_to(dtype, 0.5f * g) * round_to(dtype, 1.f + round_to(dtype, tanhf(y))));
    }
    default:
        return round_to(dtype, g / (1.f + expf(-g)));
    }
}
#if defined(__AVX512F__) || defined(__AVX2__)
static inline vf tanh_vec(vf y) {
    const vf one = V_SET1(1.f), two = V_SET1(2.f);
    return V_SUB(one, V_DIV(two, V_ADD(exp_vec(V_MUL(two, y)), one)));
}
static inline vf act_vec(int kind, vf g, int dtype) {
    const vf one = V_SET1(1.f), half = V_SET1(0.5f), beta = V_SET1(GELU_BETA), kappa = V_SET1(GELU_KAPPA);
    switch (kind) {
    case ACT_GELU_TANH:
        return round_vec(dtype, V_MUL(V_MUL(half, g), V_ADD(one, tanh_vec(V_MUL(beta, V_ADD(g, V_MUL(kappa, V_MUL(g, V_MUL(g, g)))))))));
    case ACT_RELU2: {
        const vf r = V_MAX(V_ZERO(), g); /* a NaN g (the second operand) stays NaN */
        return round_vec(dtype, V_MUL(r, r));
    }
    case ACT_GELU_NEW: {
#define R_(v) round_vec(dtype, v)
        const vf cube = R_(V_MUL(R_(V_MUL(g, g)), g));
        const vf y = R_(V_MUL(beta, R_(V_ADD(g, R_(V_MUL(kappa, cube))))));
        return R_(V_MUL(R_(V_MUL(half, g)), R_(V_ADD(one, R_(tanh_vec(y))))));
#undef R_
    }
    default:
        return round_vec(dtype, V_DIV(g, V_ADD(one, exp_vec(V_MUL(g, V_SET1(-1.f))))));
    }
}
#endif

/* act[b, k] = round(act(g) · u), g = gu[b, k], u = gu[b, F + k] (the runner's gated MLP; act(g) rounded, act_one);
 * not `gated` (StarCoder2's, Nemotron's, Phi's MLP): act(g), g = gu[b, k] of rows of F. kind: ACT_*. */
static void gate_mul(const float *gu, int64_t B, int64_t F, int dtype, int gated, int kind, float *act) {
    for (int64_t b = 0; b < B; ++b) {
        const float *gb = gu + b * (gated ? 2 * F : F), *ub = gb + F;
        float *ab = act + b * F;
        int64_t k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        for (; kind != ACT_GELU && k + LANES <= F; k += LANES) { /* the exact GELU: erff, one value at a time */
            const vf a = act_vec(kind, V_LOAD(gb + k), dtype);
            V_STORE(ab + k, gated ? round_vec(dtype, V_MUL(a, V_LOAD(ub + k))) : a);
        }
#endif
        for (; k < F; ++k) {
            const float a = act_one(kind, gb[k], dtype);
            ab[k] = gated ? round_to(dtype, a * ub[k]) : a;
        }
    }
}

/* Rope over n heads of hd values at xh, the rotation over each head's first r dims (r = hd but for a
 * partial_rotary_factor; the rest pass as they are; runner's rope):
 * lo' = round(round(lo·c) + round(−hi·s)), hi' = round(round(hi·c') + round(lo·s')). */
static void rope_heads(float *x, int64_t n, int64_t hd, int64_t r, const float *c, const float *sn, int dtype,
                       int interleaved, int fp32) {
    const int64_t half = r / 2;
    if (interleaved) { /* GLM's pairs (2i, 2i + 1), each by the tables' c[i], s[i] (their first half) */
        const int step = fp32 ? BD_W_F32 : dtype; /* ERNIE 4.5: every step in fp32, one rounding at the end */
        for (int64_t j = 0; j < n; ++j) {
            float *xh = x + j * hd;
            for (int64_t i = 0; i < half; ++i) {
                const float e = xh[2 * i], o = xh[2 * i + 1];
                xh[2 * i] = round_to(dtype, round_to(step, round_to(step, e * c[i]) + round_to(step, -o * sn[i])));
                xh[2 * i + 1] = round_to(dtype, round_to(step, round_to(step, o * c[i]) + round_to(step, e * sn[i])));
            }
        }
        return;
    }
    for (int64_t j = 0; j < n; ++j) {
        float *xh = x + j * hd;
        int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        for (; i + LANES <= half; i += LANES) {
            const vf lo = V_LOAD(xh + i), hi = V_LOAD(xh + i + half);
            const vf nlo = round_vec(dtype, V_ADD(round_vec(dtype, V_MUL(lo, V_LOAD(c + i))),
                                                  round_vec(dtype, V_MUL(V_MUL(hi, V_SET1(-1.f)), V_LOAD(sn + i)))));
            const vf nhi = round_vec(dtype, V_ADD(round_vec(dtype, V_MUL(hi, V_LOAD(c + i + half))),
                                                  round_vec(dtype, V_MUL(lo, V_LOAD(sn + i + half)))));
            V_STORE(xh + i, nlo);
            V_STORE(xh + i + half, nhi);
        }
#endif
        for (; i < half; ++i) {
            const float lo = xh[i], hi = xh[i + half];
            xh[i] = round_to(dtype, round_to(dtype, lo * c[i]) + round_to(dtype, -hi * sn[i]));
            xh[i + half] = round_to(dtype, round_to(dtype, hi * c[i + half]) + round_to(dtype, lo * sn[i + half]));
        }
    }
}

/* bd_decode_layers' logits from the normed h [B, D] (see there). Returns 0 or −1 (no memory). */
static int decode_head(const float *h, int64_t B, int64_t D, const void *head, int dtype, int64_t vocab,
                       int64_t n_heads, const uint8_t *const *head_signs, const float *const *head_alpha,
                       const int64_t *head_alpha_stride, const int64_t *head_of_row, float *logits, int n_threads,
                       int one_pass) {
    const int64_t lds = (D + 7) / 8;
    const int64_t v0 = B > 0 && n_heads > 0 ? head_of_row[0] : -1;
    int every = v0 >= 0; /* every row takes head plane v0 (of however many the step has) */
    for (int64_t b = 1; b < B && every; ++b) every = head_of_row[b] == v0;
    if (every) /* one_pass: the one row's plane in the head's own pass (as decode_proj) */
        return linear_planes(h, B, D, head, dtype, D, head_signs[v0], 0, vocab, D, lds, head_alpha[v0], 0,
                             head_alpha_stride[v0], NULL, 1, logits, vocab, dtype == BD_W_BF16, one_pass, n_threads);
    if (linear_planes(h, B, D, head, dtype, D, NULL, 0, vocab, D, lds, NULL, 0, 0, NULL, 1, logits, vocab,
                      dtype == BD_W_BF16, 0, n_threads))
        return -1;
    for (int64_t b = 0; b < B; ++b)
        if (!n_heads || head_of_row[b] < 0) round_all(logits + b * vocab, vocab, dtype);
    if (!n_heads) return 0;
    int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    if (!slots) return -1;
    int rc = 0;
    for (int64_t v = 0; v < n_heads && !rc; ++v) {
        int any = 0;
        for (int64_t b = 0; b < B; ++b) any |= (slots[b] = head_of_row[b] == v ? 0 : -1) == 0;
        if (any)
            rc = bd_delta_batched(h, B, D, head_signs[v], 0, vocab, D, lds, head_alpha[v], 0, head_alpha_stride[v],
                                  slots, 1, NULL, 0, 0, NULL, 1, logits, vocab, dtype == BD_W_BF16, n_threads);
    }
    free(slots);
    return rc;
}

/* x [B, D] fp32 = the rows' input: x_in's (dtype values), or each row's token's embedding: the
 * base's row (`embed`, dtype [vocab, D]), or where embed_of_row[b] = v ≥ 0 variant v's own, its
 * dense table embed_weight[v] (dtype) or, NULL, the base's row + Σ_p α_p[t] ⊙ S_p[t] over its
 * embed_planes[v] sign planes (embed_signs[v] uint8 [k, vocab, ceil(D/8)], embed_alpha[v] fp32
 * [k, vocab]) summed in fp32 plane by plane and rounded once to the dtype: the runner's
 * _variant_embeddings, bit for bit (each term ±α exactly). */
static void decode_embed(const void *x_in, const int64_t *tokens, const void *embed, int64_t n_vocab, int64_t D,
                         int dtype, const void *const *embed_weight, const uint8_t *const *embed_signs,
                         const float *const *embed_alpha, const int64_t *embed_planes, const int64_t *embed_of_row,
                         int64_t B, float *x) {
    const int64_t lds = (D + 7) / 8;
    for (int64_t b = 0; b < B; ++b) {
        float *xb = x + b * D;
        if (x_in) {
            load_row(x_in, dtype, b * D, D, xb);
            continue;
        }
        const int64_t t = tokens[b], v = embed_of_row ? embed_of_row[b] : -1;
        load_row(v >= 0 && embed_weight[v] ? embed_weight[v] : embed, dtype, t * D, D, xb);
        if (v < 0 || embed_weight[v]) continue;
        for (int64_t p = 0; p < embed_planes[v]; ++p) { /* plane p: signs [p, t, :], α [p, t] */
            const uint8_t *bits = embed_signs[v] + (p * n_vocab + t) * lds;
            const float a = embed_alpha[v][p * n_vocab + t];
            for (int64_t j = 0; j < D; ++j) xb[j] += (bits[j >> 3] >> (j & 7)) & 1 ? a : -a;
        }
        for (int64_t j = 0; j < D; ++j) xb[j] = round_to(dtype, xb[j]);
    }
}

/* Every layer for B single-token rows. Their input: x_in, [B, dim] dtype values, or (NULL) each
 * row's token's embedding (decode_embed: tokens int64 [B] < n_vocab; embed the base's table; n_embeds
 * variants' own, embed_of_row int64 [B] or NULL). x_out: NULL, or fp32 [B, dim] the last layer's
 * output. row_slot: int32 [B] (−1: the base; the row's norms and biases, and its one sign plane);
 * row_planes: NULL, or int32 [B, n_planes ≥ 1], each row's sign-plane slots (a variant of k planes,
 * −1 past its k; all −1 for a variant without one) instead of row_slot's one; rope_cos, rope_sin: tables
 * [n_rope, hd] in rope_dtype (BD_W_*; the rotation over the whole head), row rope_rows[b] (int64) for row b (the
 * runner's cached tables and the rows' positions, or a step's own tables and 0..B−1);
 * write_rows: int64 [B] the pool rows of the new tokens' k, v; tables, lens, bs: as
 * bd_paged_decode. dims: dim, n_heads, n_kv_heads, head_dim, intermediate. final_norm: NULL, or
 * the final norm's stack [n_slots + 1, dim] in the dtype: x_out is then the normed output (the
 * runner's _final), and with head ([vocab, dim] in the dtype, the base's LM head) logits: fp32
 * [B, vocab] = round(h · headᵀ) (dense_linear_cpu's GEMV, rounded to the dtype).
 * n_heads sign planes of the head (variants whose tied embedding is compressed to signs), plane v
 * head_signs[v] [vocab, ceil(dim/8)] with its α's head_alpha[v][r · head_alpha_stride[v]], and
 * head_of_row: int64 [B], the plane of each row (−1: the base's head alone; NULL with no plane):
 * a row of plane v gets h · headᵀ + α_v ⊙ (h · S_vᵀ) in fp32, not rounded (the runner's
 * _sign_heads: the GEMV and then bd_delta_batched's plane, bit for bit), a row of −1 round(h · headᵀ).
 * Every row on the same plane v (whatever n_heads) takes linear_planes' one task (on many threads,
 * one core's GEMV beside another's planes); a mix, the GEMV for every row and then each plane over
 * its rows.
 * fuse: a step of B rows of one variant (row_slot ≥ 0 and plane slots the same in
 * every row) of up to one_pass_planes(dtype, B) planes (fp32 with AVX-512, delta_rows_f32: 4, 3, 1 for
 * 1–3 rows; bf16 with AVX512-BF16, delta_rows_dp: 4 for one row, 1 for 2–3) sums each projection's planes, and the
 * head's plane when its rows take one, in the weights' pass, not by the table loop: other sums, so
 * its numbers are not the same row's in a mixed step (the caller's choice: never in the
 * batch-invariant mode), though they are that row's alone; anything else ignores it.
 * lowrank: NULL, or [n_slots · n_layers · 4] (slot s, layer l, group g at (s · n_layers + l) · 4 + g,
 * GROUPS' order) each slot's low-rank residual of each projection group (bd_lowrank) or NULL: a
 * row's slot's, added to the projection before its rounding (decode_proj).
 * opts: NULL (Llama's layer), or what the family changes (bd_decode_opts): Gemma's norms and
 * embedding scale (token ids only: an x_in is already scaled), GELU's tanh form, capped scores, the
 * local layers' rotation; and per layer (bd_decode_layer) the sandwich norms and the q/k norms.
 * After the layers' ~200 MB of weights every cache is cold, and the ~10 small torch ops of the
 * norm and the head's call cost ~0.3 ms of a ~10 ms bf16 SmolLM2-135M step there; so do the
 * step's inputs (the embedding, the rope rows, the slots' checks: each torch op before the call
 * ~10–150 µs), so the call takes host integers and does them. n_slots: the slot stacks' slots.
 * Returns 0, −1 (no memory), −2 (a slot outside [−1, n_slots), or a base row with a plane), −3 (a
 * head_of_row outside [−1, n_heads)) or −4 (a token outside [0, n_vocab), an embed_of_row outside
 * [−1, n_embeds) or a rope row outside [0, n_rope)), before anything is read or written. */
int bd_decode_layers(const bd_decode_layer *layers, int64_t n_layers, int64_t n_slots, const void *x_in,
                     const int64_t *tokens, const void *embed, int64_t n_vocab, int64_t n_embeds,
                     const void *const *embed_weight, const uint8_t *const *embed_signs,
                     const float *const *embed_alpha, const int64_t *embed_planes, const int64_t *embed_of_row,
                     float *x_out, int64_t B, const int32_t *row_slot32, const int32_t *row_planes32, int64_t n_planes,
                     int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t F, float eps, int dtype,
                     const void *rope_cos, const void *rope_sin, int rope_dtype, const int64_t *rope_rows,
                     int64_t n_rope,
                     const int64_t *write_rows, const int32_t *tables, int64_t max_blocks,
                     const int32_t *lens, int64_t bs, float scale, const void *final_norm, const void *head,
                     int64_t vocab, int64_t n_heads, const uint8_t *const *head_signs, const float *const *head_alpha,
                     const int64_t *head_alpha_stride, const int64_t *head_of_row, float *logits, int n_threads,
                     int fuse, const bd_lowrank *const *lowrank, const bd_decode_opts *opts) {
    const int64_t Q = (H + 2 * KV) * hd, HD = H * hd;
    const bd_decode_opts llama = {0}; /* every field zero or NULL */
    const bd_decode_opts *o_ = opts ? opts : &llama;
    const int gemma = o_->gemma,
              style = gemma           ? NORM_GEMMA
                      : o_->layer_norm ? (o_->norm_plus_one ? NORM_LAYER_1P : NORM_LAYER)
                      : o_->norm_once  ? NORM_ONCE
                                       : NORM_LLAMA;
    const float rm = o_->residual_multiplier > 0.f ? o_->residual_multiplier : 1.f;
    const int64_t rot = o_->rotary > 0 && o_->rotary <= hd ? o_->rotary : hd;
    /* row_planes: each row's plane slots ([B, n_planes], −1 past its variant's, all −1 for a variant
     * without a sign plane); NULL: each row's one plane is its slot's */
    const int64_t P = row_planes32 && n_planes > 0 ? n_planes : 1;
    /* the rows' slots as the kernels index them (int64), checked; the runner's are int32 */
    int64_t *row_slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * (1 + P) + 1));
    if (!row_slot) return -1;
    int64_t *row_planes = row_slot + B;
    int any_delta = 0, bad = (o_->local_cos != NULL) != (o_->local_sin != NULL) ? 4 : 0; /* both local tables or none */
    for (int64_t b = 0; b < B; ++b) {
        row_slot[b] = row_slot32[b];
        bad |= row_slot[b] < -1 || row_slot[b] >= n_slots;
        for (int64_t p = 0; row_planes32 && p < P; ++p) {
            const int64_t v = row_planes[b * P + p] = row_planes32[b * P + p];
            bad |= v < -1 || v >= n_slots || (v >= 0 && row_slot[b] < 0);
            any_delta |= v >= 0;
        }
        if (head_of_row && (head_of_row[b] < -1 || head_of_row[b] >= n_heads)) bad |= 2;
        if (rope_rows[b] < 0 || rope_rows[b] >= n_rope ||
            (!x_in && (tokens[b] < 0 || tokens[b] >= n_vocab ||
                       (embed_of_row && (embed_of_row[b] < -1 || embed_of_row[b] >= n_embeds)))))
            bad |= 4;
        if (!row_planes32) any_delta |= row_slot[b] >= 0; /* any sign plane in the step */
    }
    if (bad) {
        free(row_slot);
        return bad & 1 ? -2 : bad & 2 ? -3 : -4;
    }
    const int64_t *slots = row_planes32 ? row_planes : row_slot; /* each row's plane slots */
    /* fuse: rows of one variant (the same slots in every row), as many as the one-pass loops take */
    int one_var = fuse && one_pass_planes(dtype, B) > 0;
    for (int64_t b = 1; b < B && one_var; ++b) {
        one_var = row_slot[b] == row_slot[0];
        for (int64_t p = 0; p < P && one_var; ++p) one_var = slots[b * P + p] == slots[p];
    }
    /* the head's plane in one pass, and the projections' (linear_planes: up to its loops' planes) */
    const int one_pass = one_var && row_slot[0] >= 0;
    const int64_t n = B * (D + 4 * hd + D + Q + 2 * HD + D + 3 * F + D);
    float *buf = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!buf) {
        free(row_slot);
        return -1;
    }
    float *x = buf, *cs = x + B * D, *sn = cs + B * hd, *lcs = sn + B * hd, *lsn = lcs + B * hd, *h = lsn + B * hd,
          *qkv = h + B * D, *q = qkv + B * Q, *att = q + B * HD, *o = att + B * HD, *gu = o + B * D, *act = gu + B * 2 * F,
          *dn = act + B * F;
    decode_embed(x_in, tokens, embed, n_vocab, D, dtype, embed_weight, embed_signs, embed_alpha, embed_planes,
                 embed_of_row, B, x);
    if (!x_in && gemma) { /* Gemma: × √dim rounded to the dtype, then the product rounded (runner's embed_scaled) */
        const float sc = round_to(dtype, o_->embed_scale);
        for (int64_t i = 0; i < B * D; ++i) x[i] = round_to(dtype, x[i] * sc);
    }
    if (!x_in && o_->embed_multiplier > 0.f && o_->embed_multiplier != 1.f) /* Granite: × m, rounded once */
        for (int64_t i = 0; i < B * D; ++i) x[i] = round_to(dtype, x[i] * o_->embed_multiplier);
    for (int64_t b = 0; b < B; ++b) { /* each row's rotations, the same in every layer */
        load_row(rope_cos, rope_dtype, rope_rows[b] * rot, rot, cs + b * hd);
        load_row(rope_sin, rope_dtype, rope_rows[b] * rot, rot, sn + b * hd);
        if (o_->local_cos) {
            load_row(o_->local_cos, rope_dtype, rope_rows[b] * rot, rot, lcs + b * hd);
            load_row(o_->local_sin, rope_dtype, rope_rows[b] * rot, rot, lsn + b * hd);
        }
    }
    int rc = 0;
    /* group g of layer l: slot s's low-rank residual at lowrank[(s · n_layers + l) · 4 + g] */
#define LOW(g) (lowrank ? lowrank + l * 4 + (g) : NULL), n_layers * 4
    for (int64_t l = 0; l < n_layers && !rc; ++l) {
        const bd_decode_layer *L = layers + l;
        const int local = L->local && o_->local_cos;
        if (L->norm[0])
            decode_norm(x, L->norm[0], L->norm_bias[0], row_slot, B, D, eps, dtype, style, h);
        else /* OLMo 2: no input norm */
            memcpy(h, x, sizeof(float) * (size_t)(B * D));
        if ((rc = decode_proj(L, 0, h, B, D, Q, dtype, row_slot, slots, P, any_delta, one_pass, LOW(0), qkv, n_threads))) break;
        for (int64_t b = 0; b < B; ++b) { /* q/k norms, rope over q's and k's heads (adjacent in qkv), then k, v into the pool */
            float *row = qkv + b * Q;
            if (L->qk_norm[0] && o_->qk_full) { /* OLMo 2: q's and k's every head in one norm each */
                norm_row(row, L->qk_norm[0], NULL, (row_slot[b] + 1) * HD, HD, eps, dtype, style, row);
                norm_row(row + HD, L->qk_norm[1], NULL, (row_slot[b] + 1) * KV * hd, KV * hd, eps, dtype, style, row + HD);
            }
            if (o_->clip_qkv > 0.f) { /* OLMo 1, OLMoE: q, k, v (rounded values) clamped, the bound in the dtype:
                                       * round(min(v, c)) = min(v, round(c)) for a v of the dtype */
                const float c = round_to(dtype, o_->clip_qkv);
                for (int64_t i = 0; i < Q; ++i) row[i] = row[i] > c ? c : (row[i] < -c ? -c : row[i]);
            }
            if (L->qk_norm[0] && !o_->qk_full && !o_->qk_after_rope)
                qk_head_norms(L, row, row_slot[b], H, KV, hd, eps, dtype, style, o_->qk_heads);
            if (!L->nope)
                rope_heads(row, H + KV, hd, rot, (local ? lcs : cs) + b * hd, (local ? lsn : sn) + b * hd, dtype,
                           o_->interleaved, o_->rope_fp32);
            if (L->qk_norm[0] && !o_->qk_full && o_->qk_after_rope) /* Hunyuan: the norms after the rope */
                qk_head_norms(L, row, row_slot[b], H, KV, hd, eps, dtype, style, o_->qk_heads);
            memcpy(q + b * HD, row, sizeof(float) * (size_t)HD);
            const int64_t off = write_rows[b] * KV * hd;
            for (int64_t i = 0; i < KV * hd; ++i) {
                store_out(L->k, dtype, off + i, row[HD + i]);
                store_out(L->v, dtype, off + i, row[HD + KV * hd + i]);
            }
        }
        if ((rc = bd_paged_decode(q, B, H, KV, hd, L->k, L->v, dtype, tables, max_blocks, lens, bs, L->window, scale,
                                  o_->attn_softcap, att, n_threads)))
            break;
        round_all(att, B * HD, dtype);
        if ((rc = decode_proj(L, 1, att, B, HD, D, dtype, row_slot, slots, P, any_delta, one_pass, LOW(1), o, n_threads))) break;
        if (o_->parallel) { /* Cohere: h still holds the input norm's output, the MLP's input */
            if (o_->parallel_mlp_norm) /* GPT-NeoX: the MLP's own norm of the block's input (x as it came) */
                decode_norm(x, L->norm[1], L->norm_bias[1], row_slot, B, D, eps, dtype, style, h);
            if (!o_->sublayers_first) /* Phi's: o kept, added to the MLP's output below */
                residual_add(x, o, B * D, dtype, rm);
        }
        else if (L->norm[2] || !L->norm[0]) { /* Gemma 2/3's sandwich, OLMo 2's post-norms: the attention's output
                                            * normed; the MLP's input by its own norm (Gemma), or not (OLMo 2) */
            decode_norm(o, L->norm[1], L->norm_bias[1], row_slot, B, D, eps, dtype, style, h);
            residual_add(x, h, B * D, dtype, rm);
            if (L->norm[2])
                decode_norm(x, L->norm[2], L->norm_bias[2], row_slot, B, D, eps, dtype, style, h);
            else
                memcpy(h, x, sizeof(float) * (size_t)(B * D));
        } else {
            residual_add(x, o, B * D, dtype, rm);
            decode_norm(x, L->norm[1], L->norm_bias[1], row_slot, B, D, eps, dtype, style, h);
        }
        const int gated = !o_->ungated; /* StarCoder2's MLP: up alone, down(act(up)) */
        if ((rc = decode_proj(L, 2, h, B, D, gated ? 2 * F : F, dtype, row_slot, slots, P, any_delta, one_pass, LOW(2),
                              gu, n_threads)))
            break;
        gate_mul(gu, B, F, dtype, gated, o_->act, act);
        if ((rc = decode_proj(L, 3, act, B, F, D, dtype, row_slot, slots, P, any_delta, one_pass, LOW(3), dn, n_threads))) break;
        if (o_->parallel && o_->sublayers_first) /* Phi: dn = round(attention + MLP), then x + dn */
            residual_add(dn, o, B * D, dtype, 1.f);
        if (L->norm[3]) { /* the MLP's output normed before its residual add */
            decode_norm(dn, L->norm[3], L->norm_bias[3], row_slot, B, D, eps, dtype, style, h);
            residual_add(x, h, B * D, dtype, rm);
        } else
            residual_add(x, dn, B * D, dtype, rm);
    }
#undef LOW
    if (!rc && final_norm) {
        decode_norm(x, final_norm, o_->final_norm_bias, row_slot, B, D, eps, dtype, style, h);
        memcpy(x, h, sizeof(float) * (size_t)(B * D));
        if (head) rc = decode_head(h, B, D, head, dtype, vocab, n_heads, head_signs, head_alpha, head_alpha_stride,
                                   head_of_row, logits, n_threads, one_var);
    }
    if (!rc && x_out) memcpy(x_out, x, sizeof(float) * (size_t)(B * D));
    free(buf);
    free(row_slot);
    return rc ? -1 : 0;
}

/* The first index of a row's maximum, a NaN above everything (the first NaN), as numpy's argmax:
 * the greedy pick of a row of logits. Two passes (the maximum and whether a NaN is there, then the
 * first index equal to it), in vector lanes: scalar, the first pass's loop-carried max took ~50 µs
 * of a 49152-word row (~0.6 % of a one-row bf16 SmolLM2-135M step). */
static int64_t argmax_row(const float *v, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        un |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, x);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, mx);
    for (int k = 0; k < 16; ++k) m = lanes[k] > m ? lanes[k] : m;
    nan = un != 0;
#elif defined(__AVX2__)
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int k = 0; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < n; ++i) {
        m = v[i] > m ? v[i] : m;
        nan |= v[i] != v[i];
    }
    i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, mv, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (nan ? v[i] != v[i] : v[i] == m) return i;
    return 0;
}

/* out[r] = argmax_row of row r of x [rows, n] (tests hold it against numpy's). */
void bd_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * n, n);
}

static double monotonic_s(void) { /* the clock of Python's time.monotonic() on Linux */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Up to `steps` greedy decode steps of the same B rows in one call: bd_decode_layers' step with
 * token ids and its head (logits), then each row's argmax (argmax_row) is its token of this step
 * (out_tokens[b · steps + s]) and its input of the next, at the next position: the rotation's row
 * rope_rows[b] + s, the pool row of that position in the row's block list (tables), lens + s. A step
 * after the first starts only while *stop is 0 (the caller sets it when a request or a cancel
 * arrives) and the clock (CLOCK_MONOTONIC, seconds) is before `deadline` (≤ 0: none). Every
 * position must have its rope row and its block: else −5 before anything runs. Returns the steps
 * run (≥ 1), or bd_decode_layers' error code; the logits are the last step's; step_s[s] (if not
 * NULL) the clock when step s's tokens were picked. tokens, rope_rows, write_rows and lens are read,
 * never written. The arguments are bd_decode_layers' (x_in NULL: token ids; x_out ignored), then the
 * burst's own. */
int64_t bd_decode_steps(const bd_decode_layer *layers, int64_t n_layers, int64_t n_slots, const void *x_in,
                        const int64_t *tokens, const void *embed, int64_t n_vocab, int64_t n_embeds,
                        const void *const *embed_weight, const uint8_t *const *embed_signs,
                        const float *const *embed_alpha, const int64_t *embed_planes, const int64_t *embed_of_row,
                        float *x_out, int64_t B, const int32_t *row_slot32, const int32_t *row_planes32,
                        int64_t n_planes, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t F, float eps, int dtype,
                        const void *rope_cos, const void *rope_sin, int rope_dtype, const int64_t *rope_rows,
                        int64_t n_rope, const int64_t *write_rows, const int32_t *tables, int64_t max_blocks,
                        const int32_t *lens, int64_t bs, float scale, const void *final_norm, const void *head,
                        int64_t vocab, int64_t n_heads, const uint8_t *const *head_signs,
                        const float *const *head_alpha, const int64_t *head_alpha_stride, const int64_t *head_of_row,
                        float *logits, int n_threads, int fuse, const bd_lowrank *const *lowrank,
                        const bd_decode_opts *opts, int64_t steps,
                        const volatile int32_t *stop,
                        double deadline, int64_t *out_tokens, double *step_s) {
    (void)x_out;
    if (steps < 1 || x_in || !tokens || !head || !logits || bs < 1) return -5;
    for (int64_t b = 0; b < B; ++b) /* every position of the burst has its rotation and its block */
        if (lens[b] < 1 || rope_rows[b] < 0 || rope_rows[b] + steps > n_rope || (lens[b] - 1 + steps - 1) / bs >= max_blocks)
            return -5;
    /* the rows' tokens, rope rows and pool rows, then their lengths: the call's own copies */
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * B) + sizeof(int32_t) * (size_t)(B + 1));
    if (!tok) return -1;
    int64_t *rope = tok + B, *wr = rope + B;
    int32_t *len = (int32_t *)(wr + B);
    memcpy(tok, tokens, sizeof(int64_t) * (size_t)B);
    memcpy(rope, rope_rows, sizeof(int64_t) * (size_t)B);
    memcpy(wr, write_rows, sizeof(int64_t) * (size_t)B);
    memcpy(len, lens, sizeof(int32_t) * (size_t)B);
    int64_t s = 0;
    for (; s < steps; ++s) {
        if (s > 0 && ((stop && *stop) || (deadline > 0 && monotonic_s() >= deadline))) break;
        const int rc = bd_decode_layers(layers, n_layers, n_slots, NULL, tok, embed, n_vocab, n_embeds, embed_weight,
                                        embed_signs, embed_alpha, embed_planes, embed_of_row, NULL, B, row_slot32,
                                        row_planes32, n_planes, D, H, KV, hd, F, eps, dtype, rope_cos, rope_sin,
                                        rope_dtype, rope, n_rope, wr, tables, max_blocks, len, bs, scale, final_norm,
                                        head, vocab, n_heads, head_signs, head_alpha, head_alpha_stride, head_of_row,
                                        logits, n_threads, fuse, lowrank, opts);
        if (rc) {
            free(tok);
            return rc;
        }
        for (int64_t b = 0; b < B; ++b) {
            tok[b] = out_tokens[b * steps + s] = argmax_row(logits + b * vocab, vocab);
            const int64_t pos = len[b]; /* the next token's position */
            rope[b] += 1;
            len[b] += 1;
            wr[b] = (int64_t)tables[b * max_blocks + pos / bs] * bs + pos % bs;
        }
        if (step_s) step_s[s] = monotonic_s();
    }
    free(tok);
    return s;
}
