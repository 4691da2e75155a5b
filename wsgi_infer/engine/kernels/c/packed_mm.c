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
#include "sub_blocks.h"

#if QL == 16
#define ROWS_AT_ONCE 16 /* rows whose sums stay in registers beside a sub-block's 8 codes: 29 of 32 */
#elif SUMS_IN_16_BITS
#define ROWS_AT_ONCE 8 /* 8 rows' 16-bit sums in 16 registers beside a quad of the weight (dot_rows) */
#else
#define ROWS_AT_ONCE 4 /* 16 registers */
#endif
_Static_assert(ACT_ROWS % ROWS_AT_ONCE == 0, "a pass's rows lie in one group of activations (activations.h)");
/* rows whose integer sums are made together: all of a pass's where they are 16-bit sums (quant_simd.h's dot_rows),
 * else one row's at a time */
#define SUM_ROWS (SUMS_IN_16_BITS ? ROWS_AT_ONCE : 1)
/* how far ahead of a tile's sub-block its weight is fetched: at least this, in whole blocks. Rounded down, a
 * K-quant's block (2,304-3,360 bytes) fetched its own sub-block: a 16-row Q6_K step ran at 199 G MAC/s, now 294 */
#define PREFETCH_BYTES 4096
/* sub-blocks ahead that a pass's activations are fetched, with 8-lane registers (0: not; AVX-512 not measured) */
#define ACT_AHEAD (QL == 8 ? 4 : 0)


/* rows' integer sums of a decoded sub-block times their activation blocks (row r's at a + r * act), less the
 * offset's: per half of 16 inputs, or both together */
ALWAYS_INLINE void rows_sums(const int type, const decoded *w, const int planes, const uint8_t *a, const int64_t act,
                             const int rows, ivec lo[], ivec hi[]) {
    const int codes = code_kind(type), offset = code_offset(type), split = halves_scaled(type);
    dot_rows(w->w, (const int8_t *)(a + sizeof(act_head)), act, rows, codes, split, NULL, lo, hi);
    if (planes == 2) {
        ivec lo2[SUM_ROWS], hi2[SUM_ROWS];
        dot_rows(w->w, (const int8_t *)(a + sizeof(act_head) + QK), act, rows, codes, split, NULL, lo2, hi2);
        for (int r = 0; r < rows; r++) {
            lo[r] = two_planes(lo[r], lo2[r]);
            hi[r] = two_planes(hi[r], hi2[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const act_head *head = (const act_head *)(a + r * act);
        if (halves_scaled(type)) {
            lo[r] -= offset * head->sum_half[0];
            hi[r] -= offset * head->sum_half[1];
        } else {
            lo[r] += hi[r] - offset * head->sum;
        }
    }
}


/* --- a tile for a pass of rows: each sub-block decoded in registers ------------------------------------------ */

/* rows (a constant) of activations x (their first's first block; activations.h: the group's next row ACT_BYTES on,
 * the next block ACT_ROWS rows on) times one tile of `blocks` blocks: its first `width` outputs of each row into
 * out. `parts` of the tile's HALVES (QL rows each) at once, from `h0` on: both, where their sums fit the registers
 * beside the codes (each byte of the weight then used while it is in L1), else one at a time. */
ALWAYS_INLINE void tile_rows(const int type, const int planes, const int rows, const int parts, int h0,
                             const uint8_t *tile, int64_t blocks, const uint8_t *x, float *out, int64_t out_stride,
                             int width) {
    const int64_t bytes = block_bytes(type), subs = sub_blocks(type), act = ACT_BYTES(planes);
    fvec acc[HALVES][ROWS_AT_ONCE]; /* not [rows]: an array of variable size lives in memory */
    for (int h = 0; h < parts; h++)
        for (int r = 0; r < rows; r++) acc[h][r] = (fvec){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = tile + b * bytes;
        fvec sb[HALVES][ROWS_AT_ONCE]; /* a K-quant's super-block's sums: float, or integer (k_sums.h) */
        ivec isb[HALVES][ROWS_AT_ONCE];
        for (int h = 0; h < parts; h++)
            for (int r = 0; r < rows; r++) sb[h][r] = (fvec){0}, isb[h][r] = (ivec){0};
        for (int j = 0; j < subs; j++) {
            /* the weight streams: fetch what the sub-block PREFETCH_BYTES (or more) on reads. A one-row pass is
             * the last over its tile (both halves at once), so its lines are fetched non-temporal: a decode step
             * streams the whole model through the caches, and otherwise evicts what the step reads again (the
             * activations, the KV cache, the norms); one stream of the 1B Q4_0 +3.3%, Q4_K_M +2.8% (Zen 4) */
            const uint8_t *ahead = block + (PREFETCH_BYTES + bytes - 1) / bytes * bytes + j * (bytes / subs);
            for (int64_t line = 0; line < bytes / subs; line += 64) {
                if (rows == 1)
                    __builtin_prefetch(ahead + line, 0, 0);
                else
                    __builtin_prefetch(ahead + line);
            }
#if ACT_AHEAD
            /* and the pass's activations: rows of 8,192 inputs outran the hardware's prefetch (Zen 3, 512 rows of
             * Q4_K: 64 G MAC/s, 115 with this and ACT_ROWS of 8; 2,048 inputs 119 -> 129) */
            const uint8_t *act_ahead = x + (b * subs + j + ACT_AHEAD) * ACT_ROWS * act;
            for (int64_t line = 0; line < rows * act; line += 64) __builtin_prefetch(act_ahead + line);
#endif
            for (int h = 0; h < parts; h++) {
                decoded w;
                decode(type, block, j, h0 + h, &w);
#pragma GCC unroll 16
                for (int r0 = 0; r0 < rows; r0 += SUM_ROWS) {
                    const int n = rows - r0 < SUM_ROWS ? rows - r0 : SUM_ROWS;
                    const uint8_t *a0 = x + ((b * subs + j) * ACT_ROWS + r0) * act;
                    if (integer_sums(type, planes)) {
                        k_rows_sums(type, &w, a0, act, n, isb[h] + r0);
                        continue;
                    }
                    ivec lo[SUM_ROWS], hi[SUM_ROWS];
                    rows_sums(type, &w, planes, a0, act, n, lo, hi);
#pragma GCC unroll 16
                    for (int r = r0; r < r0 + n; r++) {
                        const uint8_t *a = a0 + (r - r0) * act;
                        if (is_k(type))
                            sb[h][r] = k_row_step(type, &w, a, lo[r - r0], hi[r - r0], sb[h][r]);
                        else
                            acc[h][r] = row_step(type, &w, a, lo[r - r0], acc[h][r]);
                    }
                }
            }
        }
        if (is_k(type)) { /* the super-block's activation scale, as its last block holds it */
            if (integer_sums(type, planes))
                for (int h = 0; h < parts; h++)
                    k_add_totals(type, block, h0 + h, rows, x + b * subs * ACT_ROWS * act, act, isb[h], acc[h]);
            else
                for (int h = 0; h < parts; h++)
                    for (int r = 0; r < rows; r++) {
                        const act_head *head = (const act_head *)(x + ((b * subs + subs - 1) * ACT_ROWS + r) * act);
                        acc[h][r] = fma_v(sb[h][r], splat_v(head->d), acc[h][r]);
                    }
            /* the totals kept in L1, read and written once a super-block, so that the registers hold 16 rows'
             * super-block sums beside the codes: 16 rows in one pass, each sub-block decoded once (3% faster than
             * two passes of 8, Zen 4) */
            __asm__("" : : "r"(acc) : "memory");
        }
    }
    for (int h = 0; h < parts; h++) store_rows(acc[h], rows, h0 + h, width, out, out_stride);
}

ALWAYS_INLINE void tile_pass(const int type, const int planes, const int rows, const uint8_t *tile, int64_t blocks,
                             const uint8_t *x, float *out, int64_t out_stride, int width) {
    if (HALVES == 1 || rows > 2) {
        for (int h = 0; h < HALVES; h++) tile_rows(type, planes, rows, 1, h, tile, blocks, x, out, out_stride, width);
    } else {
        tile_rows(type, planes, rows, HALVES, 0, tile, blocks, x, out, out_stride, width);
    }
}

typedef void (*pass_fn)(const uint8_t *, int64_t, const uint8_t *, float *, int64_t, int);
#define PASS(T, P, R)                                                                                               \
    static void pass_##T##_##P##_##R(const uint8_t *tile, int64_t blocks, const uint8_t *x, float *out,             \
                                    int64_t out_stride, int width) {                                               \
        tile_pass(T, P, R, tile, blocks, x, out, out_stride, width);                                                \
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
        kernels[chunk](tiles, blocks, job->x + act_offset(r, 0, k / QK, job->planes), job->out + r * job->w->n + first,
                       job->w->n, (int)width);
        r += 1 << chunk;
    }
}

/* out [rows, n] = x [rows, k] w^T (+ bias), with activations of `planes` (1: 8-bit, 2: the exact path); k a multiple
 * of every part's block. Tiles are the tasks: with few rows the weight streams from memory, and a thread reads best
 * long runs: guided grabs, half of what is left and then less, let the thread that ends first take the rest. */
void packed_mm(const float *x, int64_t rows, const packed_weight *w, float *out, int planes, int threads) {
    int k_quants = 0; /* K-quants' activations have one scale per super-block (where a fused weight has other parts
                       * too, theirs as well: they read each block's scale); others, one per block */
    for (int p = 0; p < w->count; p++) k_quants |= is_k((int)w->parts[p].type);
    uint8_t *act = quantize_activations(x, rows, w->k, planes, k_quants ? 256 : QK, threads);
    const int64_t tile_rows = amx_rows(rows);
    const int64_t block_rows = tile_rows ? amx_block_rows(w->k, planes) : register_block_rows(w->k, planes);
    const uint8_t *q = tile_rows && planes == 1 && k_quants ? amx_pair_codes(act, tile_rows, w->k, threads) : NULL;
    mm_job job = {w, act, rows, planes, out, tile_rows, block_rows, tile_count(w), q};
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
