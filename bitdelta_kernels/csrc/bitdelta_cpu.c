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
 * over set bits and corrects with Σx once: by lookups in x's tables, on AVX-512
 * of 4 columns, 16 sign rows per vector, on AVX2 of 2 columns, 8 rows per vector
 * (lut_sums); the fused one-pass GEMV by one masked add per 16 columns.
 *
 * All matrices are fp32 row-major with a leading-dimension argument unless
 * said otherwise; n_threads is the caller's torch.get_num_threads(), the
 * calling thread and n_threads − 1 helpers of the library's own pool (pool_run).
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

/* ---------------------------------------------------------------------- */
/* the step's thread pool: helpers that join a task if they are awake     */
/* ---------------------------------------------------------------------- */
/* OpenMP's regions end in a barrier that waits for EVERY thread of the team, and libgomp parks a
 * waiting thread on a futex almost at once (a ~1000-iteration spin) whenever the process has more
 * libgomp threads than cores, which a worker always has: each Python thread that ran a parallel
 * torch op (the loop, loaders, the engine) keeps a pool of its own. A decode step runs ~150
 * regions, and on 2 cores its 2 threads then spent ~25 % of the step asleep waiting for each
 * other: a fp32 SmolLM2-135M step took 21 ms on 2 threads against 15 ms on one (docs/kernels.md,
 * "The library's threads").
 * So the step's regions run here instead. A task is a function that every participant calls and
 * that takes its work from counters in its context (pool_claim), so it needs no particular thread:
 * the caller always runs it, a helper joins only while the task is open, and the caller waits only
 * for helpers that joined, never for one that is asleep or descheduled. Helpers spin ~0.1 ms
 * after a task (a step's regions are microseconds apart), then sleep on a condition variable.
 * One caller at a time: a second concurrent caller runs its task alone. */
typedef void (*pool_fn)(void *ctx);
#define POOL_MAX 255
#define POOL_OPEN (1ull << 16)            /* state: joined helpers in bits 0-15, open bit 16, */
#define POOL_EPOCH (1ull << 17)           /* and the task's number from bit 17 */
static struct {
    pthread_mutex_t mu;                   /* the sleepers' lock, and the helpers' start */
    pthread_cond_t cv;
    pthread_mutex_t caller;               /* one task at a time */
    int n_helpers, sleepers;
    int want;                             /* helpers with index < want may join the open task */
    uint64_t state;                       /* epoch | open | joined (atomic) */
    int finished;                         /* helpers done with the current task (atomic) */
    pool_fn fn;
    void *ctx;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pool_helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE) & ~(POOL_EPOCH - 1);
    for (;;) {
        uint64_t s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
        for (int spin = 0; (s & ~(POOL_EPOCH - 1)) == seen; s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE)) {
            if (++spin < 4096) { /* ~0.1 ms of pauses */
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
            while (((s = __atomic_load_n(&pool.state, __ATOMIC_SEQ_CST)) & ~(POOL_EPOCH - 1)) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        seen = s & ~(POOL_EPOCH - 1);
        /* join while this task is open: one CAS on the whole state, so a join never counts
         * towards another task */
        while ((s & POOL_OPEN) && (s & ~(POOL_EPOCH - 1)) == seen &&
               index < __atomic_load_n(&pool.want, __ATOMIC_RELAXED)) {
            if (__atomic_compare_exchange_n(&pool.state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                pool.fn(pool.ctx);
                __atomic_add_fetch(&pool.finished, 1, __ATOMIC_RELEASE);
                break;
            }
        }
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has no helpers: start afresh */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pthread_mutex_init(&pool.caller, NULL);
    pool.n_helpers = pool.sleepers = 0;
}

/* fn(ctx) on the calling thread and on up to n_threads − 1 helpers (started on first use); returns
 * when fn has returned everywhere it was called. */
static void pool_run(pool_fn fn, void *ctx, int n_threads) {
    if (n_threads > POOL_MAX + 1) n_threads = POOL_MAX + 1;
    if (n_threads <= 1 || pthread_mutex_trylock(&pool.caller) != 0) {
        fn(ctx);
        return;
    }
    static int at_fork = 0;
    if (!at_fork) at_fork = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool.n_helpers < n_threads - 1) { /* helpers are never stopped: a worker keeps its count */
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &at, pool_helper, (void *)(intptr_t)pool.n_helpers);
        pthread_attr_destroy(&at);
        if (rc != 0) break; /* fewer helpers: the task still runs */
        ++pool.n_helpers;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    __atomic_store_n(&pool.want, n_threads - 1, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    const uint64_t epoch = (__atomic_load_n(&pool.state, __ATOMIC_RELAXED) & ~(POOL_EPOCH - 1)) + POOL_EPOCH;
    __atomic_store_n(&pool.state, epoch | POOL_OPEN, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    fn(ctx);
    const uint64_t s = __atomic_fetch_and(&pool.state, ~POOL_OPEN, __ATOMIC_ACQ_REL); /* close it */
    const int joined = (int)(s & (POOL_OPEN - 1));
    while (__atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) < joined) cpu_relax();
    pthread_mutex_unlock(&pool.caller);
}

/* A task's work: n jobs, claimed in runs by whoever calls pool_claim. A run is 1/parts of the jobs
 * left (parts = 2 × the threads; at least one job), so each participant reads long contiguous
 * stretches of a matrix (a stream's prefetch ramps up once a run, not once a job: jobs of 64 rows
 * one at a time made a bf16 step no faster on 2 threads than on one) and the last runs are short,
 * so everyone finishes together. Returns the run's first job (and its length in *count), or −1. */
typedef struct {
    int64_t next, n, parts;
} pool_jobs;
static inline pool_jobs pool_jobs_of(int64_t n, int n_threads) {
    return (pool_jobs){0, n, 2 * (int64_t)(n_threads > 1 ? n_threads : 1)};
}
static inline int64_t pool_claim(pool_jobs *j, int64_t *count) {
    int64_t cur = __atomic_load_n(&j->next, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t left = j->n - cur, k = left / j->parts > 1 ? left / j->parts : 1;
        if (left <= 0) return -1;
        if (__atomic_compare_exchange_n(&j->next, &cur, cur + k, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *count = k;
            return cur;
        }
    }
}

/* fn(ctx, r0, r1) over rows [0, n) in runs of `chunk`-row jobs, on the pool: for the kernels whose
 * rows are independent (a row's numbers never depend on the run it falls in). */
enum { POOL_ROWS = 64 }; /* rows per job: 4 of the planes' 16-row blocks, 8 of the GEMV's 8-row ones */
typedef void (*rows_fn)(void *ctx, int64_t r0, int64_t r1);
typedef struct {
    rows_fn fn;
    void *ctx;
    int64_t n, chunk;
    pool_jobs jobs;
} rows_task;

static void rows_run(void *c) {
    rows_task *T = (rows_task *)c;
    for (int64_t j, k; (j = pool_claim(&T->jobs, &k)) >= 0;)
        T->fn(T->ctx, j * T->chunk, (j + k) * T->chunk < T->n ? (j + k) * T->chunk : T->n);
}

static void pool_rows(rows_fn fn, void *ctx, int64_t n, int64_t chunk, int n_threads) {
    rows_task T = {fn, ctx, n, chunk, pool_jobs_of((n + chunk - 1) / chunk, n_threads)};
    pool_run(rows_run, &T, n_threads);
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

/* Rows per register block: 8 independent accumulator chains cover the 3–4
 * cycle add latency at one masked add per cycle. */
#define ROWS 8

/* ---------------------------------------------------------------------- */
/* delta GEMV, "mask" method: y[m, r] += α_r · Σ_k x[m, k] · s[r, k]       */
/* ---------------------------------------------------------------------- */
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

/* ---------------------------------------------------------------------- */
/* merge: out[r − r0, k] = w[r, k] + α_r · s[r, k]   for r in [r0, r1)      */
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

/* The sign planes a GEMV's own pass sums (linear_rows): plane p's bits s[p] [d_out, lds] and its
 * α's a[p] (row r's at a[p][r · alpha_stride]). The blocks of LINEAR_BLOCK take one plane; the
 * one-pass loops (delta_rows_f32, delta_rows_dp) up to ONE_PASS_PLANES for up to ONE_PASS_ROWS x
 * rows (one_pass_most), one accumulator pair per plane and x row; one_pass_planes. */
#define ONE_PASS_PLANES 4
#define ONE_PASS_ROWS 2
/* The planes the one-pass loops sum for M ≤ ONE_PASS_ROWS x rows (0: more rows): 4, 3, so that the
 * 2·M·(planes + 1) accumulators, the bf16 loop's 2·planes sign vectors and a few more stay in
 * AVX-512's 32 registers. From 3 rows on the dense blocks of three weight rows (DENSE_MIN_M_F32)
 * with the table loop's planes beat these one-weight-row loops: one core of a 2-core AMD EPYC of the
 * Zen 4 generation, a one-plane variant's step of SmolLM2-135M's C decode layers (`bench/kernels.py`'
 * model, in turns, medians; 2026-12-05) took at 2 / 3 / 4 rows 25.2 / 35.0 / 40.6 ms in one pass
 * against 25.2 / 26.9 / 30.9 in two in fp32, and 15.8 / 16.6 / 19.5 against 17.2 / 15.5 / 17.4 in
 * bf16 (up to 4 rows took one pass before those blocks' streams went to L2, ROWS_PREFETCH). bf16
 * takes one pass for one row only (ONE_PASS_ROWS_BF16): at 2 rows its one pass took 15.3–16.6 ms
 * against 13.1–14.7 in two (the same bench, four runs of 15–25 reps in turns, 2026-12-05). */
#define ONE_PASS_ROWS_BF16 1
static inline int one_pass_most(int dtype, int64_t M) {
    const int64_t rows = dtype == BD_W_BF16 ? ONE_PASS_ROWS_BF16 : ONE_PASS_ROWS;
    return M < 1 || M > rows ? 0 : (int)(5 - M);
}
/* FN(NX, NP) with literals, one loop per pair (its accumulators in registers), for M x rows of n
 * planes, n ≤ one_pass_most(dtype, M): the callers choose n so (linear_planes); anything else aborts. */
#define ONE_PASS_SWITCH(M, n, FN)                                                                        \
    switch ((M) * 8 + (n)) {                                                                             \
    case 9: FN(1, 1); break;                                                                             \
    case 10: FN(1, 2); break;                                                                            \
    case 11: FN(1, 3); break;                                                                            \
    case 12: FN(1, 4); break;                                                                            \
    case 17: FN(2, 1); break;                                                                            \
    case 18: FN(2, 2); break;                                                                            \
    case 19: FN(2, 3); break;                                                                            \
    default: abort();                                                                                    \
    }
/* The one-pass loops' state for weight row r: each x row's accumulator pair (a0, a1: the
 * weights' sums), each plane's and x row's (d0, d1: the signs'), and each plane's bits at row r
 * (sr), for NX x rows and NP planes of P. */
#define ONE_PASS_ACC_INIT(NX, NP)                                                                        \
    const uint8_t *sr[ONE_PASS_PLANES];                                                                  \
    __m512 a0[ONE_PASS_ROWS], a1[ONE_PASS_ROWS], d0[ONE_PASS_PLANES][ONE_PASS_ROWS],                     \
        d1[ONE_PASS_PLANES][ONE_PASS_ROWS];                                                              \
    for (int b = 0; b < (NX); ++b) {                                                                     \
        a0[b] = a1[b] = _mm512_setzero_ps();                                                             \
        for (int p = 0; p < (NP); ++p) d0[p][b] = d1[p][b] = a0[b];                                      \
    }                                                                                                    \
    for (int p = 0; p < (NP); ++p) sr[p] = P->s[p] + r * lds
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
 * (docs/kernels.md). NX, NP: x rows and P's planes, literals (delta_rows_dp). */
static inline __attribute__((always_inline)) void dp_rows_np(const uint16_t *xb, int64_t ldx, const uint16_t *w,
                                                             int64_t ldw, const pass_planes *P, int64_t lds,
                                                             int64_t d_in, int64_t alpha_stride, float *y, int64_t ldy,
                                                             int64_t r0, int64_t r1, const int NX, const int NP) {
    const __m512i pos = _mm512_set1_epi16(0x3F80), neg = _mm512_set1_epi16((short)0xBF80); /* bf16 ±1 */
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t *wr = w + r * ldw;
        ONE_PASS_ACC_INIT(NX, NP);
        int64_t k = 0;
        for (; k + 64 <= d_in; k += 64) {
            STREAM_PREFETCH(wr + k, 2);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wr + k));
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wr + k + 32));
            __m512bh s0[ONE_PASS_PLANES], s1[ONE_PASS_PLANES]; /* each plane's 64 signs as bf16 ±1 */
            for (int p = 0; p < NP; ++p) {
                uint32_t m0, m1;
                memcpy(&m0, sr[p] + k / 8, 4);
                memcpy(&m1, sr[p] + k / 8 + 4, 4);
                s0[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m0, neg, pos);
                s1[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m1, neg, pos);
            }
            for (int b = 0; b < NX; ++b) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k));
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k + 32));
                a0[b] = _mm512_dpbf16_ps(a0[b], x0, w0);
                a1[b] = _mm512_dpbf16_ps(a1[b], x1, w1);
                for (int p = 0; p < NP; ++p) {
                    d0[p][b] = _mm512_dpbf16_ps(d0[p][b], x0, s0[p]);
                    d1[p][b] = _mm512_dpbf16_ps(d1[p][b], x1, s1[p]);
                }
            }
        }
        const int half = k + 32 <= d_in;
        if (half) { /* 32 columns more: the first halves' accumulators */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wr + k));
            __m512bh s0[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) {
                uint32_t m0;
                memcpy(&m0, sr[p] + k / 8, 4);
                s0[p] = (__m512bh)_mm512_mask_blend_epi16((__mmask32)m0, neg, pos);
            }
            for (int b = 0; b < NX; ++b) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * ldx + k));
                a0[b] = _mm512_dpbf16_ps(a0[b], x0, w0);
                for (int p = 0; p < NP; ++p) d0[p][b] = _mm512_dpbf16_ps(d0[p][b], x0, s0[p]);
            }
        }
        float al[ONE_PASS_PLANES];
        for (int p = 0; p < NP; ++p) al[p] = P->a[p][r * alpha_stride];
        float sums[ONE_PASS_ROWS]; /* in registers, before the tails (PAIR_SUMS) */
        UNROLLED for (int b = 0; b < NX; ++b) {
            __m512 acc = _mm512_add_ps(a0[b], a1[b]);
            UNROLLED for (int p = 0; p < NP; ++p)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(al[p]), _mm512_add_ps(d0[p][b], d1[p][b]), acc);
            sums[b] = _mm512_reduce_add_ps(acc);
        }
        for (int b = 0; b < NX; ++b) {
            const uint16_t *xm = xb + b * ldx;
            float t = sums[b];
            for (int64_t kk = k + 32 * half; kk < d_in; ++kk) { /* ragged tail */
                const float xv = w_at(xm, BD_W_BF16, kk);
                float dt = 0.f;
                for (int p = 0; p < NP; ++p) dt += al[p] * ((sr[p][kk >> 3] >> (kk & 7)) & 1 ? xv : -xv);
                t += xv * w_at(wr, BD_W_BF16, kk) + dt;
            }
            y[b * ldy + r] = t;
        }
    }
}

static void delta_rows_dp(const uint16_t *xb, int64_t ldx, int64_t M, const uint16_t *w, int64_t ldw,
                          const pass_planes *P, int64_t lds, int64_t d_in, int64_t alpha_stride, float *y, int64_t ldy,
                          int64_t r0, int64_t r1) {
#define DP_ROWS(NX, NP) dp_rows_np(xb, ldx, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1, NX, NP)
    ONE_PASS_SWITCH(M, P->n, DP_ROWS);
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
 * ~18 ms of weights; the table loop's compute ~0.5 ms of it). xsum: Σ x_b (row_sums). An x row's
 * sums take the same steps whatever NX. NX, NP: x rows and P's planes, literals (delta_rows_f32). */
static inline __attribute__((always_inline)) void f32_rows_np(const float *x, int64_t ldx, const float *xsum,
                                                              const float *w, int64_t ldw, const pass_planes *P,
                                                              int64_t lds, int64_t d_in, int64_t alpha_stride, float *y,
                                                              int64_t ldy, int64_t r0, int64_t r1, const int NX,
                                                              const int NP) {
    for (int64_t r = r0; r < r1; ++r) {
        const float *wr = w + r * ldw;
        ONE_PASS_ACC_INIT(NX, NP);
        int64_t k = 0;
        for (; k + 32 <= d_in; k += 32) {
            const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
            uint32_t m[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) memcpy(&m[p], sr[p] + k / 8, 4);
            for (int b = 0; b < NX; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x + b * ldx + k), x1 = _mm512_loadu_ps(x + b * ldx + k + 16);
                a0[b] = _mm512_fmadd_ps(x0, w0, a0[b]);
                a1[b] = _mm512_fmadd_ps(x1, w1, a1[b]);
                for (int p = 0; p < NP; ++p) {
                    d0[p][b] = _mm512_mask_add_ps(d0[p][b], (__mmask16)m[p], d0[p][b], x0);
                    d1[p][b] = _mm512_mask_add_ps(d1[p][b], (__mmask16)(m[p] >> 16), d1[p][b], x1);
                }
            }
        }
        const int half = k + 16 <= d_in;
        if (half) {
            const __m512 w0 = _mm512_loadu_ps(wr + k);
            uint16_t m0[ONE_PASS_PLANES];
            for (int p = 0; p < NP; ++p) memcpy(&m0[p], sr[p] + k / 8, 2);
            for (int b = 0; b < NX; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x + b * ldx + k);
                a0[b] = _mm512_fmadd_ps(x0, w0, a0[b]);
                for (int p = 0; p < NP; ++p) d0[p][b] = _mm512_mask_add_ps(d0[p][b], (__mmask16)m0[p], d0[p][b], x0);
            }
        }
        float al[ONE_PASS_PLANES], asum = 0.f;
        for (int p = 0; p < NP; ++p) {
            al[p] = P->a[p][r * alpha_stride];
            asum += al[p];
        }
        float sums[ONE_PASS_ROWS]; /* in registers, before the tails (PAIR_SUMS) */
        UNROLLED for (int b = 0; b < NX; ++b) {
            __m512 acc = _mm512_add_ps(a0[b], a1[b]);
            UNROLLED for (int p = 0; p < NP; ++p)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(2.f * al[p]), _mm512_add_ps(d0[p][b], d1[p][b]), acc);
            sums[b] = _mm512_reduce_add_ps(acc);
        }
        for (int b = 0; b < NX; ++b) {
            const float *xm = x + b * ldx;
            float t = sums[b];
            for (int64_t kk = k + 16 * half; kk < d_in; ++kk) { /* ragged tail */
                float dt = 0.f;
                for (int p = 0; p < NP; ++p) dt += (sr[p][kk >> 3] >> (kk & 7)) & 1 ? 2.f * al[p] * xm[kk] : 0.f;
                t += xm[kk] * wr[kk] + dt;
            }
            y[b * ldy + r] = t - asum * xsum[b];
        }
    }
}

static void delta_rows_f32(const float *x, int64_t ldx, int64_t M, const float *xsum, const float *w, int64_t ldw,
                           const pass_planes *P, int64_t lds, int64_t d_in, int64_t alpha_stride, float *y,
                           int64_t ldy, int64_t r0, int64_t r1) {
#define F32_ROWS(NX, NP) f32_rows_np(x, ldx, xsum, w, ldw, P, lds, d_in, alpha_stride, y, ldy, r0, r1, NX, NP)
    ONE_PASS_SWITCH(M, P->n, F32_ROWS);
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
 * throughout (keys and values widened from kv_dtype). */
static void attend(const float *qg, int64_t G, int64_t D, const void *k, const void *v, int kv_dtype,
                   const int32_t *table, int64_t bs, int64_t KV, int64_t g, int64_t lo, int64_t n, float scale,
                   float *buf, float *o) {
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
    float scale;
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
                   T->tables + b * T->max_blocks, T->bs, T->KV, g, lo, n, T->scale, buf,
                   T->out + (b * T->H + g * T->G) * T->D);
        }
    free(buf);
}

/* out[b, h, :] = Σ_t softmax_t(q[b, h] · k_t · scale) v_t over the keys t the query sees.
 *   q, out: fp32 [B, H, D] contiguous; k, v: [rows, KV, D] contiguous in kv_dtype (BD_W_*), token t
 *   of sequence b at row tables[b * max_blocks + t / bs] * bs + t % bs; lens[b]: its length (the
 *   query is token lens[b] − 1); window > 0: keys t > lens[b] − 1 − window only.
 *   One task per (sequence, KV head) (attend): its G = H / KV query heads share each key and value
 *   row, which is read once. n_threads 1 runs on the calling thread. Returns 0 or −1 (no memory). */
int bd_paged_decode(const float *q, int64_t B, int64_t H, int64_t KV, int64_t D, const void *k, const void *v,
                    int kv_dtype, const int32_t *tables, int64_t max_blocks, const int32_t *lens, int64_t bs,
                    int64_t window, float scale, float *out, int n_threads) {
    const int64_t G = H / KV;
    attend_task T = {q, k, v, tables, lens, out, B, H, KV, D, G, max_blocks, bs, window, scale, kv_dtype, 0,
                     pool_jobs_of(B * KV, n_threads)};
    pool_run(attend_run, &T, B * KV == 1 ? 1 : n_threads);
    return T.failed ? -1 : 0;
}

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
    const void *norm[2];   /* input and post-attention RMSNorm weights, [n_slots + 1, dim] */
    void *k, *v;           /* this layer's KV pool [rows, KV, hd] in the dtype */
    int64_t window;        /* sliding window; 0: full attention */
} bd_decode_layer;

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

/* y = round(x · Wᵀ [+ Σ_p α_v ⊙ (x · S_vᵀ) over the row's plane slots v ≥ 0]) [+ bias row], as
 * runner._linear: slots [B, n_planes] each row's plane slots (row_slot itself for one plane).
 * one_pass: the step's one row, of a variant, in one pass over the weights and its planes' bits
 * where the build's loop sums that many (linear_planes). */
static int decode_proj(const bd_decode_layer *L, int g, const float *x, int64_t B, int64_t d_in, int64_t d_out,
                       int dtype, const int64_t *row_slot, const int64_t *slots, int64_t n_planes, int any_delta,
                       int one_pass, float *y, int n_threads) {
    const int64_t lds = (d_in + 7) / 8;
    if (linear_planes(x, B, d_in, L->w[g], dtype, d_in, any_delta ? L->s[g] : NULL, d_out * lds, d_out, d_in, lds,
                      L->a[g], d_out, 1, slots, n_planes, y, d_out, dtype == BD_W_BF16, one_pass, n_threads))
        return -1;
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

/* h = round(w · round(x · rsqrt(mean(x²) + eps))), w the row's slot's weights (runner._norm). The
 * element-wise steps of a layer here and below run L lanes at a time: one by one (round_to and expf
 * per value) they were ~6 % of a one-row bf16 step and ~12 % of an 8-row one. */
static void decode_norm(const float *x, const void *w, const int64_t *row_slot, int64_t B, int64_t D, float eps,
                        int dtype, float *h) {
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * D;
        float *hb = h + b * D;
        const int64_t off = (row_slot[b] + 1) * D;
        int64_t k = 0;
        float ss = 0.f;
#if defined(__AVX512F__) || defined(__AVX2__)
        vf acc = V_ZERO();
        for (; k + LANES <= D; k += LANES) acc = V_FMA(V_LOAD(xb + k), V_LOAD(xb + k), acc);
        ss = V_SUM(acc);
#endif
        for (; k < D; ++k) ss += xb[k] * xb[k];
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        const vf iv = V_SET1(inv);
        for (; k + LANES <= D; k += LANES)
            V_STORE(hb + k, round_vec(dtype, V_MUL(widen_vec(w, dtype, off + k), round_vec(dtype, V_MUL(V_LOAD(xb + k), iv)))));
#endif
        for (; k < D; ++k) hb[k] = round_to(dtype, w_at(w, dtype, off + k) * round_to(dtype, xb[k] * inv));
    }
}

/* x[i] = round(x[i]) for i < n. */
static void round_all(float *x, int64_t n, int dtype) {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; i + LANES <= n; i += LANES) V_STORE(x + i, round_vec(dtype, V_LOAD(x + i)));
#endif
    for (; i < n; ++i) x[i] = round_to(dtype, x[i]);
}

/* x[i] = round(x[i] + o[i]) for i < n (a residual add). */
static void residual_add(float *x, const float *o, int64_t n, int dtype) {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; i + LANES <= n; i += LANES) V_STORE(x + i, round_vec(dtype, V_ADD(V_LOAD(x + i), V_LOAD(o + i))));
#endif
    for (; i < n; ++i) x[i] = round_to(dtype, x[i] + o[i]);
}

/* act[b, k] = round(round(silu(g)) · u), g = gu[b, k], u = gu[b, F + k] (runner's MLP). */
static void silu_mul(const float *gu, int64_t B, int64_t F, int dtype, float *act) {
    for (int64_t b = 0; b < B; ++b) {
        const float *gb = gu + b * 2 * F, *ub = gb + F;
        float *ab = act + b * F;
        int64_t k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        for (; k + LANES <= F; k += LANES) {
            const vf g = V_LOAD(gb + k);
            const vf sg = round_vec(dtype, V_DIV(g, V_ADD(V_SET1(1.f), exp_vec(V_MUL(g, V_SET1(-1.f))))));
            V_STORE(ab + k, round_vec(dtype, V_MUL(sg, V_LOAD(ub + k))));
        }
#endif
        for (; k < F; ++k) ab[k] = round_to(dtype, round_to(dtype, gb[k] / (1.f + expf(-gb[k]))) * ub[k]);
    }
}

/* Rope over n heads of hd values at xh (the rotation over the whole head, runner's rope):
 * lo' = round(round(lo·c) + round(−hi·s)), hi' = round(round(hi·c') + round(lo·s')). */
static void rope_heads(float *x, int64_t n, int64_t hd, const float *c, const float *sn, int dtype) {
    const int64_t half = hd / 2;
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
    int every = n_heads == 1; /* every row takes plane 0 */
    for (int64_t b = 0; b < B && every; ++b) every = head_of_row[b] == 0;
    if (every) /* one_pass: the one row's plane in the head's own pass (as decode_proj) */
        return linear_planes(h, B, D, head, dtype, D, head_signs[0], 0, vocab, D, lds, head_alpha[0], 0,
                             head_alpha_stride[0], NULL, 1, logits, vocab, dtype == BD_W_BF16, one_pass, n_threads);
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
 * n_planes > 1: row_planes int32 [B, n_planes], each row's sign-plane slots (a variant of k planes,
 * −1 past its k) instead of row_slot's one (NULL with n_planes ≤ 1); rope_cos, rope_sin: tables
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
 * One plane for every row takes linear_planes' one task (on many threads, one core's GEMV beside
 * another's planes); a mix, the GEMV for every row and then each plane over its rows.
 * fuse: a step of B ≤ ONE_PASS_ROWS rows of one variant (row_slot ≥ 0 and plane slots the same in
 * every row) of up to one_pass_planes(dtype, B) planes (4, 3 for 1–2 rows; fp32 with AVX-512,
 * delta_rows_f32; bf16 with AVX512-BF16, delta_rows_dp, one row only) sums each projection's planes, and the
 * head's plane when its rows take one, in the weights' pass, not by the table loop: other sums, so
 * its numbers are not the same row's in a mixed step (the caller's choice: never in the
 * batch-invariant mode), though they are that row's alone; anything else ignores it.
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
                     int fuse) {
    const int64_t Q = (H + 2 * KV) * hd, HD = H * hd;
    const int64_t P = n_planes > 1 ? n_planes : 1;
    /* the rows' slots as the kernels index them (int64), checked; the runner's are int32 */
    int64_t *row_slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B * (1 + P) + 1));
    if (!row_slot) return -1;
    int64_t *row_planes = row_slot + B;
    int any_delta = 0, bad = 0;
    for (int64_t b = 0; b < B; ++b) {
        row_slot[b] = row_slot32[b];
        bad |= row_slot[b] < -1 || row_slot[b] >= n_slots;
        for (int64_t p = 0; n_planes > 1 && p < P; ++p) {
            const int64_t v = row_planes[b * P + p] = row_planes32[b * P + p];
            bad |= v < -1 || v >= n_slots || (v >= 0 && row_slot[b] < 0);
        }
        if (head_of_row && (head_of_row[b] < -1 || head_of_row[b] >= n_heads)) bad |= 2;
        if (rope_rows[b] < 0 || rope_rows[b] >= n_rope ||
            (!x_in && (tokens[b] < 0 || tokens[b] >= n_vocab ||
                       (embed_of_row && (embed_of_row[b] < -1 || embed_of_row[b] >= n_embeds)))))
            bad |= 4;
        any_delta |= row_slot[b] >= 0;
    }
    if (bad) {
        free(row_slot);
        return bad & 1 ? -2 : bad & 2 ? -3 : -4;
    }
    const int64_t *slots = n_planes > 1 ? row_planes : row_slot; /* each row's plane slots */
    /* fuse: rows of one variant (the same slots in every row), as many as the one-pass loops take */
    int one_var = fuse && one_pass_planes(dtype, B) > 0;
    for (int64_t b = 1; b < B && one_var; ++b) {
        one_var = row_slot[b] == row_slot[0];
        for (int64_t p = 0; p < P && one_var; ++p) one_var = slots[b * P + p] == slots[p];
    }
    /* the head's plane in one pass, and the projections' (linear_planes: up to its loops' planes) */
    const int one_pass = one_var && row_slot[0] >= 0;
    const int64_t n = B * (D + 2 * hd + D + Q + 2 * HD + D + 3 * F + D);
    float *buf = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!buf) {
        free(row_slot);
        return -1;
    }
    float *x = buf, *cs = x + B * D, *sn = cs + B * hd, *h = sn + B * hd, *qkv = h + B * D, *q = qkv + B * Q, *att = q + B * HD, *o = att + B * HD, *gu = o + B * D,
          *act = gu + B * 2 * F, *dn = act + B * F;
    decode_embed(x_in, tokens, embed, n_vocab, D, dtype, embed_weight, embed_signs, embed_alpha, embed_planes,
                 embed_of_row, B, x);
    for (int64_t b = 0; b < B; ++b) { /* each row's rotation, the same in every layer */
        load_row(rope_cos, rope_dtype, rope_rows[b] * hd, hd, cs + b * hd);
        load_row(rope_sin, rope_dtype, rope_rows[b] * hd, hd, sn + b * hd);
    }
    int rc = 0;
    for (int64_t l = 0; l < n_layers && !rc; ++l) {
        const bd_decode_layer *L = layers + l;
        decode_norm(x, L->norm[0], row_slot, B, D, eps, dtype, h);
        if ((rc = decode_proj(L, 0, h, B, D, Q, dtype, row_slot, slots, P, any_delta, one_pass, qkv, n_threads))) break;
        for (int64_t b = 0; b < B; ++b) { /* rope over q's and k's heads (adjacent in qkv), then k, v into the pool */
            float *row = qkv + b * Q;
            rope_heads(row, H + KV, hd, cs + b * hd, sn + b * hd, dtype);
            memcpy(q + b * HD, row, sizeof(float) * (size_t)HD);
            const int64_t off = write_rows[b] * KV * hd;
            for (int64_t i = 0; i < KV * hd; ++i) {
                store_out(L->k, dtype, off + i, row[HD + i]);
                store_out(L->v, dtype, off + i, row[HD + KV * hd + i]);
            }
        }
        if ((rc = bd_paged_decode(q, B, H, KV, hd, L->k, L->v, dtype, tables, max_blocks, lens, bs, L->window, scale,
                                  att, n_threads)))
            break;
        round_all(att, B * HD, dtype);
        if ((rc = decode_proj(L, 1, att, B, HD, D, dtype, row_slot, slots, P, any_delta, one_pass, o, n_threads))) break;
        residual_add(x, o, B * D, dtype);
        decode_norm(x, L->norm[1], row_slot, B, D, eps, dtype, h);
        if ((rc = decode_proj(L, 2, h, B, D, 2 * F, dtype, row_slot, slots, P, any_delta, one_pass, gu, n_threads))) break;
        silu_mul(gu, B, F, dtype, act);
        if ((rc = decode_proj(L, 3, act, B, F, D, dtype, row_slot, slots, P, any_delta, one_pass, dn, n_threads))) break;
        residual_add(x, dn, B * D, dtype);
    }
    if (!rc && final_norm) {
        decode_norm(x, final_norm, row_slot, B, D, eps, dtype, h);
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
                        float *logits, int n_threads, int fuse, int64_t steps, const volatile int32_t *stop,
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
                                        logits, n_threads, fuse);
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
