/* Rows of activations times packed weights, in every format, with one arithmetic for every number of rows.
 *
 * Per output and per sub-block of 32 inputs (16 for Q6_K's halves), the integer sum of the weight's codes times
 * the row's 8-bit codes (one plane, or the exact path's two: 255 * hi + lo) is exact, and so is its offset term
 * where a format's offset is a fixed number of codes (Q4_0, Q5_0, Q6_K, and Q8_0 and IQ4 where their codes are
 * unsigned: the codes' sum minus the offset times the activations' sum). It is scaled, with s and m the weight's
 * scale and minimum (w = s * code + m) and d the activations' scale:
 *     32-input formats, d a block's:   acc = fma(float(sum), s * d, acc);  acc = fma(m, d * sum(q), acc)
 *     K-quants and IQ4_XS, d a super-block's: sb = fma(float(sum), s, sb);  sb = fma(m, sum(q), sb), sub-block
 *                                      after sub-block, then acc = fma(sb, d, acc)
 * (m terms where a format has its own minimums), block after block in input order: a multiply-add of floats costs
 * what a vpdpbusd does, and a K-quant's sub-block takes two rather than three. With one plane, Q4_K's, Q5_K's and
 * Q6_K's sub-block sums times their integer scales add up exactly over the super-block instead, each rounded once
 * (k_sums.h: 5% of a 1B prefill, Zen 3). Every build makes the same integers. A row's result depends on its own
 * activations alone: alone or in any batch, in any pass, on any thread, it is the same to the bit.
 *
 * A tile (16 outputs) takes the rows ROWS_AT_ONCE at a time: each pass decodes every sub-block into registers and
 * multiplies each of its rows by it, their sums in registers. One or two passes stream the weight from memory once;
 * a prefill's many passes read the tile again from L1 and L2, which beat decoding it once into a buffer there and
 * reading that back (a 512-row gate and up 7% faster). With AMX (amx_mm.c), multiplies of 48 rows and more take
 * their passes of 16 on the tiles instead, which do read a buffer. Tasks, handed out to the threads, are a tile's
 * block of rows, whose activations stay in L2 from one tile's task to the next.
 */
#include "amx_tiles.h"
#include "packed_mm.h"
#include "register_passes.h"

typedef void (*pass_fn)(const uint8_t *, int64_t, const uint8_t *, const uint8_t *, float *, int64_t, int, int);
#define PASS(T, P, R)                                                                                               \
    static void pass_##T##_##P##_##R(const uint8_t *tile, int64_t blocks, const uint8_t *x, const uint8_t *rot,     \
                                    float *out, int64_t out_stride, int width, int fetch) {                        \
        tile_pass(T, P, R, tile, blocks, x, rot, out, out_stride, width, fetch);                                    \
    }
#if ROWS_AT_ONCE == 16
#define PASSES_OF(T, P) PASS(T, P, 1) PASS(T, P, 2) PASS(T, P, 4) PASS(T, P, 8) PASS(T, P, 16)
#define PASS_ROW(T, P) {pass_##T##_##P##_1, pass_##T##_##P##_2, pass_##T##_##P##_4, pass_##T##_##P##_8, pass_##T##_##P##_16}
#define CHUNKS 5 /* row counts: 1, 2, 4, 8, 16 */
#elif ROWS_AT_ONCE == 8
#define PASSES_OF(T, P) PASS(T, P, 1) PASS(T, P, 2) PASS(T, P, 4) PASS(T, P, 8)
#define PASS_ROW(T, P) {pass_##T##_##P##_1, pass_##T##_##P##_2, pass_##T##_##P##_4, pass_##T##_##P##_8}
#define CHUNKS 4
#else
#define PASSES_OF(T, P) PASS(T, P, 1) PASS(T, P, 2) PASS(T, P, 4)
#define PASS_ROW(T, P) {pass_##T##_##P##_1, pass_##T##_##P##_2, pass_##T##_##P##_4}
#define CHUNKS 3
#endif
#define PASS_TYPE(T) PASSES_OF(T, 1) PASSES_OF(T, 2)
PASS_TYPE(Q4_0) PASS_TYPE(Q4_1) PASS_TYPE(Q5_0) PASS_TYPE(Q5_1) PASS_TYPE(Q8_0) PASS_TYPE(Q8_M)
PASS_TYPE(Q4_K) PASS_TYPE(Q5_K) PASS_TYPE(Q6_K) PASS_TYPE(IQ4_NL) PASS_TYPE(IQ4_XS)
#define PASS_TABLE(T) {PASS_ROW(T, 1), PASS_ROW(T, 2)}

static const int TYPES[] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_M, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS};
#define TYPE_COUNT 11
static const pass_fn PASS_KERNELS[TYPE_COUNT][2][CHUNKS] = {
    PASS_TABLE(Q4_0), PASS_TABLE(Q4_1), PASS_TABLE(Q5_0), PASS_TABLE(Q5_1),   PASS_TABLE(Q8_0),  PASS_TABLE(Q8_M),
    PASS_TABLE(Q4_K), PASS_TABLE(Q5_K), PASS_TABLE(Q6_K), PASS_TABLE(IQ4_NL), PASS_TABLE(IQ4_XS)};

static int type_index(int type) { /* of a format above: packed.py lays out no other */
    int i = 0;
    while (i < TYPE_COUNT - 1 && TYPES[i] != type) i++;
    return i;
}

/* --- the public multiply ------------------------------------------------------------------------------------ */

typedef struct {
    const packed_weight *w;
    const uint8_t *x;
    int64_t rows, planes;
    float *out;
    int64_t tile_rows;  /* the first rows, whole passes of AMX_ROWS, that take AMX's tiles (amx_mm.c) */
    int64_t block_rows; /* rows a task takes: a block of them (register_block_rows, or on the tiles amx_block_rows) */
    int64_t tiles;      /* the weight's tiles: a task is a tile's block of rows, blocks outer */
    const uint8_t *q;   /* the tiles' rows' codes in pairs of blocks (amx_pair_codes), for K-quants' 8-bit passes */
    const uint8_t *rot; /* the whole groups' rows rotated (rotated.h), for K-quants' passes of 16-bit sums */
} mm_job;

/* the part and tile of a task (tasks count the parts' tiles in order), and its first output */
static void task_tile(const packed_weight *w, int64_t task, int *part, int64_t *tile, int64_t *first) {
    int64_t start = 0;
    *part = 0, *tile = 0, *first = 0;
    for (int p = 0; p < w->count; p++) {
        int64_t tiles = (w->parts[p].n + TILE - 1) / TILE;
        if (task < tiles) {
            *part = p, *tile = task, *first = start + task * TILE;
            return;
        }
        task -= tiles, start += w->parts[p].n;
    }
}

static int64_t tile_count(const packed_weight *w) {
    int64_t tiles = 0;
    for (int p = 0; p < w->count; p++) tiles += (w->parts[p].n + TILE - 1) / TILE;
    return tiles;
}

/* rows a task takes on the registers: as many as keep their activations within 256 KB (k inputs), so that they stay
 * in L2 from one tile's task to the next, where a whole prefill chunk's (2 MB at 512 rows of 2,048 inputs) came from
 * L3 for every tile (Zen 4, 512 rows of 4,096 x 2,048 Q4_K: 287 -> 299 G MAC/s); at least 64, so that a weight is
 * read again at most every 64 rows (rows of 8,192 inputs gained nothing from blocks of 16) */
static int64_t register_block_rows(int64_t k, int planes) {
    const int64_t rows = (256 << 10) / (k / QK * ACT_BYTES(planes)) / ACT_ROWS * ACT_ROWS;
    return rows > 64 ? rows : 64;
}

/* a task's tile, its outputs for its block of rows, 16, 8, 4, 2 or 1 rows a pass (the tile stays in L1 and L2 from
 * pass to pass) */
static void tile_task(const mm_job *job, int64_t task) {
    int part, chunk = CHUNKS - 1;
    int64_t tile, first, row_block = task / job->tiles, start = row_block * job->block_rows;
    int64_t end = start + job->block_rows < job->rows ? start + job->block_rows : job->rows;
    task_tile(job->w, task % job->tiles, &part, &tile, &first);
    const packed_part *p = job->w->parts + part;
    int64_t k = job->w->k, blocks = k / block_inputs((int)p->type);
    int64_t width = p->n - tile * TILE < TILE ? p->n - tile * TILE : TILE;
    const uint8_t *tiles = p->tiles + tile * blocks * block_bytes((int)p->type);
    const pass_fn *kernels = PASS_KERNELS[type_index((int)p->type)][job->planes - 1];
    const int64_t on_tiles = (end < job->tile_rows ? end : job->tile_rows) - start;
    int64_t r = start;
    if (on_tiles > 0)
        r += amx_tile_passes((int)p->type, (int)job->planes, tiles, blocks,
                             job->x + act_offset(start, 0, k / QK, job->planes), amx_group_codes(job->q, start, k),
                             on_tiles, job->out + start * job->w->n + first, job->w->n, (int)width);
    while (r < end) {
        while ((1 << chunk) > end - r) chunk--;
        /* a whole group's pass: chunks only shrink, so its rows are group r / ACT_ROWS */
        const uint8_t *rot = job->rot && chunk == CHUNKS - 1 ? job->rot + r / ACT_ROWS * (k / QK) * ROT_BYTES : NULL;
        kernels[chunk](tiles, blocks, job->x + act_offset(r, 0, k / QK, job->planes), rot,
                       job->out + r * job->w->n + first, job->w->n, (int)width, r == start);
        r += 1 << chunk;
    }
}

/* out [rows, n] = x [rows, k] w^T (+ bias), with activations of `planes` (1: 8-bit, 2: the exact path); k a multiple
 * of every part's block. Tiles are the tasks: with few rows the weight streams from memory, and a thread reads best
 * long runs: guided grabs, half of what is left and then less, let the thread that ends first take the rest. */
void packed_mm(const float *x, int64_t rows, const packed_weight *w, float *out, int planes, int threads) {
    int k_quants = 0, rotate = 0; /* K-quants' activations have one scale per super-block (where a fused weight has
                                   * other parts too, theirs as well: they read each block's scale); others, one per
                                   * block */
    for (int p = 0; p < w->count; p++) {
        k_quants |= is_k((int)w->parts[p].type);
        rotate |= rows >= ACT_ROWS && reads_rotated((int)w->parts[p].type, planes);
    }
    uint8_t *act = quantize_activations(x, rows, w->k, planes, k_quants ? 256 : QK, threads);
    const int64_t tile_rows = amx_rows(rows);
    const int64_t block_rows = tile_rows ? amx_block_rows(w->k, planes) : register_block_rows(w->k, planes);
    const uint8_t *q = tile_rows && planes == 1 && k_quants ? amx_pair_codes(act, tile_rows, w->k, threads) : NULL;
    const uint8_t *rot = rotate ? rotate_activations(act, rows, w->k, threads) : NULL;
    mm_job job = {w, act, rows, planes, out, tile_rows, block_rows, tile_count(w), q, rot};
    const int64_t tasks = job.tiles * ((rows + block_rows - 1) / block_rows);
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) tile_task(&job, task);
    if (w->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w->n; i++) out[r * w->n + i] += w->bias[i];
}

/* The most rows a packed multiply computes in one pass over its weight (a draft's verification of one token more
 * costs little more than reading the weights there) */
int packed_rows_per_pass(void) { return ROWS_AT_ONCE; }

/* 1 where a decode's one-row passes fetch their weight non-temporal (AMD's cores), 0 where into L2 */
int packed_one_row_non_temporal(void) { return one_row_non_temporal; }
