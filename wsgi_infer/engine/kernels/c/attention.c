/* Attention over the paged KV cache (IEEE halves): each query row over its sequence's cached context, in float32. */
#include "common.h"

/* Vectors of the CPU's width (LANES tokens or dimensions): AVX2's 16 registers then hold what AVX-512's 32 do. */

/* LANES vectors of LANES transposed: v[i][j] and v[j][i] swap. A stage per halving B of the block size, each
 * swapping the off-diagonal blocks of size B between pairs of vectors: two two-input shuffles a pair. */
#define SWAP_BLOCKS(B, LOW, HIGH)                                                                                  \
    for (int i = 0; i < LANES; i++)                                                                                \
        if (!(i & B)) {                                                                                            \
            f32v a = v[i], b = v[i + B];                                                                           \
            v[i] = __builtin_shufflevector(a, b, LOW);                                                             \
            v[i + B] = __builtin_shufflevector(a, b, HIGH);                                                        \
        }
#if LANES == 16
#define LOW_8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HIGH_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LOW_4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HIGH_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LOW_2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HIGH_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LOW_1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HIGH_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline __attribute__((always_inline)) void transpose_v(f32v v[LANES]) {
    SWAP_BLOCKS(8, LOW_8, HIGH_8) SWAP_BLOCKS(4, LOW_4, HIGH_4) SWAP_BLOCKS(2, LOW_2, HIGH_2) SWAP_BLOCKS(1, LOW_1, HIGH_1)
}
#else
#define LOW_4 0, 1, 2, 3, 8, 9, 10, 11
#define HIGH_4 4, 5, 6, 7, 12, 13, 14, 15
#define LOW_2 0, 1, 8, 9, 4, 5, 12, 13
#define HIGH_2 2, 3, 10, 11, 6, 7, 14, 15
#define LOW_1 0, 8, 2, 10, 4, 12, 6, 14
#define HIGH_1 1, 9, 3, 11, 5, 13, 7, 15
static inline __attribute__((always_inline)) void transpose_v(f32v v[LANES]) {
    SWAP_BLOCKS(4, LOW_4, HIGH_4) SWAP_BLOCKS(2, LOW_2, HIGH_2) SWAP_BLOCKS(1, LOW_1, HIGH_1)
}
#endif

#define PREFETCH_AHEAD 8 /* tokens */

/* the part's keys, each block of LANES tokens transposed: keys_t[block][d] holds dimension d of the block's tokens
 * (zeros past len), so that a query's scores are vectors of multiply-adds, no sums across lanes */
static inline __attribute__((always_inline)) void transposed_keys(const f16 *keys, const int64_t *offsets,
                                                                  int64_t len, const int64_t head_dim, f32v *keys_t) {
    for (int64_t start = 0; start < len; start += LANES)
        for (int64_t c = 0; c < head_dim / LANES; c++) {
            f32v v[LANES];
            for (int64_t i = 0; i < LANES; i++) {
                int64_t t = start + i;
                if (t + PREFETCH_AHEAD < len) __builtin_prefetch(keys + offsets[t + PREFETCH_AHEAD] + LANES * c);
                v[i] = t < len ? load_halves(keys + offsets[t] + LANES * c) : (f32v){0};
            }
            transpose_v(v);
            memcpy(keys_t + (start / LANES) * head_dim + LANES * c, v, sizeof(v));
        }
}

#define SCORE_QUERIES 8 /* queries whose scores a key block's dimensions update at once: 8 independent chains */

/* the scores of each of `count` (a constant) queries from q over a block of transposed keys k, scaled, into
 * scores (a query's row stride apart): one chain of multiply-adds a query, over the dimensions in order */
static inline __attribute__((always_inline)) void score_block(const float *q, const int count, const f32v *k,
                                                              const int64_t head_dim, float scale, int64_t stride,
                                                              float *scores) {
    f32v acc[SCORE_QUERIES] = {{0}};
    for (int64_t d = 0; d < head_dim; d++)
        for (int m = 0; m < count; m++) acc[m] = fma_v(splat_v(q[m * head_dim + d]), k[d], acc[m]);
    for (int m = 0; m < count; m++) {
        f32v scaled = acc[m] * scale;
        memcpy(scores + m * stride, &scaled, sizeof(scaled));
    }
}

/* scores [group, stride] of each query over the part's tokens (whole blocks of 16): each query's arithmetic the
 * same whichever queries share its block */
static inline __attribute__((always_inline)) void score_tokens(const float *q, const int64_t group, const f32v *keys_t,
                                                               int64_t len, const int64_t head_dim, float scale,
                                                               int64_t stride, float *scores) {
    for (int64_t block = 0; block * LANES < len; block++) {
        const f32v *k = keys_t + block * head_dim;
        float *at = scores + LANES * block;
        int64_t m0 = 0;
        for (; m0 + SCORE_QUERIES <= group; m0 += SCORE_QUERIES)
            score_block(q + m0 * head_dim, SCORE_QUERIES, k, head_dim, scale, stride, at + m0 * stride);
        for (; m0 < group; m0++) /* the rest one at a time */
            score_block(q + m0 * head_dim, 1, k, head_dim, scale, stride, at + m0 * stride);
    }
}

#ifdef __AVX512F__
#define VALUE_SUMS 16 /* a query block's sums held in registers */
#else
#define VALUE_SUMS 12
#endif

/* weighed [group, D] = sum over each query's own tokens (lens) of weights [group, stride] times the tokens' values
 * (widened once into values_f), in token order: per query and dimension one chain, whichever queries share it. A
 * pass over the tokens takes as many queries and dimensions as VALUE_SUMS registers hold. */
static inline __attribute__((always_inline)) void weigh_values(const float *values_f, int64_t len, const int64_t *lens,
                                                               const int64_t group, const int64_t head_dim,
                                                               int64_t stride, const float *weights, float *weighed) {
    const int64_t chunks = head_dim / LANES;
    int64_t width = chunks < VALUE_SUMS ? chunks : VALUE_SUMS;
    while (chunks % width) width--; /* passes of whole widths: 12 of AVX2's 16 or 32 chunks (heads of 128, 256) ran
                                     * past the head into the next token's values and the next head's sums */
    const int64_t block = VALUE_SUMS / width;
    for (int64_t m0 = 0; m0 < group; m0 += block) {
        const int64_t count = group - m0 < block ? group - m0 : block;
        int64_t shortest = len;
        for (int64_t m = 0; m < count; m++) shortest = lens[m0 + m] < shortest ? lens[m0 + m] : shortest;
        for (int64_t c0 = 0; c0 < chunks; c0 += width) {
            f32v acc[VALUE_SUMS] = {{0}};
            for (int64_t t = 0; t < len; t++) {
                const f32v *value = (const f32v *)(values_f + t * head_dim) + c0;
                for (int64_t m = 0; m < block; m++) { /* a constant count: the sums stay in registers */
                    if (m >= count || (t >= shortest && t >= lens[m0 + m])) continue; /* past its own context */
                    f32v weight = splat_v(weights[(m0 + m) * stride + t]);
                    for (int64_t c = 0; c < width; c++) acc[m * width + c] = fma_v(weight, value[c], acc[m * width + c]);
                }
            }
            for (int64_t m = 0; m < count; m++)
                memcpy(weighed + (m0 + m) * head_dim + c0 * LANES, acc + m * width, width * sizeof(f32v));
        }
    }
}

/* scores [0, len) as exp(score - their largest), in place, and their sum; the largest (in *peak) and the sum run
 * per lane, then across the lanes (a serial sum took a dependent addition per score). The padding past len, up to a
 * whole block of 16 (the scores' stride leaves room), is computed, never counted. */
static inline float softmax_numerators(float *scores, int64_t len, float *peak_out) {
    i32v lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
    f32v most = (f32v){0} - INFINITY, sum = {0};
    for (int64_t t = 0; t < len; t += LANES) {
        f32v v;
        memcpy(&v, scores + t, sizeof(v));
        v = select_v(lane + (int32_t)t < (int32_t)len, v, most);
        most = select_v(v > most, v, most); /* a NaN never wins, as in a scan */
    }
    float peak = -INFINITY, total = 0.0f;
    for (int l = 0; l < LANES; l++) peak = most[l] > peak ? most[l] : peak;
    for (int64_t t = 0; t < len; t += 16) {
        f32x16 block;
        memcpy(&block, scores + t, sizeof(block));
        block = exp16(block - peak);
        memcpy(scores + t, &block, sizeof(block));
        for (int p = 0; p < 16; p += LANES) {
            f32v part;
            memcpy(&part, scores + t + p, sizeof(part));
            sum += select_v(lane + (int32_t)(t + p) < (int32_t)len, part, (f32v){0});
        }
    }
    for (int l = 0; l < LANES; l++) total += sum[l];
    *peak_out = peak;
    return total;
}

/* One part of softmax(q k^T * scale) v for the group query heads that share one key-value head: over the len cached
 * tokens at offsets, each head over its own first lens[h] of them (none, where lens[h] is 0), in float32. Per head:
 * weighed [group, D], the sum of each token's exp(score - peak) times its value; total, the sum of those
 * numerators; peak, the largest score. The part's keys are transposed and its values widened once for the whole
 * group, and each head's sums run in the order one head alone would run them (the scores of tokens past its own
 * are computed, never read), so a row's result never depends on the rows beside it. q: the group's heads, one after
 * another. */
static inline __attribute__((always_inline)) void attend_part(const float *q, const int64_t group, const f16 *keys,
                                                              const f16 *values, const int64_t *offsets, int64_t len,
                                                              const int64_t *lens, const int64_t head_dim, float scale,
                                                              float *peak, float *total, float *weighed) {
    const int64_t stride = (len + 15) / 16 * 16;
    float *scores = scratch(SCRATCH_SCORES, group * stride * sizeof(float));
    f32v *keys_t = scratch(SCRATCH_KEYS, stride * head_dim * sizeof(float));
    float *values_f = scratch(SCRATCH_VALUES, len * head_dim * sizeof(float));
    transposed_keys(keys, offsets, len, head_dim, keys_t);
    score_tokens(q, group, keys_t, len, head_dim, scale, stride, scores);
    for (int64_t h = 0; h < group; h++) total[h] = softmax_numerators(scores + h * stride, lens[h], peak + h);
    for (int64_t t = 0; t < len; t++)
        for (int64_t c = 0; c < head_dim / LANES; c++) {
            if (t + PREFETCH_AHEAD < len) __builtin_prefetch(values + offsets[t + PREFETCH_AHEAD] + LANES * c);
            f32v v = load_halves(values + offsets[t] + LANES * c);
            memcpy(values_f + t * head_dim + LANES * c, &v, sizeof(v));
        }
    weigh_values(values_f, len, lens, group, head_dim, stride, scores, weighed);
}

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

/* Query rows over their sequences' cached contexts, which already hold the rows' own keys and values: a decode's
 * one token, or each token of a prefill chunk, which sees its sequence up to itself. q: [rows, heads, D] with a
 * row stride; cache: [slots, 2 * kv_heads, D]; block_table: [seqs, max_blocks]; row_seqs: [rows], each row's
 * table row; context_lens: [rows], the tokens each row sees, itself included (of which the last window, where
 * window > 0); out: [rows, heads * D]. A run of one sequence's consecutive rows attends at once, as one group of
 * query heads over the run's longest context with each head over its own row's (attend_part): each key and value
 * is read once for the run instead of once per row, and each row's result is the one it gets alone. Each run's
 * key-value heads are independent tasks, handed out dynamically (see the top); where there are fewer than two a
 * thread (a decode or two, whose contexts grow long), the parts of their contexts are (ATTEND_PART). */
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
    if (tasks >= 2 * threads || !parallel) {
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (parallel)
        for (int64_t task = 0; task < tasks; task++) finish_task(&job, task, NULL, out);
    } else { /* few tasks: their parts spread over the threads, then folded in order */
        int64_t first_item[tasks + 1], width = RUN_ROWS * group * (2 + head_dim);
        first_item[0] = 0;
        for (int64_t task = 0; task < tasks; task++) first_item[task + 1] = first_item[task] + task_parts(&job, task);
        float *parts = malloc(first_item[tasks] * width * sizeof(float));
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < first_item[tasks]; item++) {
                int64_t task = 0;
                while (first_item[task + 1] <= item) task++;
                int64_t r0, n, first, span, heads_of = group;
                task_span(&job, task, &r0, &n, &first, &span);
                heads_of *= n;
                float *at = parts + first_item[task] * width + (item - first_item[task]) * heads_of * (2 + head_dim);
                attend_task_part(&job, task, item - first_item[task], at, at + heads_of, at + 2 * heads_of);
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) finish_task(&job, task, parts + first_item[task] * width, out);
        }
        free(parts);
    }
    free(run_start);
    free(offsets);
}
