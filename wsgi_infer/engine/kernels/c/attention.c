/* Attention over the paged KV cache (IEEE halves): each query row over its sequence's cached context, in float32. */
#include "attention_part.h"

/* attend_part with the common head sizes as constants, so that a head's query stays in registers */
typedef void (*attend_fn)(const float *, int64_t, const f16 *, const f16 *, const int64_t *, int64_t,
                          const int64_t *, int64_t, float, float *, float *, float *);
#define ATTEND_HEAD_DIM(D)                                                                                         \
    static void attend_##D(const float *q, int64_t group, const f16 *keys, const f16 *values,                   \
                           const int64_t *offsets, int64_t len, const int64_t *lens, int64_t head_dim, float scale, \
                           float *peak, float *total, float *weighed) {                                            \
        (void)head_dim;                                                                                            \
        attend_part(q, group, keys, values, offsets, len, lens, D, scale, peak, total, weighed);                   \
    }
ATTEND_HEAD_DIM(64) ATTEND_HEAD_DIM(128)
static void attend_any(const float *q, int64_t group, const f16 *keys, const f16 *values, const int64_t *offsets,
                       int64_t len, const int64_t *lens, int64_t head_dim, float scale, float *peak, float *total,
                       float *weighed) {
    attend_part(q, group, keys, values, offsets, len, lens, head_dim, scale, peak, total, weighed);
}

/* A context is attended in parts of ATTEND_PART tokens (counted from its first token), each with its own peak, then
 * the parts are folded in order (fold_part): a row's result depends on its context alone, whichever thread computed
 * each part. A context of one part is attended as one whole. */
#define ATTEND_PART 256

/* Folds a part (peak, total, weighed) of heads heads into the running one, which it starts where `first`: each
 * side's sums rescaled to the larger peak. */
static void fold_part(int64_t heads, int64_t head_dim, int first, float *peak, float *total, float *weighed,
                      const float *part_peak, const float *part_total, const float *part_weighed) {
    for (int64_t h = 0; h < heads; h++) {
        if (first) {
            peak[h] = part_peak[h], total[h] = part_total[h];
            memcpy(weighed + h * head_dim, part_weighed + h * head_dim, head_dim * sizeof(float));
            continue;
        }
        if (part_total[h] == 0.0f) continue; /* the head has no tokens in this part */
        float most = part_peak[h] > peak[h] ? part_peak[h] : peak[h];
        float before = expf(peak[h] - most), after = expf(part_peak[h] - most);
        peak[h] = most, total[h] = total[h] * before + part_total[h] * after;
        for (int64_t d = 0; d < head_dim; d++)
            weighed[h * head_dim + d] = weighed[h * head_dim + d] * before + part_weighed[h * head_dim + d] * after;
    }
}

/* The rows a task attends at once (see paged_attention): at most RUN_ROWS (a part's keys are transposed and its
 * values widened once for all their heads: 8 rows of 4 heads each read 2.1 times as long as 32), and fewer where
 * there would be under two tasks per thread, or where the run's scores would take more than RUN_SCORES bytes. */
#define RUN_ROWS 32
#define RUN_SCORES (1024 * 1024)

/* Runs of consecutive rows of one sequence (a prefill chunk's, a draft's verification), none of them cut by a
 * sliding window, of at most `most` rows: their starting rows and sizes. Returns how many. */
static int64_t row_runs(const int64_t *row_seqs, const int64_t *context_lens, int64_t rows, int64_t window,
                        int64_t most, int64_t *run_start, int64_t *run_rows) {
    int64_t runs = 0;
#define CUT(r) (window > 0 && context_lens[r] > window) /* row r sees only the window's last tokens */
    for (int64_t r = 0; r < rows; r++) {
        int joins = runs > 0 && !CUT(r) && !CUT(r - 1) && run_rows[runs - 1] < most && row_seqs[r] == row_seqs[r - 1];
        if (joins) {
            run_rows[runs - 1]++;
        } else {
            run_start[runs] = r, run_rows[runs] = 1, runs++;
        }
    }
    return runs;
#undef CUT
}

/* What paged_attention's tasks share: a task is one key-value head of one run of rows (row_runs) */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    const f16 *cache;
    const int64_t *offsets, *starts, *row_seqs, *context_lens, *run_start, *run_rows;
    int64_t heads, kv_heads, head_dim, window;
    float scale;
    attend_fn attend;
} attention_job;

/* A task's first row and rows, its first token (past a sliding window's cut) and the tokens it reads from there */
static void task_span(const attention_job *job, int64_t task, int64_t *r0, int64_t *n, int64_t *first, int64_t *span) {
    int64_t run = task / job->kv_heads, len = 0;
    *r0 = job->run_start[run], *n = job->run_rows[run];
    for (int64_t i = 0; i < *n; i++) len = job->context_lens[*r0 + i] > len ? job->context_lens[*r0 + i] : len;
    *first = *n == 1 && job->window > 0 && len > job->window ? len - job->window : 0; /* runs are never cut */
    *span = len - *first;
}

static int64_t task_parts(const attention_job *job, int64_t task) {
    int64_t r0, n, first, span;
    task_span(job, task, &r0, &n, &first, &span);
    return (span + ATTEND_PART - 1) / ATTEND_PART;
}

/* Part `part` of a task: its heads (each row's query heads of the task's key-value head, row by row) over their
 * tokens in that part, each over its own row's context */
static void attend_task_part(const attention_job *job, int64_t task, int64_t part, float *peak, float *total,
                             float *weighed) {
    int64_t r0, n, first, span, group = job->heads / job->kv_heads, g = task % job->kv_heads, d = job->head_dim;
    task_span(job, task, &r0, &n, &first, &span);
    int64_t start = part * ATTEND_PART, len = span - start < ATTEND_PART ? span - start : ATTEND_PART;
    int64_t own[n * group];
    float run_q[n == 1 ? 1 : n * group * d];
    const float *q = job->q + r0 * job->q_row_stride + g * group * d; /* one row's heads in place */
    for (int64_t i = 0; i < n; i++) {
        int64_t row_len = (n == 1 ? span : job->context_lens[r0 + i]) - start;
        for (int64_t h = 0; h < group; h++) own[i * group + h] = row_len < 0 ? 0 : row_len < len ? row_len : len;
        if (n > 1) memcpy(run_q + i * group * d, q + i * job->q_row_stride, group * d * sizeof(float));
    }
    const int64_t *offsets = job->offsets + job->starts[job->row_seqs[r0]] + first + start;
    const f16 *keys = job->cache + g * d, *values = job->cache + (job->kv_heads + g) * d;
    job->attend(n == 1 ? q : run_q, n * group, keys, values, offsets, len, own, d, job->scale, peak, total, weighed);
}

/* A task's parts folded in order (each computed here, or found at parts, where not NULL), divided into its rows' out */
static void finish_task(const attention_job *job, int64_t task, const float *parts, float *out) {
    int64_t r0, n, first, span, group = job->heads / job->kv_heads, g = task % job->kv_heads, d = job->head_dim;
    task_span(job, task, &r0, &n, &first, &span);
    int64_t heads = n * group, count = task_parts(job, task), width = heads * (2 + d);
    float peak[heads], total[heads], weighed[heads * d], part[parts ? 1 : width];
    for (int64_t p = 0; p < count; p++) {
        const float *found = parts ? parts + p * width : part;
        if (!parts) attend_task_part(job, task, p, part, part + heads, part + 2 * heads);
        fold_part(heads, d, p == 0, peak, total, weighed, found, found + heads, found + 2 * heads);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < group; h++)
            for (int64_t j = 0; j < d; j++)
                out[((r0 + i) * job->heads + g * group + h) * d + j] = weighed[(i * group + h) * d + j] / total[i * group + h];
}

/* Runs' parts spread over the threads, an item each key-value head of a run's part, in the order run, part, head:
 * a part's heads are taken together, as their keys and values lie side by side in the part's slots (a task took
 * one head's whole context, reading 128 bytes of each 2 KB slot: a decode after 4,000 tokens, 16 layers of the 1B
 * shape, 13.3 ms, now 10.4; Xeon). Then each task's parts are folded in order, as finish_task folds its own. */
static void attend_in_parts(const attention_job *job, int64_t runs, int threads, float *out) {
    const int64_t kv = job->kv_heads, group = job->heads / kv, d = job->head_dim;
    int64_t first_part[runs + 1], base[runs + 1]; /* each run's first part, and where its tasks' parts are kept */
    first_part[0] = base[0] = 0;
    for (int64_t run = 0; run < runs; run++) {
        int64_t parts = task_parts(job, run * kv);
        first_part[run + 1] = first_part[run] + parts;
        base[run + 1] = base[run] + parts * kv * job->run_rows[run] * group * (2 + d);
    }
    float *parts = malloc(base[runs] * sizeof(float));
    /* a thread takes a part's heads together where there are parts enough to share out (one head's reads warm the
     * next's in its own caches: 12.5 ms above where the threads took a head at a time), else a head at a time */
    const int chunk = first_part[runs] >= 4 * threads ? (int)kv : 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, chunk)
        for (int64_t item = 0; item < first_part[runs] * kv; item++) {
            int64_t run = 0;
            while (first_part[run + 1] * kv <= item) run++;
            int64_t part = (item - first_part[run] * kv) / kv, g = item % kv, heads_of = job->run_rows[run] * group;
            float *at = parts + base[run] + (g * (first_part[run + 1] - first_part[run]) + part) * heads_of * (2 + d);
            attend_task_part(job, run * kv + g, part, at, at + heads_of, at + 2 * heads_of);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < runs * kv; task++) {
            int64_t run = task / kv, per_task = (first_part[run + 1] - first_part[run]) * job->run_rows[run] * group;
            finish_task(job, task, parts + base[run] + task % kv * per_task * (2 + d), out);
        }
    }
    free(parts);
}

/* Query rows over their sequences' cached contexts, which already hold the rows' own keys and values: a decode's
 * one token, or each token of a prefill chunk, which sees its sequence up to itself. q: [rows, heads, D] with a
 * row stride; cache: [slots, 2 * kv_heads, D]; block_table: [seqs, max_blocks]; row_seqs: [rows], each row's
 * table row; context_lens: [rows], the tokens each row sees, itself included (of which the last window, where
 * window > 0); out: [rows, heads * D]. A run of one sequence's consecutive rows attends at once, as one group of
 * query heads over the run's longest context with each head over its own row's (attend_part): each key and value
 * is read once for the run instead of once per row, and each row's result is the one it gets alone. Each run's
 * key-value heads are independent tasks, handed out dynamically (see the top); where there are fewer than two a
 * thread, or every run is a decode's one row (whose contexts grow long), the parts of their contexts are
 * (ATTEND_PART), a part's heads one after another (attend_in_parts). */
void paged_attention(const float *q, int64_t q_row_stride, const f16 *cache, const int64_t *block_table,
                     int64_t seqs, int64_t max_blocks, const int64_t *row_seqs, const int64_t *context_lens,
                     int64_t block_size, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float scale, int64_t window, int threads) {
    int64_t group = heads / kv_heads, slot_width = 2 * kv_heads * head_dim, total = 0, work = 0;
    int64_t lens[seqs], starts[seqs]; /* a sequence's slots, read by all its rows: as many as its last row sees */
    for (int64_t s = 0; s < seqs; s++) lens[s] = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t *len = lens + row_seqs[r];
        *len = context_lens[r] > *len ? context_lens[r] : *len;
        work += context_lens[r];
    }
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++) starts[s] = total, total += lens[s], longest = lens[s] > longest ? lens[s] : longest;
    int64_t *offsets = malloc(total * sizeof(int64_t)); /* each token's slot, as an element offset */
    for (int64_t s = 0; s < seqs; s++)
        for (int64_t t = 0; t < lens[s]; t++)
            offsets[starts[s] + t] = (block_table[s * max_blocks + t / block_size] * block_size + t % block_size) * slot_width;
    int64_t part = longest < ATTEND_PART ? longest : ATTEND_PART;
    int64_t most = rows * kv_heads / (2 * threads), fits = RUN_SCORES / ((part + 15) * group * (int64_t)sizeof(float));
    most = most < RUN_ROWS ? most : RUN_ROWS;
    most = most < fits ? most : fits;
    int64_t *run_start = malloc(2 * rows * sizeof(int64_t)), *run_rows = run_start + rows;
    int64_t runs = row_runs(row_seqs, context_lens, rows, window, most > 1 ? most : 1, run_start, run_rows);
    attention_job job = {q, q_row_stride, cache, offsets, starts, row_seqs, context_lens, run_start, run_rows,
                         heads, kv_heads, head_dim, window, scale,
                         head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any};
    int64_t tasks = runs * kv_heads, parallel = work * heads >= 2048;
    if (parallel && (tasks < 2 * threads || runs == rows)) { /* few tasks, or decodes (one row a run) */
        attend_in_parts(&job, runs, threads, out);
    } else {
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (parallel)
        for (int64_t task = 0; task < tasks; task++) finish_task(&job, task, NULL, out);
    }
    free(run_start);
    free(offsets);
}
