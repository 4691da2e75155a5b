/* A weight tile's pass over a few rows of activations, its sums in registers: the passes packed_mm.c hands out (its
 * comment has the arithmetic and the order of the work). */
#ifndef WSGI_INFER_REGISTER_PASSES_H
#define WSGI_INFER_REGISTER_PASSES_H
#include "rotated.h"
#include "sub_blocks.h"

#if QL == 16
#define ROWS_AT_ONCE 16 /* rows whose sums stay in registers beside a sub-block's 8 codes: 29 of 32 */
#elif SUMS_IN_16_BITS
#define ROWS_AT_ONCE 8 /* 8 rows' 16-bit sums in 16 registers beside a quad of the weight (dot_rows) */
#else
#define ROWS_AT_ONCE 4 /* 16 registers */
#endif
_Static_assert(ACT_ROWS % ROWS_AT_ONCE == 0, "a pass's rows lie in one group of activations (activations.h)");
/* rows whose integer sums are made together: all of a pass's where they are 16-bit sums (dot_products.h's dot_rows),
 * else one row's at a time */
#define SUM_ROWS (SUMS_IN_16_BITS ? ROWS_AT_ONCE : 1)
/* how far ahead of a tile's sub-block its weight is fetched: at least this, in whole blocks. Rounded down, a
 * K-quant's block (2,304-3,360 bytes) fetched its own sub-block: a 16-row Q6_K step ran at 199 G MAC/s, now 294.
 * 8 KB rather than 4 with 8-lane registers (Zen 4's AVX2 build, the 1B Q4_K_M): 4 streams in process 29.4 -> 32.4
 * and 29.3 -> 33.8 steps/s (every round of 5 faster), served 96.7 -> 103.5 tok/s; 1 and 16 streams +3%. AVX-512's
 * gained 7% at 4 streams in process and lost 9% served: kept at 4 KB */
#define PREFETCH_BYTES (QL == 8 ? 8192 : 4096)
/* whether a one-row pass (a decode's, the last over its tile) fetches its weight non-temporal, as on AMD's cores,
 * or into L2 as a pass of more rows does. prefetchnta gained Zen 4 3% of one stream (below), but halved it on an
 * Intel Xeon with AMX (family 6 model 167, the 1B Q4_0 in process: 16.1 tok/s against 31-36 with prefetcht0 or
 * prefetcht2, which was best: 36.1 against 31.9 steps/s, Q4_K_M 32.9 against 30.1) */
static int one_row_non_temporal;
#if defined(__x86_64__)
__attribute__((constructor)) static void pick_one_row_fetch(void) {
    __builtin_cpu_init();
    one_row_non_temporal = __builtin_cpu_is("amd");
}
#endif
/* sub-blocks ahead that a pass's activations are fetched, with 8-lane registers (0: not; AVX-512 not measured) */
#define ACT_AHEAD (QL == 8 ? 4 : 0)


/* whether a whole group's pass of `type` reads its activations rotated (rotated.h) */
static inline int reads_rotated(const int type, const int planes) { return ROTATED && integer_sums(type, planes); }

/* rows' integer sums of a decoded sub-block times their activation blocks (row r's at a + r * act), less the
 * offset's: per half of 16 inputs, or both together */
ALWAYS_INLINE void rows_sums(const int type, const decoded *w, const int planes, const uint8_t *a, const int64_t act,
                             const int rows, ivec lo[], ivec hi[]) {
    const int codes = code_kind(type), offset = code_offset(type), split = halves_scaled(type);
    dot_rows(w->w, (const int8_t *)(a + sizeof(act_head)), act, rows, codes, split, NULL, 0, lo, hi);
    if (planes == 2) {
        ivec lo2[SUM_ROWS], hi2[SUM_ROWS];
        dot_rows(w->w, (const int8_t *)(a + sizeof(act_head) + QK), act, rows, codes, split, NULL, 0, lo2, hi2);
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
 * beside the codes (each byte of the weight then used while it is in L1), else one at a time. A whole group's
 * K-quant sums in 16 bits read its rotation instead (rotated.h: rot, the group's first block's lines). `fetch`:
 * whether the weight comes from memory (a task's first pass over its tile) and is prefetched. */
ALWAYS_INLINE void tile_rows(const int type, const int planes, const int rows, const int parts, int h0,
                             const uint8_t *tile, int64_t blocks, const uint8_t *x, const uint8_t *rot, float *out,
                             int64_t out_stride, int width, int fetch) {
    const int64_t bytes = block_bytes(type), subs = sub_blocks(type), act = ACT_BYTES(planes);
    const int rotated = rows == ACT_ROWS && reads_rotated(type, planes);
    fvec acc[HALVES][ROWS_AT_ONCE]; /* not [rows]: an array of variable size lives in memory */
    for (int h = 0; h < parts; h++)
        for (int r = 0; r < rows; r++) acc[h][r] = (fvec){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = tile + b * bytes;
        fvec sb[HALVES][ROWS_AT_ONCE]; /* a K-quant's super-block's sums: float, or integer (k_sums.h) */
        ivec isb[HALVES][ROWS_AT_ONCE];
        for (int h = 0; h < parts; h++)
            for (int r = 0; r < rows; r++) sb[h][r] = (fvec){0}, isb[h][r] = (ivec){0};
        k_scales ks[HALVES]; /* Q4_K's and Q5_K's, unpacked once for the super-block's sub-blocks */
        for (int h = 0; h < parts && has_k_scales(type); h++) ks[h] = k_unpack_scales(block + 64, h0 + h);
        for (int j = 0; j < subs; j++) {
            /* the weight streams: fetch what the sub-block PREFETCH_BYTES (or more) on reads. A one-row pass is
             * the last over its tile (both halves at once), so on AMD its lines are fetched non-temporal: a decode
             * step streams the whole model through the caches, and otherwise evicts what the step reads again (the
             * activations, the KV cache, the norms); one stream of the 1B Q4_0 +3.3%, Q4_K_M +2.8% (Zen 4). A pass
             * of more rows fetches them into L2 only, not L1, which keeps the lines the pass reads over and over
             * (its rows' activations): the 1B Q4_K_M's steps of 4, 8 and 16 streams from memory, Zen 4, were 18%,
             * 11% and 0% faster (VNNI) and 25%, 24% and 14% (AVX2), 2 unchanged (AMD's cores before Zen 4 fill L1
             * for this hint too, as before). The passes after a task's first find the tile in L1 and L2, and their
             * prefetches only cost instructions (AVX2 build, Zen 4, 512 rows of 4,096 x 2,048: Q4_K 234 -> 246 G
             * MAC/s, Q6_K 170 -> 185) */
            const uint8_t *ahead = block + (PREFETCH_BYTES + bytes - 1) / bytes * bytes + j * (bytes / subs);
            for (int64_t line = 0; fetch && line < bytes / subs; line += 64) {
                if (rows == 1 && one_row_non_temporal)
                    __builtin_prefetch(ahead + line, 0, 0);
                else
                    __builtin_prefetch(ahead + line, 0, 1); /* prefetcht2 */
            }
#if ACT_AHEAD
            /* and the pass's activations: rows of 8,192 inputs outran the hardware's prefetch (Zen 3, 512 rows of
             * Q4_K: 64 G MAC/s, 115 with this and ACT_ROWS of 8; 2,048 inputs 119 -> 129) */
            const uint8_t *act_ahead = rotated ? rot + (b * subs + j + ACT_AHEAD) * ROT_BYTES
                                               : x + (b * subs + j + ACT_AHEAD) * ACT_ROWS * act;
            for (int64_t line = 0; line < (rotated ? ROT_BYTES : rows * act); line += 64)
                __builtin_prefetch(act_ahead + line);
#endif
            for (int h = 0; h < parts; h++) {
                decoded w;
                decode(type, block, j, h0 + h, ks + h, &w);
#pragma GCC unroll 16
                for (int r0 = 0; r0 < rows; r0 += SUM_ROWS) {
                    const int n = rows - r0 < SUM_ROWS ? rows - r0 : SUM_ROWS;
                    const uint8_t *a0 = x + ((b * subs + j) * ACT_ROWS + r0) * act;
                    if (integer_sums(type, planes)) {
                        k_rows_sums(type, &w, rotated ? rot + (b * subs + j) * ROT_BYTES : a0, act, n, rotated,
                                    isb[h] + r0);
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
                    k_add_totals(type, block, h0 + h, rows,
                                 rotated ? rot + b * subs * ROT_BYTES : x + b * subs * ACT_ROWS * act, act, rotated,
                                 isb[h], acc[h]);
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
    for (int h = 0; h < parts; h++) {
        if (rotated) diagonals_to_rows(acc[h]);
        store_rows(acc[h], rows, h0 + h, width, out, out_stride);
    }
}

ALWAYS_INLINE void tile_pass(const int type, const int planes, const int rows, const uint8_t *tile, int64_t blocks,
                             const uint8_t *x, const uint8_t *rot, float *out, int64_t out_stride, int width,
                             int fetch) {
    if (HALVES == 1 || rows > 2) {
        for (int h = 0; h < HALVES; h++)
            tile_rows(type, planes, rows, 1, h, tile, blocks, x, rot, out, out_stride, width, fetch);
    } else {
        tile_rows(type, planes, rows, HALVES, 0, tile, blocks, x, rot, out, out_stride, width, fetch);
    }
}
#endif
