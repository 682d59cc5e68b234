/* Part of the CPU kernels' library: the thread pool of a step's calls. Included by
 * bitdelta_cpu.c, in order, after the parts before it (one translation unit, so that the compiler
 * inlines across them); not compiled alone. */

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
